#!/usr/bin/env python
"""Serving benchmark in the shape of vLLM's benchmark_serving.py: streaming chat completions sent
over HTTP to `dspark serve`, one server per contender (`--scheduler` auto against none: DSpark
against the target alone, same bundle and build), started here one at a time on 127.0.0.1.

Requests: one seeded sequence drawn as an equal mix of the benchmark prompt sets
(../shared/data/bench, first turns), the same for every contender; each load point takes its own
slice of it (so no point re-sends another's prompts into the servers' prefix reuse). Per request:
time to first token (TTFT), the gaps between streamed content chunks (ITL; a DSpark chunk may
carry several tokens), time per output token TPOT = (e2e - TTFT) / (output tokens - 1) as vLLM
computes it, e2e latency and output tokens (from `stream_options.include_usage`).

Load points, for every contender:
  --concurrency 1,4,16,32   closed loop: C workers, each sends its next request when the last ends
  --request-rates 0.5,1,2   open loop: Poisson arrivals (seeded exponential gaps), at most
                            --max-concurrency in flight when given (as vLLM's option)
  --rates-from-saturation 0.25,...,1.5
                            more Poisson rates: these multiples of the saturation throughput
                            (req/s) of `none` at the highest concurrency (`none` then runs first)
  --long-prompt-tokens 1500 while --long-prompt-concurrency streams run, a request with a prompt
                            of about that many tokens (bench prompts joined, a different one each
                            time) arrives at once and then every --long-prompt-interval s; reports
                            the other streams' ITL. Every scheduler then runs once per --prefill-chunks value
                            (`dspark serve --prefill-chunk`; 0: whole prompts); the other load
                            points run on the first value's servers.

Prints a table per contender (TTFT, TPOT, ITL at p50/p90/p99 in ms, req/s, output tok/s,
completed/failed) and the ratios DSpark / none at each load point; writes every figure to --out
(JSON) and a PNG beside it (median TPOT against output tok/s, one line per contender).

    python scripts/bench_serving.py --bundle engines/smollm2 --concurrency 1,4,16,32 \\
        --request-rates 0.5,1,2 --out out/bench_serving.json
    python scripts/bench_serving.py --bundle engines/smollm2 --concurrency 1,8,32 \\
        --rates-from-saturation 0.25,0.5,0.75,1.0,1.25,1.5 --num-requests 128
    python scripts/bench_serving.py --bundle engines/smollm2 --concurrency 4 --long-prompt-tokens 1500 \\
        --prefill-chunks 64,256,0
    python scripts/bench_serving.py --url http://127.0.0.1:8000 --concurrency 1,4   # a running server

The servers are started with `--log-level warning`, their output in a .log beside --out; the
client sends $DSPARK_API_KEY as its key when it is set (the servers started here read it too).

This is a benchmark, not a test: it prints figures, it asserts nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import http.client
import itertools
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dspark.runtime.cpu import cpu_signature
from dspark.runtime.errors import DSparkError
from dspark.runtime.schedulers import NAMES
from dspark.runtime.tools.plots import pyplot
from dspark.runtime.tools.prompts import bench_prompts, default_bench_dir

if TYPE_CHECKING:
    from openai import AsyncOpenAI

FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")
PERCENTILES = (50, 90, 99)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
STOP_WAIT_S = 20  # after SIGTERM, before SIGKILL


class BenchError(Exception):
    """The benchmark cannot go on: no server, a server that does not start or fails its warm-up."""


@dataclass(frozen=True)
class Config:
    bundle: Path | None
    url: str | None
    data_dir: Path
    datasets: list[str]
    contenders: list[str]
    concurrency: list[int]
    request_rates: list[float]
    rates_from_saturation: list[float]
    max_concurrency: int | None
    num_requests: int
    max_tokens: int
    temperature: float
    seed: int
    max_prompt_chars: int
    warmup: int
    long_prompt_tokens: int
    long_prompt_concurrency: int
    long_prompt_interval: float
    long_prompt_max_tokens: int
    prefill_chunks: list[int]
    slots: int
    max_queue: int
    server_args: list[str]
    startup_timeout: float
    request_timeout: float
    max_seconds: float
    out: Path


@dataclass(frozen=True)
class Contender:
    scheduler: str  # "url": the server --url names
    prefill_chunk: int | None = None  # None: the server's default

    @property
    def name(self) -> str:
        return self.scheduler if self.prefill_chunk is None else f"{self.scheduler} chunk={self.prefill_chunk}"


@dataclass(frozen=True)
class LoadPoint:
    mode: str  # "concurrency" (closed loop), "poisson" (open loop) or "long" (long-prompt arrivals)
    concurrency: int | None = None
    rate: float | None = None  # req/s

    @property
    def name(self) -> str:
        if self.mode == "poisson":
            return f"rate={self.rate:.3g}/s"
        return f"{'long ' if self.mode == 'long' else ''}c={self.concurrency}"


@dataclass
class RequestResult:
    ok: bool
    start: float  # perf_counter seconds
    end: float
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


# --- requests ---------------------------------------------------------------------------------------

def request_sequence(cfg: Config, n: int) -> tuple[list[str], dict[str, int]]:
    """n prompts, set by set in turn (every slice an equal mix up to one), each set's prompts of at
    most --max-prompt-chars shuffled with the seed; and how many prompts each set kept."""
    rng = random.Random(cfg.seed)
    pools = {}
    for name in cfg.datasets:
        every = bench_prompts(name, sys.maxsize, data_dir=cfg.data_dir / "bench")
        kept = [p for p in every if len(p) <= cfg.max_prompt_chars]
        if not kept:
            raise BenchError(f"{name}: no prompt of at most {cfg.max_prompt_chars} characters (--max-prompt-chars)")
        rng.shuffle(kept)
        pools[name] = kept
    k = len(pools)
    seq = [pools[cfg.datasets[i % k]][i // k % len(pools[cfg.datasets[i % k]])] for i in range(n)]
    return seq, {name: len(pool) for name, pool in pools.items()}


def long_prompt(pool: list[str], j: int, chars: int) -> str:
    """The j-th long prompt: pool prompts joined from offset j, cut to `chars` characters; its
    first words differ from every other j's, so no server reuses one's prefix for the next."""
    parts, size, i = [f"Request {j}. Answer the last question below.\n"], 0, j
    while size < chars:
        parts.append(pool[i % len(pool)])
        size += len(parts[-1]) + 2
        i += 1
    return "\n\n".join(parts)[:chars]


async def send(client: AsyncOpenAI, model: str, prompt: str, max_tokens: int, cfg: Config) -> RequestResult:
    """One streaming chat completion, timed chunk by chunk; any failure is a failed result."""
    start = time.perf_counter()
    ttft, last, itl, usage = None, start, [], None
    try:
        async with asyncio.timeout(cfg.request_timeout):
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                temperature=cfg.temperature, stream=True, stream_options={"include_usage": True})
            async with stream:
                async for chunk in stream:
                    now = time.perf_counter()
                    usage = chunk.usage or usage
                    if chunk.choices and chunk.choices[0].delta.content:
                        if ttft is None:
                            ttft = now - start
                        else:
                            itl.append(now - last)
                        last = now
        end = time.perf_counter()
        if usage is None:
            raise BenchError("the stream had no usage chunk")
    except Exception as e:  # every failure is counted, the first few distinct ones shown
        return RequestResult(False, start, time.perf_counter(), error=f"{type(e).__name__}: {e}"[:300])
    return RequestResult(True, start, end, end - start if ttft is None else ttft, itl, usage.completion_tokens,
                         usage.prompt_tokens)


# --- load modes (each appends its results to `out` as they end, so a cut-off run keeps them) ----------

Send = Callable[[str], Awaitable[RequestResult]]


async def closed_loop(send_one: Send, prompts: list[str], concurrency: int, out: list[RequestResult]) -> None:
    todo = iter(prompts)

    async def worker() -> None:
        for prompt in todo:
            out.append(await send_one(prompt))

    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(worker())


async def poisson(send_one: Send, prompts: list[str], rate: float, max_concurrency: int | None, seed: int,
                  out: list[RequestResult]) -> None:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(prompts))

    async def one(prompt: str) -> None:
        async with limit:
            out.append(await send_one(prompt))

    async with asyncio.TaskGroup() as tg:
        for i, prompt in enumerate(prompts):
            if i:
                await asyncio.sleep(rng.expovariate(rate))
            tg.create_task(one(prompt))


async def long_arrivals(send_one: Send, send_long: Callable[[int], Awaitable[RequestResult]], prompts: list[str],
                        concurrency: int, interval: float, out: list[RequestResult],
                        long_out: list[RequestResult]) -> None:
    """`concurrency` closed-loop streams over `prompts`; meanwhile a long request at once and then every
    `interval` s until the streams are done."""
    async def collect(j: int) -> None:
        long_out.append(await send_long(j))

    async with asyncio.TaskGroup() as tg:
        streams = tg.create_task(closed_loop(send_one, prompts, concurrency, out))
        for j in itertools.count():
            tg.create_task(collect(j))
            if (await asyncio.wait({streams}, timeout=interval))[0]:
                break


# --- figures ----------------------------------------------------------------------------------------

def percentiles(seconds: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 and the mean, in ms (None without values)."""
    if not seconds:
        return {f"p{q}": None for q in PERCENTILES} | {"mean": None}
    ms = np.asarray(seconds) * 1000
    return {f"p{q}": float(np.percentile(ms, q)) for q in PERCENTILES} | {"mean": float(ms.mean())}


def summarize(point: LoadPoint, duration: float, results: list[RequestResult], requests: int, truncated: bool,
              long_results: list[RequestResult] | None = None) -> dict:
    """A load point's figures; `duration`: from its first request to its last answer (or its cut-off)."""
    done = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in done)
    summary = {
        **asdict(point), "name": point.name, "requests": requests, "completed": len(done),
        "failed": len(results) - len(done), "truncated": truncated,
        "errors": sorted({r.error for r in results if not r.ok})[:5], "duration_s": duration,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": tokens / duration if duration > 0 else 0.0, "output_tokens": tokens,
        "ttft_ms": percentiles([r.ttft for r in done]),
        "tpot_ms": percentiles([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": percentiles([g for r in done for g in r.itl]),
        "e2e_ms": percentiles([r.e2e for r in done]),
    }
    if long_results is not None:
        long_done = [r for r in long_results if r.ok]
        summary["long"] = {"sent": len(long_results), "completed": len(long_done),
                           "failed": len(long_results) - len(long_done),
                           "prompt_tokens_mean": float(np.mean([r.prompt_tokens for r in long_done]))
                           if long_done else None,
                           "ttft_ms": percentiles([r.ttft for r in long_done])}
    return summary


COLUMNS = (f"{'point':>14} {'done':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9} "
           f"{'TTFT p50/p90/p99 ms':>22} {'TPOT p50/p90/p99 ms':>22} {'ITL p50/p90/p99 ms':>22}")


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def row(s: dict) -> str:
    def trio(p: dict) -> str:
        return "/".join(ms(p[f"p{q}"]) for q in PERCENTILES)

    line = (f"{s['name']:>14} {s['completed']:>5} {s['failed']:>4} {s['request_throughput']:>7.3f} "
            f"{s['output_throughput']:>9.1f} {trio(s['ttft_ms']):>22} {trio(s['tpot_ms']):>22} {trio(s['itl_ms']):>22}")
    if "long" in s:
        long = s["long"]
        line += f"  long prompts: {long['completed']}/{long['sent']}, their TTFT p50 {ms(long['ttft_ms']['p50'])} ms"
    if s["truncated"]:
        line += "  (cut off by --max-seconds)"
    return line


def ratios(contenders: list[Contender], results: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """Per load point, each DSpark contender against `none` with the same prefill chunk: output tok/s
    and median TPOT ratios."""
    out: dict[str, dict[str, dict]] = {}
    for c in contenders:
        base = Contender("none", c.prefill_chunk)
        if c.scheduler == "none" or base.name not in results:
            continue
        for point, s in results[c.name].items():
            b = results[base.name].get(point)
            if b is None or not b["output_throughput"] or not b["tpot_ms"]["p50"] or s["tpot_ms"]["p50"] is None:
                continue
            out.setdefault(point, {})[f"{c.name} / {base.name}"] = {
                "output_throughput": s["output_throughput"] / b["output_throughput"],
                "median_tpot": s["tpot_ms"]["p50"] / b["tpot_ms"]["p50"]}
    return out


def plot(results: dict[str, dict[str, dict]], path: Path) -> None:
    """Median TPOT against output tok/s, one line per contender; closed loop and Poisson side by side."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, mode, title in zip(axes, ("concurrency", "poisson"), ("closed loop (concurrency)", "Poisson arrivals")):
        for name, points in results.items():
            pts = sorted((s["output_throughput"], s["tpot_ms"]["p50"], s["name"]) for s in points.values()
                         if s["mode"] == mode and s["tpot_ms"]["p50"] is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=4, label=name)
                for x, y, label in pts:
                    ax.annotate(label, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel="output tokens/s", ylabel="median TPOT (ms)", title=title)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- servers ----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> str | None:
    """None when GET {url}/health answers 200, else why not."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return None if r.status == 200 else f"status {r.status}"
    except (OSError, http.client.HTTPException) as e:
        return str(getattr(e, "reason", e))


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while (why := healthy(url)) is not None:
        if proc.poll() is not None or time.monotonic() > deadline:
            state = (f"exited with {proc.returncode}" if proc.poll() is not None
                     else f"is not healthy after {timeout:.0f} s")
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            raise BenchError(f"the server {state} ({why}); {log}:\n{tail}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_WAIT_S)


@contextlib.contextmanager
def started(cfg: Config, contender: Contender, log: Path, timeout: float) -> Iterator[tuple[str, list[str]]]:
    """`dspark serve` for `contender` on a free loopback port until the block ends: (its URL, its command)."""
    port = free_port()
    cmd = [sys.executable, "-m", "dspark.runtime.tools.cli", "serve", *cfg.server_args, "--bundle", str(cfg.bundle),
           "--host", "127.0.0.1", "--port", str(port), "--slots", str(cfg.slots), "--max-queue", str(cfg.max_queue),
           "--scheduler", contender.scheduler, "--log-level", "warning"]
    if contender.prefill_chunk is not None:
        cmd += ["--prefill-chunk", str(contender.prefill_chunk)]
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, timeout, log)
        yield url, cmd
    finally:
        stop(proc)


# --- the run ----------------------------------------------------------------------------------------

@dataclass
class Run:
    """What the contenders share: the request sequence, the Poisson rates, the long prompts' size."""
    cfg: Config
    deadline: float  # time.monotonic()
    prompts: list[str]
    rates: list[float]
    saturation: dict | None = None
    chars_per_token: float | None = None
    blocks: dict[str, int] = field(default_factory=dict)  # load point -> its block of the sequence

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def points(self, contender: Contender) -> Iterator[LoadPoint]:
        """The contender's load points; the Poisson rates are read after the closed-loop points ran
        (the first of them may have measured the saturation)."""
        cfg = self.cfg
        if contender.prefill_chunk in (None, cfg.prefill_chunks[0]):
            yield from (LoadPoint("concurrency", c) for c in cfg.concurrency)
            yield from (LoadPoint("poisson", rate=r) for r in list(self.rates))
        if cfg.long_prompt_tokens:
            yield LoadPoint("long", cfg.long_prompt_concurrency)

    def slice(self, point: LoadPoint) -> list[str]:
        """The point's own prompts: after the warm-up's, a block of --num-requests, the same one for
        the same point of every contender."""
        start = self.cfg.warmup + self.blocks.setdefault(point.name, len(self.blocks)) * self.cfg.num_requests
        return self.prompts[start:start + self.cfg.num_requests]

    def saturate(self, contender: Contender, point: LoadPoint, summary: dict) -> None:
        """After the first closed-loop run at the highest concurrency, with --rates-from-saturation: the
        Poisson rates that are multiples of its req/s (to 3 significant digits, as the points are named)."""
        if point != LoadPoint("concurrency", max(self.cfg.concurrency)) or not self.cfg.rates_from_saturation \
                or self.saturation is not None:
            return
        req_s = summary["request_throughput"]
        self.saturation = {"contender": contender.name, "concurrency": point.concurrency, "req_s": req_s}
        for rate in (float(f"{m * req_s:.3g}") for m in self.cfg.rates_from_saturation):
            if rate > 0 and rate not in self.rates:
                self.rates.append(rate)
        print(f"saturation of {contender.name} at c={point.concurrency}: {req_s:.3f} req/s; Poisson rates "
              f"{', '.join(f'{r:.3g}' for r in self.rates)}", flush=True)


async def bench_server(run: Run, url: str, contender: Contender, results: dict[str, dict]) -> None:
    """Warm the server up, then every load point of `contender` into `results` (point name -> summary)."""
    from openai import AsyncOpenAI, OpenAIError

    cfg = run.cfg
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=os.environ.get("DSPARK_API_KEY", "unused"), max_retries=0,
                         timeout=cfg.request_timeout)
    async with client:
        try:
            model = (await client.models.list()).data[0].id
        except OpenAIError as e:
            raise BenchError(f"{url}/v1/models: {e}") from e
        warm = [await send(client, model, p, cfg.max_tokens, cfg) for p in run.prompts[:cfg.warmup]]
        if any(not r.ok for r in warm):
            raise BenchError(f"{contender.name}: the warm-up failed: {next(r.error for r in warm if not r.ok)}")
        if run.chars_per_token is None and warm:  # the first server's tokenizer sizes every long prompt
            run.chars_per_token = sum(map(len, run.prompts[:cfg.warmup])) / sum(r.prompt_tokens for r in warm)

        def send_one(prompt: str) -> Awaitable[RequestResult]:
            return send(client, model, prompt, cfg.max_tokens, cfg)

        def send_long(j: int) -> Awaitable[RequestResult]:
            chars = round(cfg.long_prompt_tokens * run.chars_per_token)
            return send(client, model, long_prompt(run.prompts, j, chars), cfg.long_prompt_max_tokens, cfg)

        print(f"\n{contender.name}: {url} ({model})\n{COLUMNS}", flush=True)
        for point in run.points(contender):
            if run.left() <= 0:
                break
            results[point.name] = await measure(run, point, send_one, send_long)
            print(row(results[point.name]), flush=True)
            run.saturate(contender, point, results[point.name])


async def measure(run: Run, point: LoadPoint, send_one: Send, send_long: Callable[[int], Awaitable[RequestResult]]
                  ) -> dict:
    """One load point, cut off at the run's deadline; its summary."""
    cfg, prompts = run.cfg, run.slice(point)
    out: list[RequestResult] = []
    long_out: list[RequestResult] | None = [] if point.mode == "long" else None
    t0, truncated = time.perf_counter(), False
    try:
        async with asyncio.timeout(run.left()):
            if point.mode == "concurrency":
                await closed_loop(send_one, prompts, point.concurrency, out)
            elif point.mode == "poisson":
                seed = cfg.seed + 1 + run.rates.index(point.rate)
                await poisson(send_one, prompts, point.rate, cfg.max_concurrency, seed, out)
            else:
                await long_arrivals(send_one, send_long, prompts, point.concurrency, cfg.long_prompt_interval, out,
                                    long_out)
    except TimeoutError:
        truncated = True
    end = time.perf_counter() if truncated else max((r.end for r in out), default=t0)
    return summarize(point, end - t0, out, len(prompts), truncated, long_out)


def header(argv: list[str]) -> dict:
    cpu = cpu_signature()
    return {"command": shlex.join([sys.executable, __file__, *argv]),
            "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "cpu_model": cpu["model"], "cores": cpu["cores"], "cpu_flags": {f: f in cpu["flags"] for f in FLAGS}}


def contenders_of(cfg: Config) -> list[Contender]:
    if cfg.url:
        return [Contender("url")]
    chunks: list[int | None] = list(cfg.prefill_chunks) if cfg.long_prompt_tokens else [None]
    out = [Contender(s, c) for s in cfg.contenders for c in chunks]
    if cfg.rates_from_saturation:  # `none` first: every contender runs at its saturation's rates
        out.sort(key=lambda c: c.scheduler != "none")
    return out


def benchmark(cfg: Config, argv: list[str]) -> dict:
    """Every contender at every load point; prints the tables, writes the JSON and the PNG."""
    blocks = len(cfg.concurrency) + len(cfg.request_rates) + len(cfg.rates_from_saturation) + 1
    seq, kept = request_sequence(cfg, cfg.warmup + blocks * cfg.num_requests)
    run = Run(cfg, time.monotonic() + cfg.max_seconds, seq, list(cfg.request_rates))
    head = header(argv)
    report = {"header": head, "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
              "prompts": {"datasets": cfg.datasets, "kept_per_set": kept}, "contenders": {}}
    print(f"{head['command']}\n{head['date_utc']}  {head['cpu_model']} ({head['cores']} cores)  "
          + " ".join(f"{f}:{'yes' if v else 'no'}" for f, v in head["cpu_flags"].items()), flush=True)
    contenders = contenders_of(cfg)
    results: dict[str, dict[str, dict]] = {}
    for contender in contenders:
        if run.left() <= 0:
            print(f"--max-seconds ({cfg.max_seconds:.0f} s) reached: {contender.name} not run", flush=True)
            continue
        entry = report["contenders"][contender.name] = {**asdict(contender), "points": {}}
        results[contender.name] = entry["points"]
        if cfg.url:
            asyncio.run(bench_server(run, cfg.url, contender, entry["points"]))
        else:
            log = cfg.out.with_name(f"{cfg.out.stem}.{contender.name.replace(' ', '_').replace('=', '')}.log")
            with started(cfg, contender, log, min(cfg.startup_timeout, max(run.left(), 1))) as (url, cmd):
                entry["server_command"] = shlex.join(cmd)
                asyncio.run(bench_server(run, url, contender, entry["points"]))
        report.update(saturation=run.saturation, rates=run.rates, chars_per_token=run.chars_per_token)
        save(report, cfg.out)  # after every contender: a later failure keeps what was measured
    report["cut_off"] = run.left() <= 0
    if report["cut_off"]:
        print(f"--max-seconds ({cfg.max_seconds:.0f} s) cut the run short: see `truncated` in the JSON", flush=True)
    report["ratios"] = ratios(contenders, results)
    if report["ratios"]:
        print("\nDSpark / none at each load point:")
    for point, pairs in report["ratios"].items():
        print(f"{point:>14}  " + "  ".join(f"{pair}: out tok/s x{r['output_throughput']:.2f}, median TPOT "
                                          f"x{r['median_tpot']:.2f}" for pair, r in pairs.items()))
    save(report, cfg.out)
    try:
        plot(results, cfg.out.with_suffix(".png"))
        print(f"wrote {cfg.out} and {cfg.out.with_suffix('.png')}")
    except DSparkError as e:  # no matplotlib
        print(f"wrote {cfg.out}; no PNG: {e}")
    return report


def save(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=1) + "\n")


# --- command line -----------------------------------------------------------------------------------

def numbers(kind: type, text: str) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def parse(argv: list[str]) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--bundle", type=Path, help="start `dspark serve --bundle B` for every contender")
    where.add_argument("--url", help="benchmark this running server instead (loopback only), e.g. "
                       "http://127.0.0.1:8000")
    p.add_argument("--data-dir", type=Path, default=default_bench_dir().parent, help="has bench/*.jsonl "
                   "(default ../shared/data)")
    p.add_argument("--datasets", default=None, help="bench sets to mix, comma-separated (default: every bench/*.jsonl)")
    p.add_argument("--contenders", default="auto,none", help="`dspark serve --scheduler` values (default auto,none)")
    p.add_argument("--concurrency", default="1,4,16,32", help="closed-loop levels (default 1,4,16,32)")
    p.add_argument("--request-rates", default="", help="Poisson rates in req/s, e.g. 0.5,1,2 (default none)")
    p.add_argument("--rates-from-saturation", default="", help="more Poisson rates: these multiples of `none`'s "
                   "req/s at the highest --concurrency, e.g. 0.25,0.5,0.75,1.0,1.25,1.5 (default none)")
    p.add_argument("--max-concurrency", type=int, default=None, help="Poisson mode: at most this many in flight")
    p.add_argument("--num-requests", type=int, default=64, help="requests per load point (default 64)")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of every request (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    p.add_argument("--seed", type=int, default=0, help="the request sequence's and the arrivals' seed (default 0)")
    p.add_argument("--max-prompt-chars", type=int, default=3000, help="draw only prompts this short, so that prompt "
                   "+ max_tokens fits the context (default 3000: a 4,000-character bench prompt of code has 2,056 "
                   "SmolLM2 tokens, past a 2,048-position context)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent one by one before measuring (default 2)")
    p.add_argument("--long-prompt-tokens", type=int, default=0, help="add the long-prompt arrivals mode with prompts "
                   "of about this many tokens, e.g. 1500 (default 0: off)")
    p.add_argument("--long-prompt-concurrency", type=int, default=4, help="streams measured in that mode (default 4)")
    p.add_argument("--long-prompt-interval", type=float, default=2.0, help="seconds between long prompts, the first "
                   "sent with the streams (default 2)")
    p.add_argument("--long-prompt-max-tokens", type=int, default=16, help="max_tokens of a long request (default 16)")
    p.add_argument("--prefill-chunks", default="64,0", help="with --long-prompt-tokens: a server per value of "
                   "`dspark serve --prefill-chunk` (default 64,0; 0: whole prompts)")
    p.add_argument("--slots", type=int, default=32, help="`dspark serve --slots` (default 32)")
    p.add_argument("--max-queue", type=int, default=256, help="`dspark serve --max-queue` (default 256)")
    p.add_argument("--server-args", default="", help="more `dspark serve` options, e.g. '--threads 2 --max-seq 2048'")
    p.add_argument("--startup-timeout", type=float, default=300, help="seconds for a server to get healthy "
                   "(default 300)")
    p.add_argument("--request-timeout", type=float, default=600, help="seconds per request (default 600)")
    p.add_argument("--max-seconds", type=float, default=3 * 3600, help="the whole run; load points past it are "
                   "cut off (default 3 h)")
    p.add_argument("--out", type=Path, default=Path("out/bench_serving.json"), help="JSON results; the PNG and the "
                   "servers' logs go beside it (default out/bench_serving.json)")
    a = p.parse_args(argv)
    bench = a.data_dir / "bench"
    cfg = Config(
        bundle=a.bundle, url=a.url and a.url.rstrip("/").removesuffix("/v1"), data_dir=a.data_dir,
        datasets=a.datasets.split(",") if a.datasets else sorted(f.stem for f in bench.glob("*.jsonl")),
        contenders=a.contenders.split(","), concurrency=numbers(int, a.concurrency),
        request_rates=numbers(float, a.request_rates), rates_from_saturation=numbers(float, a.rates_from_saturation),
        max_concurrency=a.max_concurrency, num_requests=a.num_requests, max_tokens=a.max_tokens,
        temperature=a.temperature, seed=a.seed, max_prompt_chars=a.max_prompt_chars, warmup=a.warmup,
        long_prompt_tokens=a.long_prompt_tokens, long_prompt_concurrency=a.long_prompt_concurrency,
        long_prompt_interval=a.long_prompt_interval, long_prompt_max_tokens=a.long_prompt_max_tokens,
        prefill_chunks=numbers(int, a.prefill_chunks), slots=a.slots, max_queue=a.max_queue,
        server_args=shlex.split(a.server_args), startup_timeout=a.startup_timeout,
        request_timeout=a.request_timeout, max_seconds=a.max_seconds, out=a.out)
    if not cfg.datasets:
        p.error(f"no bench sets in {bench} (--data-dir)")
    if unknown := [c for c in cfg.contenders if c not in NAMES]:
        p.error(f"unknown contender(s) {unknown}; choose from {', '.join(NAMES)}")
    if cfg.url and urllib.parse.urlsplit(cfg.url).hostname not in LOOPBACK:
        p.error(f"--url {a.url}: loopback only (127.0.0.1)")
    if not cfg.concurrency or min(cfg.concurrency) < 1 or cfg.num_requests < 1 or cfg.max_tokens < 1:
        p.error("need --concurrency levels >= 1, --num-requests >= 1 and --max-tokens >= 1")
    if min(cfg.request_rates + cfg.rates_from_saturation, default=1) <= 0:
        p.error("Poisson rates and their multiples must be > 0")
    if cfg.rates_from_saturation and not cfg.url and "none" not in cfg.contenders:
        p.error("--rates-from-saturation measures the `none` contender: add it to --contenders")
    if cfg.long_prompt_tokens and (not cfg.prefill_chunks or cfg.warmup < 1):
        p.error("--long-prompt-tokens needs --prefill-chunks values and --warmup >= 1 (it sizes the long prompts)")
    return cfg


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse(argv)
    if cfg.url and (why := healthy(cfg.url)) is not None:
        print(f"error: no server answers at {cfg.url}/health ({why})", file=sys.stderr)
        return 2
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        benchmark(cfg, argv)
    except (BenchError, DSparkError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
