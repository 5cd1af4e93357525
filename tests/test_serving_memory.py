"""The server's resident memory under a long mixed load: `dspark serve` in its own process on the
tiny bundle, 600 requests through the real `openai` client, CONCURRENCY at a time on SLOTS slots (so
the queue is used): chat (one or three turns) and text completions, streaming and not, prompts of 1
to ~300 characters (some sharing a long prefix), max_tokens 1..64, greedy and seeded sampling, some
with stop strings, and 10 % of the requests streams that the client closes after its first chunk.
The server's VmRSS (/proc/<pid>/status) may grow by at most 5 % over the last 500 requests.

Why a warm-up (the first 100 requests of the same mix, not measured): the first requests of a fresh
process fill caches that are meant to stay, and whose growth is no leak: glibc's malloc arenas (one
per thread that allocates), ONNX Runtime's per-shape caches (every new batch size, prompt chunk and
key count), the slots' prefix-cache state, Python's imports done on first use. Measured from a cold
start those would read as growth; after them, what still grows is state that is kept.

Why the texts come from a pool of POOL_SIZE that the warm-up covers: `tokenizers`' BPE model caches
the tokens of up to 10,000 "words" shorter than 256 characters. The tiny tokenizer has no
pre-tokenizer, so its words are whole messages: every new message would add an entry (~3.5 KB for
~100 characters) until 10,000 of them, bounded growth that would read as ~4 % here. Real tokenizers
split text into words first, and their cache fills with those. The conversations, and so the token
sequences the engine serves, are still mostly new ones.

The RSS is sampled every SAMPLE_EVERY requests, and the series is in the failure message, so a
failure shows a trend rather than one number."""
from __future__ import annotations

import itertools
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from servers import free_port, wait_healthy

pytestmark = pytest.mark.slow

MODEL = "tiny"
KEY = "test-key"
SLOTS = 3
CONCURRENCY = 6  # requests in flight: more than the slots, so some wait in the queue
WARMUP = 100
MEASURED = 500
SAMPLE_EVERY = 50
POOL_SIZE = 40  # distinct texts (see the docstring)
DISCONNECT_SHARE = 0.1
GROWTH_LIMIT = 0.05
TIMEOUT = 60  # s: one request, the server's start
BUDGET = 300  # s: the whole load (the test fails, rather than hangs, past it)
WORDS = ("the sea dragon cat rain stars bread train snow chess music numbers story poem city river light "
         "house green quick brown fox jumps over lazy dog Paris 17 23 one two three").split()
PREAMBLE = ("You are a helpful assistant. Answer briefly, in plain words, and never repeat the question. " * 2)


def texts(rng: random.Random) -> list[str]:
    """POOL_SIZE texts of 1 to ~300 characters, a quarter of them starting with the same long preamble."""
    pool = [" ".join(rng.choices(WORDS, k=k)) for k in itertools.islice(itertools.cycle((1, 3, 8, 20, 45)), POOL_SIZE)]
    return [(PREAMBLE + t)[:300] if i % 4 == 0 else t for i, t in enumerate(pool)]


@dataclass(frozen=True)
class Job:
    messages: tuple[str, ...]  # chat: user, (assistant, user); a text completion: its prompt
    chat: bool
    max_tokens: int
    temperature: float
    seed: int
    stop: tuple[str, ...]
    stream: bool
    disconnect: bool  # a stream the client closes after its first chunk


def mix(n: int, rng: random.Random) -> list[Job]:
    """n requests of the mix, DISCONNECT_SHARE of them disconnecting streams (deterministic for a seeded rng).
    Request i's first text is the pool's i % POOL_SIZE: the warm-up sends each one (POOL_SIZE <= WARMUP).
    Half the chats of short first texts have three turns, adding two short texts: mostly new
    conversations. Prompts stay within the tiny model's 512 positions: at most ~300 characters + the
    template + 64 tokens."""
    pool = texts(rng)
    short = [t for t in pool if len(t) <= 60]
    disconnects = set(rng.sample(range(n), round(n * DISCONNECT_SHARE)))
    jobs = []
    for i in range(n):
        chat = rng.random() < 0.5
        messages = (pool[i % len(pool)],)
        if chat and len(messages[0]) <= 150 and rng.random() < 0.5:
            messages += tuple(rng.sample(short, 2))
        greedy = rng.random() < 0.5
        stop = tuple(rng.sample(("e", "th", ".", "ab"), k=rng.randint(1, 2))) if rng.random() < 0.2 else ()
        jobs.append(Job(messages, chat, max_tokens=rng.randint(32, 64) if i in disconnects else rng.randint(1, 64),
                        temperature=0.0 if greedy else 1.0, seed=rng.randrange(1 << 31), stop=stop,
                        stream=i in disconnects or rng.random() < 0.5, disconnect=i in disconnects))
    return jobs


def run(client: openai.OpenAI, job: Job) -> str:
    """Send one job; its finish reason ("disconnected" for a stream closed early)."""
    kwargs = dict(model=MODEL, max_tokens=job.max_tokens, temperature=job.temperature, seed=job.seed,
                  stop=list(job.stop) or None, stream=job.stream)
    if job.chat:
        roles = itertools.cycle(("user", "assistant"))
        messages = [{"role": role, "content": text} for role, text in zip(roles, job.messages)]
        r = client.chat.completions.create(messages=messages, **kwargs)
    else:
        r = client.completions.create(prompt=job.messages[0], **kwargs)
    if not job.stream:
        return r.choices[0].finish_reason
    with r:
        finish = None
        for chunk in r:
            if job.disconnect:
                return "disconnected"  # leaving the `with` closes the response and its connection
            if chunk.choices and chunk.choices[0].finish_reason is not None:
                finish = chunk.choices[0].finish_reason
    return finish


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB$", status, re.M)[1])


def requests_total(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=TIMEOUT).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r'^dspark_requests_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}


@pytest.fixture(scope="module")
def server(profiled, tmp_path_factory) -> Iterator[tuple[str, subprocess.Popen]]:
    """`dspark serve` in its own process (as test_serving's fixture starts it). Yields (URL, process)."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve-memory") / "server.log"
    cmd = [sys.executable, "-m", "dspark.runtime.tools.cli", "serve", "--bundle", str(profiled), "--port", str(port),
           "--slots", str(SLOTS), "--max-queue", str(4 * CONCURRENCY), "--threads", "1", "--model-name", MODEL,
           "--log-level", "warning"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "DSPARK_API_KEY": KEY})
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, lambda: proc.poll() is None, TIMEOUT)
        except (AssertionError, TimeoutError):
            raise AssertionError(f"`dspark serve` did not start:\n{log.read_text()}") from None
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_resident_memory_is_stable_over_500_mixed_requests(server):
    url, proc = server
    jobs = mix(WARMUP + MEASURED, random.Random(0))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)
    samples: list[tuple[int, int]] = [(0, rss_kib(proc.pid))]  # (requests sent, VmRSS KiB)
    failures: list[str] = []

    def one(job: Job) -> str:
        try:
            return run(client, job)
        except Exception as e:  # noqa: BLE001: every failure is reported below
            failures.append(f"{job}: {type(e).__name__}: {e}")
            return "failed"

    deadline = time.monotonic() + BUDGET
    finishes: list[str] = []
    with client, ThreadPoolExecutor(CONCURRENCY) as pool:
        for start in range(0, len(jobs), SAMPLE_EVERY):
            assert time.monotonic() < deadline, f"the load took over {BUDGET} s; RSS so far {samples}"
            finishes += pool.map(one, jobs[start:start + SAMPLE_EVERY])
            assert proc.poll() is None, f"the server exited with {proc.returncode}"
            samples.append((start + SAMPLE_EVERY, rss_kib(proc.pid)))

    assert not failures, f"{len(failures)} requests failed, e.g. {failures[:3]}"
    disconnected = sum(j.disconnect for j in jobs)
    assert finishes.count("disconnected") == disconnected
    assert all(f in ("stop", "length") for j, f in zip(jobs, finishes) if not j.disconnect)

    warm = dict(samples)[WARMUP]
    final = samples[-1][1]
    series = ", ".join(f"{n}: {kib / 1024:.1f}" for n, kib in samples)
    assert final <= warm * (1 + GROWTH_LIMIT), (
        f"VmRSS grew {100 * (final / warm - 1):.1f} % over {MEASURED} requests after {WARMUP} of warm-up "
        f"(limit {100 * GROWTH_LIMIT:.0f} %); MiB after n requests: {series}")

    # the server still answers, and counted every request once: finished or aborted, nothing else
    assert urllib.request.urlopen(f"{url}/health", timeout=TIMEOUT).status == 200
    deadline = time.monotonic() + TIMEOUT
    while sum((counts := requests_total(url)).get(k, 0) for k in ("stop", "length", "abort")) < len(jobs):
        assert time.monotonic() < deadline, counts  # the last aborts land at the engine's next step
        time.sleep(0.05)
    assert counts["stop"] + counts["length"] + counts["abort"] == len(jobs), counts
    assert counts["error"] == counts["rejected"] == counts["invalid"] == 0, counts
    assert 0 < counts["abort"] <= disconnected, counts
    print(f"\nVmRSS MiB after n requests: {series}; outcomes {counts}")
