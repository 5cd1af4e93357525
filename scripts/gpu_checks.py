"""The checks of scripts/gpu_check.py: each fills its section of the results and sets its "ok"
(correctness only: the speed targets of issue 25 are reported under "targets", met or not)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dspark.export import TorchBackend
from dspark.export.cuda_graph_backend import cuda_graph_backend
from dspark.runtime import FixedLength, Request, SamplingParams, generate
from dspark.runtime.core import generate_batch
from dspark.runtime.tools.parity import greedy_match

if TYPE_CHECKING:
    from gpu_check import Models, Sizes


@dataclass(frozen=True)
class Kind:
    slots: int = 1
    graphs: bool = True
    on_device: bool = True  # acceptance next to the logits


GRAPHS, EAGER, HOST_ACCEPT = Kind(), Kind(graphs=False), Kind(on_device=False)
BATCH1 = {"graphs": GRAPHS, "eager": EAGER, "graphs-host-accept": HOST_ACCEPT}


@dataclass
class Context:
    sizes: Sizes
    models: Models
    device: str  # "cuda", or "cpu" for the stand-in device
    order: list[int]  # prompt indices, the sets interleaved
    backends: dict[Kind, Any] = field(default_factory=dict)
    _logits: dict[tuple, np.ndarray] = field(default_factory=dict)

    def backend(self, kind: Kind):
        if kind not in self.backends:
            s, m = self.sizes, self.models
            self.backends[kind] = cuda_graph_backend(
                m.target, m.drafter, s.max_seq, self.device, graphs=kind.graphs, prefill_chunk=s.prefill_chunk,
                min_context=s.min_context, device_acceptance=None if kind.on_device else False, slots=kind.slots)
        return self.backends[kind]

    def params(self, max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> SamplingParams:
        return SamplingParams(temperature, max_new_tokens, seed, stop_token_ids=self.models.stop_token_ids)

    def match(self, i: int, reference: list[int], candidate: list[int]) -> dict:
        """Greedy identity of `candidate` with `reference` (prompt i), judged on the CPU reference
        model's logits of the reference tokens (dspark.md §1)."""
        from factories import reference_logits

        key = (i, tuple(reference))
        if key not in self._logits:
            self._logits[key] = reference_logits(self.models.target, self.models.prompts[i], reference)
        m = greedy_match(reference, candidate, self._logits[key])
        return {"ok": m.ok, "verdict": str(m)}


class LaunchTimer:
    """Host launch time per backend call kind ("prefill", "target", "drafter"), from the steps'
    launch_s totals read at each call's `on_run` event."""

    def __init__(self, backend):
        self.backend, self.seconds = backend, {}
        self.last = self.total()
        backend.on_run = self

    def total(self) -> float:
        return sum(s.launch_s for s in self.backend.stats.values())

    def __call__(self, event) -> None:
        now = self.total()
        self.seconds[event.kind] = self.seconds.get(event.kind, 0.0) + now - self.last
        self.last = now

    def take(self, *kinds: str) -> float:
        """Launch seconds of `kinds` since the last take."""
        out = sum(self.seconds.pop(k, 0.0) for k in kinds)
        self.seconds.clear()
        return out


def check_identity(ctx: Context, res: dict) -> None:
    """Batch 1, greedy: DSpark on each backend kind and the target alone (eager too) against the
    target alone with replayed graphs; that against the PyTorch reference on the CPU; sampled
    runs identical between the kinds."""
    s, m = ctx.sizes, ctx.models
    out = res["identity"] = {"greedy": [], "cpu_reference": [], "sampled": []}
    params = ctx.params(s.max_new_tokens)
    for i in ctx.order[:s.identity_prompts]:
        prompt = m.prompts[i]
        alone = generate(ctx.backend(GRAPHS), prompt, params, None).token_ids
        row = {"prompt": m.labels[i], "tokens": len(alone)}
        for name, kind in BATCH1.items():
            g = generate(ctx.backend(kind), prompt, params, FixedLength())
            row[f"{name}/dspark"] = {**ctx.match(i, alone, g.token_ids), "tau": g.stats.tau}
        row["eager/alone"] = ctx.match(i, alone, generate(ctx.backend(EAGER), prompt, params, None).token_ids)
        out["greedy"].append(row)
        print(f"identity {row}", flush=True)
    for i in ctx.order[:s.cpu_reference]:
        t0 = time.perf_counter()
        ref = generate(TorchBackend(m.target, None, s.max_seq), m.prompts[i], params, None).token_ids
        got = generate(ctx.backend(GRAPHS), m.prompts[i], params, FixedLength()).token_ids
        row = {"prompt": m.labels[i], "tokens": len(ref), "graphs/dspark": ctx.match(i, ref, got),
               "cpu_s": round(time.perf_counter() - t0, 1)}
        out["cpu_reference"].append(row)
        print(f"identity vs the CPU reference {row}", flush=True)
    for seed in range(2):
        sampled = ctx.params(s.max_new_tokens, 1.0, seed)
        runs = {n: generate(ctx.backend(k), m.prompts[ctx.order[0]], sampled, FixedLength()) for n, k in BATCH1.items()}
        toks = [r.token_ids for r in runs.values()]
        out["sampled"].append({"seed": seed, "identical": all(t == toks[0] for t in toks),
                               "tau": {n: r.stats.tau for n, r in runs.items()}})
    out["graph_stats"] = {n: {k: vars(v) for k, v in ctx.backend(kind).stats.items()} for n, kind in BATCH1.items()}
    rows = out["greedy"] + out["cpu_reference"]
    out["ok"] = (all(v["ok"] for row in rows for v in row.values() if isinstance(v, dict))
                 and all(x["identical"] for x in out["sampled"])
                 and not any(st["capture_failures"] for b in out["graph_stats"].values() for st in b.values()))


def check_timing(ctx: Context, res: dict) -> None:
    """Batch 1: host launch time (enqueueing the steps) and wall time per DSpark cycle, and per
    target-alone step, with replayed graphs and with eager launches (after a warm-up run that
    captures every bucket the timed run meets)."""
    s, m = ctx.sizes, ctx.models
    i = ctx.order[0]
    params = ctx.params(s.max_new_tokens)
    out = res["timing"] = {"prompt": m.labels[i]}
    for name, kind in (("graphs", GRAPHS), ("eager", EAGER)):
        be = ctx.backend(kind)
        generate(be, m.prompts[i], params, FixedLength())
        timer = LaunchTimer(be)
        spec = generate(be, m.prompts[i], params, FixedLength()).stats
        spec_launch = timer.take("target", "drafter")
        alone = generate(be, m.prompts[i], params, None).stats
        alone_launch = timer.take("target")
        be.on_run = None
        out[name] = {
            "cycle_ms": 1e3 * (spec.times["draft"] + spec.times["verify"]) / spec.cycles,
            "cycle_launch_ms": 1e3 * spec_launch / spec.cycles,
            "draft_ms": 1e3 * spec.times["draft"] / spec.cycles,
            "verify_ms": 1e3 * spec.times["verify"] / spec.cycles,
            "tau": spec.tau,
            "alone_step_ms": 1e3 * alone.times["decode"] / alone.cycles,
            "alone_launch_ms": 1e3 * alone_launch / alone.cycles,
        }
        print(f"timing {name}: {out[name]}", flush=True)
    g, e = out["graphs"], out["eager"]
    out["targets"] = {
        "host_launch_ratio": target(e["cycle_launch_ms"] / g["cycle_launch_ms"], 3.0),
        "wall_ratio": target(e["cycle_ms"] / g["cycle_ms"], 2.0),
    }
    out["ok"] = True


def target(value: float, want: float) -> dict:
    return {"value": round(value, 3), "want": f">= {want}", "met": bool(value >= want)}


def check_sps(ctx: Context, res: dict) -> None:
    """Verification steps per second for 1..γ+1 rows: at batch 1 with graphs and eager launches,
    and at each concurrency R > 1 with graphs (R rows of S tokens)."""
    s, m = ctx.sizes, ctx.models
    gamma = m.drafter.cfg.block_size
    out = res["sps"] = {}
    start = min(256, s.max_seq // 2)
    row = np.resize(np.asarray(m.prompts[ctx.order[0]], np.int64), gamma + 1)
    kinds = {"batch1/graphs": GRAPHS, "batch1/eager": EAGER}
    kinds |= {f"batch{r}/graphs": Kind(slots=r) for r in s.concurrency if r > 1}
    for name, kind in kinds.items():
        be = ctx.backend(kind)
        tokens, starts = np.tile(row, (kind.slots, 1)), np.full(kind.slots, start)  # [R, γ+1], [R]
        curve = {}
        for S in range(1, gamma + 2):
            for _ in range(3):  # capture and warm up this bucket
                be.target(tokens[:, :S], starts)
            t0 = time.perf_counter()
            for _ in range(s.reps):
                be.target(tokens[:, :S], starts)  # same rows each time: the KV writes are idempotent
            curve[S] = s.reps / (time.perf_counter() - t0)
        out[name] = curve
        print(f"sps {name}: " + ", ".join(f"{k}: {v:.0f}/s" for k, v in curve.items()), flush=True)
    out["ok"] = True


def check_throughput(ctx: Context, res: dict) -> None:
    """Batch 1 on the prompts: decode tokens/s of the target alone and of DSpark (all γ drafts
    verified), each timed after a warm-up run of the same prompt; τ and DSpark / (τ × alone)."""
    s, m = ctx.sizes, ctx.models
    be = ctx.backend(GRAPHS)
    params = ctx.params(s.bench_tokens)
    rows = []
    for i in ctx.order[:s.bench_prompts]:
        runs = {}
        for name, sched in (("alone", None), ("dspark", FixedLength())):
            generate(be, m.prompts[i], params, sched)
            g = generate(be, m.prompts[i], params, sched)
            runs[name] = g.stats.to_dict(len(g.token_ids))
        a, d = runs["alone"]["decode_tokens_per_s"], runs["dspark"]["decode_tokens_per_s"]
        tau = runs["dspark"]["tau"]
        rows.append({"prompt": m.labels[i], "alone_tok_s": a, "dspark_tok_s": d, "tau": tau,
                     "speedup": d / a, "efficiency": d / (tau * a)})
        print(f"throughput {rows[-1]}", flush=True)
    mean = {k: float(np.mean([r[k] for r in rows])) for k in ("alone_tok_s", "dspark_tok_s", "tau", "speedup",
                                                                "efficiency")}
    res["throughput"] = {"prompts": rows, "mean": mean, "targets": {"efficiency": target(mean["efficiency"], 0.8)},
                         "ok": True}


def check_concurrency(ctx: Context, res: dict) -> None:
    """The same requests served R at a time for each R: tokens/s (all tokens, prefill included,
    over the wall time of serving them all) of DSpark and of the target alone, each timed after a
    warm-up run; greedy outputs against the solo target alone (R = 1)."""
    s, m = ctx.sizes, ctx.models
    idx = ctx.order[:max(s.concurrency)]
    params = ctx.params(s.max_new_tokens)
    requests = [Request(m.prompts[i], params) for i in idx]
    out = res["concurrency"] = {"requests": len(requests)}
    solo = None
    for r in sorted(s.concurrency):
        be = ctx.backend(Kind(slots=r))
        row = {}
        for name, sched in (("alone", None), ("dspark", FixedLength())):
            generate_batch(be, requests, sched)
            t0 = time.perf_counter()
            gens = generate_batch(be, requests, sched)
            wall = time.perf_counter() - t0
            if solo is None:
                solo = [g.token_ids for g in gens]  # R = 1, the target alone: the reference
            matches = [ctx.match(i, ref, g.token_ids) for i, ref, g in zip(idx, solo, gens)]
            row[name] = {"tok_s": sum(len(g.token_ids) for g in gens) / wall, "wall_s": wall,
                         "tau": float(np.mean([g.stats.tau for g in gens])),
                         "identical_to_solo": sum(x["verdict"] == "identical" for x in matches),
                         "ok": all(x["ok"] for x in matches),
                         "splits": [x["verdict"] for x in matches if x["verdict"] != "identical"]}
        row["dspark_over_alone"] = row["dspark"]["tok_s"] / row["alone"]["tok_s"]
        out[f"R{r}"] = row
        print(f"concurrency R={r}: {row}", flush=True)
    out["ok"] = all(out[f"R{r}"][n]["ok"] for r in s.concurrency for n in ("alone", "dspark"))


def replay_ms(entry: Any, reps: int, cuda: bool) -> float:
    """Device time of one replay of a step's entry: CUDA events around `reps` replays after a
    warm one (wall time on the CPU stand-in)."""
    entry.run()
    if cuda:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            entry.run()
        end.record()
        end.synchronize()
        return round(start.elapsed_time(end) / reps, 4)
    t0 = time.perf_counter()
    for _ in range(reps):
        entry.run()
    return round(1e3 * (time.perf_counter() - t0) / reps, 4)


def check_graph_time(ctx: Context, res: dict) -> None:
    """Device time of one replay of every captured graph at batch 1 and at the largest batch bucket
    (CUDA events around `reps` replays; wall time on the CPU stand-in), by step, batch, query rows
    and context width: what a cycle costs on the GPU, apart from the host's work. Replays rewrite
    K/V rows at the positions their buffers hold last, so this check runs after those that decode."""
    s = ctx.sizes
    out = res["graph_time"] = {}
    times = {}  # (step, batch, rows: target tokens or drafter context rows, past width) -> ms
    for kind in (GRAPHS, Kind(slots=max(s.concurrency))):
        for role, runner in ctx.backend(kind).runners.items():
            for key, entry in runner.entries.items():
                shapes = dict(key[1:])
                rows = shapes["input_ids" if role == "target" else "features"]
                if not entry.graphed or shapes["past_mask"][0] not in (1, kind.slots):
                    continue
                times[role, rows[0], rows[1], shapes["past_mask"][1]] = replay_ms(entry, s.reps, ctx.device == "cuda")
    out |= {f"{role} B={b} S={n} P={p}": ms for (role, b, n, p), ms in sorted(times.items())}
    print("graph_time: " + ", ".join(f"{k}: {v:.3f} ms" for k, v in out.items()), flush=True)
    out["ok"] = True


def check_cupy(ctx: Context, res: dict) -> None:
    """The CuPy device of the TensorRT backend: row scatter from device positions, captured and replayed."""
    from dspark.runtime.backends.gpu.cupy_device import CupyDevice

    dev = CupyDevice()
    rng = np.random.default_rng(0)
    cache = dev.zeros((2, 3, 64, 8), np.float32)
    rows_h = rng.standard_normal((2, 3, 4, 8)).astype(np.float32)
    rows, positions = dev.zeros(rows_h.shape, np.float32), dev.zeros((2, 6), np.int64)
    dev.upload(rows, rows_h)
    dev.upload(positions, np.array([[10, 11, 12, 13, 0, 0], [3, 4, 5, 6, 0, 0]]))  # n = 4 rows per slot
    dev.write_rows(cache, rows, positions)
    want = np.zeros((2, 3, 64, 8), np.float32)
    want[0, :, 10:14], want[1, :, 3:7] = rows_h[0], rows_h[1]
    eager_ok = bool(np.array_equal(dev.download(cache), want))
    replay, outputs = dev.capture(lambda: (dev.write_rows(cache, rows, positions), {"cache": cache})[1])
    dev.upload(positions, np.array([[40, 41, 42, 43, 0, 0], [20, 21, 22, 23, 0, 0]]))  # new lengths, same addresses
    replay()
    want[0, :, 40:44], want[1, :, 20:24] = rows_h[0], rows_h[1]
    replay_ok = bool(np.array_equal(dev.download(outputs["cache"]), want))
    t0 = time.perf_counter()
    for _ in range(1000):
        replay()
    dev.stream.synchronize()
    res["cupy"] = {"device": dev.name, "compute_capability": list(dev.info.compute), "write_rows_ok": eager_ok,
                   "replay_ok": replay_ok, "replay_us": 1e3 * (time.perf_counter() - t0), "ok": eager_ok and replay_ok}
    print(f"cupy: {res['cupy']}", flush=True)


CHECKS = [check_identity, check_concurrency, check_timing, check_throughput, check_sps, check_graph_time, check_cupy]


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        res["plot"] = "matplotlib is not installed: no png"
        return
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4))
    for name, curve in res.get("sps", {}).items():
        if isinstance(curve, dict):
            ax1.plot([int(k) for k in curve], list(curve.values()), marker="o", label=name)
    ax1.set(xlabel="tokens per row verified (1 + ℓ)", ylabel="verification steps / s", title="SPS curve")
    t = {k: v for k, v in res.get("timing", {}).items() if k in ("graphs", "eager")}
    if t:
        names = list(t)
        ax2.bar([f"{n}\ncycle wall" for n in names] + [f"{n}\ncycle launch" for n in names],
                [t[n]["cycle_ms"] for n in names] + [t[n]["cycle_launch_ms"] for n in names])
        ax2.set(ylabel="ms", title="per DSpark cycle, batch 1")
    c = {k: v for k, v in res.get("concurrency", {}).items() if k.startswith("R") and isinstance(v, dict)}
    if c:
        rs = [int(k[1:]) for k in c]
        for name in ("alone", "dspark"):
            ax3.plot(rs, [c[f"R{r}"][name]["tok_s"] for r in rs], marker="o", label=name)
        ax3.set(xlabel="requests at once (R)", ylabel="tokens / s", title="concurrency", xscale="log", xticks=rs,
                xticklabels=[str(r) for r in rs])
    for ax in (ax1, ax3):
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
