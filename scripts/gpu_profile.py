"""Where a DSpark cycle's time goes on a GPU, and which cheap backend variants would bring the
batch-1 efficiency DSpark tok/s / (τ × target-alone tok/s) to >= 0.8 (issue 25). One run, under
3 minutes on an H200 (scripts/gpu_profile.sh runs it there), on SmolLM2-135M-shaped RANDOM weights
(gpu_check.random_models: kernel time depends on shapes, not on values; τ does depend on them, so
τ here is not the real drafter's, and efficiencies are per cycle, not per token).

Sections, each saved to gpu_profile.json as soon as it ends (a timeout keeps what ran):
  steps     torch.profiler (CUDA activity) over replays of the CUDA graphs of the CUDA-graph backend,
            at batch 1 and 4: a target-alone step (S=1), a verification (S=γ+1), a drafting round;
            kernels per replay, GPU busy and idle time inside a replay, the top kernels by GPU time
  cycle     whole DSpark cycles through EngineCore (batch 1): host time per cycle by the code that
            spends it (draft/verify, uploads, downloads, the acceptance rule, replays), measured
            without the profiler; then under the profiler: GPU time in graphs, outside graphs
            (kernels, copies) and idle, and the CUDA API calls (syncs, copies) by calling code
  variants  the same graphs and cycles with: fp32 (default), tf32 (cuBLAS/cuDNN TF32), bf16
            (modules and KV caches cast in this script; the backend itself runs fp32 only),
            host-accept (acceptance on the host from downloaded logits), fewer-syncs (greedy
            acceptance from an argmax inside the verify graph, features and argmax in one download,
            drafted tokens and confidences in one download: patched in this script), and bf16 with
            fewer-syncs. Each: graph_time of target S=1,2,4,8 and drafter, cycle/step wall,
            efficiency, and greedy tokens against fp32 over a few prompts (identical / first split)
  compile   torch.compile of the step modules before capture, in a subprocess with a time limit
            (skipped with a message when it does not finish)
Writes gpu_profile.json, gpu_profile.txt and cycle_trace.json.gz (Perfetto/chrome://tracing) under --out.

--smoke: a tiny random model on the CPU stand-in device (TorchDevice('cpu'): graphs are re-run
bodies, the profiler sees CPU ops only), no compile; for CI. Exit codes: 0 done, 1 a section
raised (the partial JSON is kept), 2 no GPU."""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

GAMMA = 7
START = 200  # the anchor's position in the step profiles: a context bucket of 256 rows
T0 = time.monotonic()  # the budget counts from here (imports and model building included)


# ---------------------------------------------------------------- setup


def build_models(smoke: bool, n_prompts: int = 3):
    from gpu_check import SMOLLM2, TINY, random_models

    if smoke:
        return random_models(TINY, GAMMA, rank=16, n_prompts=n_prompts, lengths=(13, 30, 9))
    return random_models(SMOLLM2, GAMMA, rank=256, n_prompts=n_prompts, lengths=(200, 120, 24))


class Env:
    """What every section shares: the models, the device, the sizes and the deadline."""

    def __init__(self, args, models):
        self.args, self.models = args, models
        self.smoke = args.smoke
        self.device = "cpu" if args.smoke else "cuda"
        self.deadline = T0 + args.budget
        self.reps = 3 if args.smoke else 20
        self.tokens = 24 if args.smoke else 64  # greedy comparison runs
        self.bench_tokens = 32 if args.smoke else 128  # timed runs
        self.max_seq = 128 if args.smoke else 1024
        self.start = 40 if args.smoke else START
        self.cycles = 4 if args.smoke else 12

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def backend(self, slots: int = 1, on_device: bool = True, graphs: bool = True):
        from dspark.export.cuda_graph_backend import cuda_graph_backend

        m = self.models
        return cuda_graph_backend(m.target, m.drafter, self.max_seq, self.device, graphs=graphs,
                                  prefill_chunk=64 if self.smoke else 512, min_context=16 if self.smoke else 128,
                                  device_acceptance=None if on_device else False, slots=slots)

    def params(self, n: int):
        from dspark.runtime import SamplingParams

        return SamplingParams(0.0, n, 0)

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()


# ---------------------------------------------------------------- variants of a backend (script-side only)


def set_tf32(on: bool) -> str:
    """cuBLAS and cuDNN TF32 for fp32 matmuls (legacy flags; the precision API where they are refused)."""
    import torch

    try:
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on
        return f"torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = {on}"
    except Exception as e:  # noqa: BLE001 — a torch that refuses the legacy flags
        torch.set_float32_matmul_precision("high" if on else "highest")
        return f"legacy flags refused ({type(e).__name__}: {e}); set_float32_matmul_precision"


def cast_bf16(be) -> None:
    """Run both steps in bf16: modules and KV caches cast, host-facing float outputs (logits, features,
    draft distributions, confidences) cast back to fp32 inside the graphs (CuPy has no bf16, the
    host reads fp32). Done before any call, so every graph is captured in bf16."""
    import torch
    from torch import nn

    class Bf16(nn.Module):
        def __init__(self, module: nn.Module, plain: int, cast_args: tuple[int, ...]):
            super().__init__()
            self.module, self.plain, self.cast_args = module.to(torch.bfloat16), plain, cast_args

        def forward(self, *args):
            args = [a.to(torch.bfloat16) if i in self.cast_args else a for i, a in enumerate(args)]
            out = self.module(*args)
            return tuple(o.float() if i < self.plain and o.is_floating_point() else o for i, o in enumerate(out))

    for role, runner in be.runners.items():
        if runner.entries:
            raise RuntimeError("cast_bf16 after a call: graphs already captured in fp32")
        step = runner.step
        plain = len(step.output_names) - 2 * runner.layers  # outputs before the K/V rows
        cast = (step.input_names.index("features"),) if role == "drafter" else ()
        step.module = Bf16(step.module, plain, cast)
        runner.kv[:] = [torch.zeros(c.shape, dtype=torch.bfloat16, device=c.device) for c in runner.kv]


def fewer_syncs(be) -> None:
    """Greedy rows: the verify graph also returns the argmax of each row's logits packed with the
    features ([B, S, F+1], one download), and verify() accepts on the host from it (no CuPy
    kernels, no mid-rule sync); the drafter graph returns tokens and confidences packed ([B, 2, γ],
    one download). Sampled rows keep the library's paths. Patched here, the library unchanged."""
    import torch
    from torch import nn

    from dspark.runtime.backends.base import Draft, Verdict

    class Packed(nn.Module):
        def __init__(self, module: nn.Module, role: str):
            super().__init__()
            self.module, self.role = module, role

        def forward(self, *args):
            out = self.module(*args)
            if self.role == "target":
                logits, feats = out[0], out[1]  # [B, K, V], [B, S, F]
                top = logits.argmax(-1).to(feats.dtype)  # [B, K]; ids < 2^24 are exact in fp32
                if top.shape[1] != feats.shape[1]:  # prefill chunks: logits of the last row only
                    top = top[:, -1:].expand(-1, feats.shape[1])
                packed = torch.cat([feats.float(), top.float()[..., None]], -1)
            else:  # tokens [B, γ], probs, confidences [B, γ]
                packed = torch.stack([out[0].float(), out[-1 - 2 * self.layers].float()], 1)
            return (*out, packed)

    for role, runner in be.runners.items():
        step = runner.step
        mod = Packed(step.module, role)
        mod.layers = runner.layers
        step.module = mod
        step.output_names = [*step.output_names, "packed"]
    dev = be.device
    verify0, draft0 = be.verify, be.draft

    def draft(batch):
        if (np.asarray(batch.temperatures) > 0).any():
            return draft0(batch)
        B = len(batch.counts)
        out = be._draft_rows(0, batch.features, batch.counts, batch.ctx_starts, batch.floors, batch.anchors,
                             batch.temperatures, batch.draft_uniforms)
        p = dev.download(out["packed"])[:B]  # [B, 2, γ]
        return Draft(p[:, 0].astype(np.int64), None, p[:, 1].astype(np.float32))

    def verify(batch, d):
        if (np.asarray(batch.temperatures) > 0).any():
            return verify0(batch, d)
        tokens, starts = np.asarray(batch.tokens, np.int64), np.asarray(batch.starts, np.int64)
        B, S = tokens.shape
        out, _ = be._target_chunk(0, tokens, starts, 0, S, 0)
        p = dev.download(out["packed"])[:B]  # [B, S, F+1]
        top, feats = p[..., -1].astype(np.int64), np.ascontiguousarray(p[..., :-1])
        n = S - 1
        ok = (tokens[:, 1:] == top[:, :n]) & (np.arange(n)[None] < np.asarray(batch.lengths)[:, None])
        a = np.cumprod(ok, axis=1).sum(1).astype(np.int64)
        return Verdict(a, top[np.arange(B), a], feats)

    be.draft, be.verify = draft, verify


VARIANTS = {  # name -> (tf32, bf16, host acceptance, fewer syncs); in this order, the last skipped first
    "fp32": (False, False, False, False),
    "bf16": (False, True, False, False),
    "tf32": (True, False, False, False),
    "fewer-syncs": (False, False, False, True),
    "bf16+fewer-syncs": (False, True, False, True),
    "tf32+fewer-syncs": (True, False, False, True),
    "host-accept": (False, False, True, False),
}


def variant_backend(env: Env, name: str, slots: int = 1):
    tf32, bf16, host, fewer = VARIANTS[name]
    how = set_tf32(tf32)  # before capture: the graphs keep the kernels chosen then
    be = env.backend(slots, on_device=not host)
    be.tf32_setting = how if tf32 else None
    if bf16:
        cast_bf16(be)
    if fewer:
        fewer_syncs(be)
    return be


# ---------------------------------------------------------------- measuring graphs


def entry_for(env: Env, be, role: str, B: int, S: int, P: int):
    """The captured (or kept) entry of `role` at batch B, S rows (target tokens or drafter context
    rows) and past width P, created by one call when it is not there yet."""
    runner = be.runners[role]

    def find():
        for key, e in runner.entries.items():
            shapes = dict(key[1:])
            rows = shapes["input_ids" if role == "target" else "features"]
            logits_all = role == "drafter" or shapes["logit_index"] == (B, S)  # not a prefill chunk
            if rows[:2] == (B, S) and shapes["past_mask"] == (B, P) and logits_all:
                return e
        return None

    if find() is None:
        rng = np.random.default_rng(S)
        V = be.vocab_size
        past = np.full(B, P - 8, np.int64)  # committed rows: inside the bucket P (P >= 32)
        if role == "target":
            be.target(rng.integers(5, V, (B, S)), past)
        else:
            feats = np.zeros((B, S, env.models.drafter.cfg.feature_dim), np.float32)
            be._draft_rows(0, feats, np.full(B, S), past, np.zeros(B, np.int64), rng.integers(5, V, B),
                           np.zeros(B, np.float32), np.zeros((B, be.block_size), np.float32))
    e = find()
    if e is None:
        raise RuntimeError(f"no {role} entry at B={B} S={S} P={P}")
    return e


def graph_ms(env: Env, entry, reps: int | None = None) -> float:
    """Device time of one replay (gpu_checks.replay_ms)."""
    from gpu_checks import replay_ms

    return replay_ms(entry, reps or env.reps, env.device == "cuda")


def graph_times(env: Env, be, B: int = 1, target_rows=(1, 2, 4, 8), drafter_rows=(1, 3, 8)) -> dict:
    P = be.buckets.context(env.start)
    out = {}
    for S in target_rows:
        out[f"target B={B} S={S} P={P}"] = graph_ms(env, entry_for(env, be, "target", B, S, P))
    for S in drafter_rows:
        out[f"drafter B={B} S={S} P={P}"] = graph_ms(env, entry_for(env, be, "drafter", B, S, P))
    return out


# ---------------------------------------------------------------- the profiler and its trace


def profiler(env: Env):
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.device == "cuda" else [])
    return profile(activities=acts, record_shapes=False)


def trace_events(prof) -> tuple[list[dict], str]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        text = path.read_text()
    data = json.loads(text)
    return (data.get("traceEvents", []) if isinstance(data, dict) else data), text


def is_gpu(e: dict) -> bool:
    return e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")


def is_api(e: dict) -> bool:
    return e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")


def is_sync(api: str) -> bool:
    """A CUDA API call that blocks the host until the device is done (pageable copies included)."""
    return "Synchronize" in api or ("emcpy" in api and "Async" not in api)


def union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, -1e30
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def graph_launch_ids(events: list[dict]) -> set:
    return {e.get("args", {}).get("correlation") for e in events
            if is_api(e) and e.get("name", "").startswith(("cudaGraphLaunch", "cuGraphLaunch"))}


def short(name: str, n: int = 140) -> str:
    return name if len(name) <= n else name[:n] + "…"


def top_ops(prof, n: int = 15) -> list[dict]:
    """The profiler's own table: on CUDA by self device time, on the CPU by self CPU time."""
    rows = []
    for a in prof.key_averages():
        dev = getattr(a, "self_device_time_total", None)
        if dev is None:
            dev = getattr(a, "self_cuda_time_total", 0.0)
        rows.append({"op": short(a.key), "count": a.count, "self_device_us": round(float(dev or 0.0), 1),
                     "self_cpu_us": round(float(a.self_cpu_time_total), 1)})
    key = "self_device_us" if any(r["self_device_us"] for r in rows) else "self_cpu_us"
    return sorted(rows, key=lambda r: -r[key])[:n]


def replay_profile(env: Env, entry, reps: int = 5) -> dict:
    """torch.profiler over `reps` replays of one graph: kernels per replay, GPU busy and idle time
    between the first and last kernel of a replay, the top kernels by GPU time per replay."""
    entry.run()
    env.sync()
    with profiler(env) as prof:
        for _ in range(reps):
            entry.run()
        env.sync()
    events, _ = trace_events(prof)
    return {**replay_stats(events), "top_ops": top_ops(prof)}


def replay_stats(events: list[dict]) -> dict:
    """Kernels of each graph replay in a trace (by the correlation id of its graph launch): their
    number, GPU busy time, idle time between the first kernel's start and the last one's end, the
    kernels under 5 us, and the top kernels by GPU time per replay."""
    launches = graph_launch_ids(events)
    gpu = [e for e in events if is_gpu(e)]
    groups: dict[Any, list[dict]] = defaultdict(list)
    for e in gpu:
        corr = e.get("args", {}).get("correlation")
        groups[corr if corr in launches else "outside"].append(e)
    per = [g for c, g in groups.items() if c != "outside"]
    out: dict[str, Any] = {"replays_traced": len(per), **group_stats(per)}
    if gpu and not per:
        out["note"] = "kernels were traced but none carries a graph launch's correlation id"
    out["outside_graph_gpu_events"] = len(groups.get("outside", []))
    return out


def group_stats(per: list[list[dict]]) -> dict:
    """Mean over groups of GPU events (one per replay, or one eager call)."""
    out: dict[str, Any] = {}
    if per:
        counts = [sum(e["cat"] == "kernel" for e in g) for g in per]
        busy = [union_us([(e["ts"], e["ts"] + e["dur"]) for e in g]) for g in per]
        span = [max(e["ts"] + e["dur"] for e in g) - min(e["ts"] for e in g) for g in per]
        names: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for g in per:
            for e in g:
                names[e["name"]][0] += 1
                names[e["name"]][1] += e["dur"]
        k = len(per)
        small = [[e["dur"] for e in g if e["cat"] == "kernel" and e["dur"] < 5.0] for g in per]
        out |= {"kernels_per_replay": float(np.mean(counts)),
                "kernels_under_5us": {"per_replay": float(np.mean([len(x) for x in small])),
                                      "us_per_replay": round(float(np.mean([sum(x) for x in small])), 1)},
                "busy_us": round(float(np.mean(busy)), 1),
                "span_us": round(float(np.mean(span)), 1),
                "idle_us": round(float(np.mean(span) - np.mean(busy)), 1),
                "mean_kernel_us": round(float(np.mean(busy) / max(np.mean(counts), 1)), 2),
                "top_kernels": [{"kernel": short(n), "per_replay": c / k, "us_per_replay": round(t / k, 1)}
                                for n, (c, t) in sorted(names.items(), key=lambda kv: -kv[1][1])[:20]]}
    return out


def eager_profile(env: Env, be, role: str, B: int, S: int, P: int) -> dict:
    """The same step launched eagerly (`be` without graphs keeps eager entries), for when the trace
    holds no kernels of graph replays: its kernels are the graph's, its gaps are launch gaps."""
    e = entry_for(env, be, role, B, S, P)
    e.run()
    env.sync()
    with profiler(env) as prof:
        e.run()
        env.sync()
    events, _ = trace_events(prof)
    return group_stats([[x for x in events if is_gpu(x) and x["cat"] == "kernel"]])


def check_steps(env: Env, res: dict) -> None:
    out = res["steps"] = {}
    for B in (1, 4):
        be, eager = env.backend(slots=B), None
        P = be.buckets.context(env.start)
        for role, S in (("target", 1), ("target", GAMMA + 1), ("drafter", 3)):
            e = entry_for(env, be, role, B, S, P)
            name = f"{role} B={B} S={S} P={P}"
            r = out[name] = {"graph_ms": graph_ms(env, e), "graphed": e.graphed, **replay_profile(env, e)}
            if env.device == "cuda" and not r["replays_traced"]:
                eager = eager or env.backend(slots=B, graphs=False)
                r["eager_call"] = eager_profile(env, eager, role, B, S, P)
            print(f"steps {name}: {r['graph_ms']} ms, {r.get('kernels_per_replay')} kernels, "
                  f"busy {r.get('busy_us')} us, idle {r.get('idle_us')} us", flush=True)
        del be, eager
    res["steps"]["ok"] = True


# ---------------------------------------------------------------- whole cycles, with the code that spends them


class Tracker:
    """Inclusive and self host time by label over wrapped calls (perf_counter), and a
    record_function range per call so the profiler's trace carries the same labels."""

    def __init__(self):
        self.incl: dict[str, float] = defaultdict(float)
        self.child: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self.stack: list[list] = []
        self.cycles = 0

    def run(self, label: str, fn, *a, **k):
        from torch.profiler import record_function

        frame = [label, 0.0]
        self.stack.append(frame)
        t0 = time.perf_counter()
        try:
            with record_function(label):
                return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t0
            self.stack.pop()
            self.incl[label] += dt
            self.child[label] += frame[1]
            self.count[label] += 1
            if self.stack:
                self.stack[-1][1] += dt

    def wrap(self, obj, attr: str, label) -> None:
        """obj.attr through run(); label: a string, or a function of the caller's frame."""
        fn = getattr(obj, attr)

        def wrapped(*a, **k):
            name = label if isinstance(label, str) else label(sys._getframe(1))
            return self.run(name, fn, *a, **k)

        setattr(obj, attr, wrapped)

    def reset(self) -> None:
        self.incl.clear(), self.child.clear(), self.count.clear()

    def table(self, cycles: int) -> list[dict]:
        rows = [{"code": k, "calls_per_cycle": round(self.count[k] / cycles, 2),
                 "ms_per_cycle": round(1e3 * self.incl[k] / cycles, 4),
                 "self_ms_per_cycle": round(1e3 * (self.incl[k] - self.child[k]) / cycles, 4)} for k in self.incl]
        return sorted(rows, key=lambda r: -r["ms_per_cycle"])


def caller(kind: str):
    """A label naming the code that called a device method: file:function:line, and the input name
    for uploads (StepRunner's loop variable)."""

    def label(f) -> str:
        what = f.f_locals.get("name") if kind == "upload" else None
        where = f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}:{f.f_lineno}"
        return f"{kind} {what} @ {where}" if what else f"{kind} @ {where}"

    return label


def instrument(be, tr: Tracker) -> None:
    tr.wrap(be, "draft", "draft()")
    tr.wrap(be, "verify", "verify()")
    tr.wrap(be, "target", "target() (alone)")
    for kind in ("upload", "download", "compute"):
        tr.wrap(be.device, kind, caller(kind if kind != "compute" else "compute (acceptance rule; CuPy on CUDA)"))
    for role, runner in be.runners.items():
        instrument_runner(runner, role, tr)


def instrument_runner(runner, role: str, tr: Tracker) -> None:
    """Every entry's run() labelled (replay or eager), entries made later too (a bucket met for
    the first time: its capture, or an eager call, is labelled as such)."""

    def wrap_entry(e):
        tr.wrap(e, "run", f"replay {role}" if e.graphed else f"eager {role}")
        return e

    for e in runner.entries.values():
        wrap_entry(e)
    new = runner._new

    def new_entry(*a, **k):
        return wrap_entry(tr.run(f"new bucket {role} (capture, or an eager call)", new, *a, **k))

    runner._new = new_entry


def run_cycles(env: Env, be, tr: Tracker, n: int, prof=None) -> tuple[float, int]:
    """n DSpark cycles of one request (after its join and two warm cycles); returns (wall s, cycles)."""
    from dspark.runtime.core import EngineCore
    from dspark.runtime import FixedLength

    core = EngineCore(be, FixedLength())
    core.add_request(0, env.models.prompts[0], env.params(env.max_seq - len(env.models.prompts[0]) - 2 * GAMMA - 2))
    for _ in range(3):
        core.step()
    env.sync()
    tr.reset()
    t0 = time.perf_counter()
    done = 0
    ctx = prof if prof is not None else _Null()
    with ctx:
        for _ in range(n):
            if not core.has_unfinished():
                break
            tr.run("cycle", core.step)
            done += 1
        env.sync()
    return time.perf_counter() - t0, done


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def cycle_gpu(events: list[dict]) -> dict:
    """GPU time inside the profiled cycles: in graph replays, outside them (kernels, copies, by
    name), idle; and the CUDA API calls by the innermost labelled code that made them."""
    cycles = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == "cycle"]
    if not cycles:
        return {"note": "no cycle ranges in the trace"}
    lo, hi = min(e["ts"] for e in cycles), max(e["ts"] + e["dur"] for e in cycles)
    n = len(cycles)
    launches = graph_launch_ids(events)
    gpu = [e for e in events if is_gpu(e) and lo <= e["ts"] <= hi]
    inside = [e for e in gpu if e.get("args", {}).get("correlation") in launches]
    outside = [e for e in gpu if e.get("args", {}).get("correlation") not in launches]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in outside:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e["dur"]
    busy = union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    labels = sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("name") != "cycle"
                     and lo <= e["ts"] <= hi), key=lambda e: e["ts"])
    apis: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if not is_api(e) or not lo <= e["ts"] <= hi:
            continue
        owner = "EngineCore (outside the labelled calls)"
        for lab in labels:  # innermost: the latest-starting range that contains the call
            if lab["ts"] > e["ts"]:
                break
            if lab["ts"] + lab["dur"] >= e["ts"] + e["dur"] and lab.get("tid") == e.get("tid"):
                owner = lab["name"]
        apis[owner, e["name"]][0] += 1
        apis[owner, e["name"]][1] += e["dur"]
    us = lambda t: round(t / n, 1)  # noqa: E731
    return {
        "cycles_traced": n, "graph_launches_per_cycle": round(len(launches) / n, 2),
        "wall_us_per_cycle": us(hi - lo),
        "gpu_in_graphs_us": us(union_us([(e["ts"], e["ts"] + e["dur"]) for e in inside])),
        "gpu_outside_graphs_us": us(union_us([(e["ts"], e["ts"] + e["dur"]) for e in outside])),
        "gpu_idle_us": us((hi - lo) - busy),
        "outside_graphs_by_name": [{"name": short(k), "per_cycle": round(c / n, 2), "us_per_cycle": us(t)}
                                   for k, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]],
        "api_calls_by_code": [{"code": o, "api": a, "per_cycle": round(c / n, 2), "us_per_cycle": us(t)}
                              for (o, a), (c, t) in sorted(apis.items(), key=lambda kv: -kv[1][1])[:25]],
        "syncs_per_cycle": round(sum(c for (o, a), (c, t) in apis.items() if is_sync(a)) / n, 2),
    }


def check_cycle(env: Env, res: dict, out_dir: Path) -> None:
    be = env.backend()
    tr = Tracker()
    run_cycles(env, be, tr, env.cycles)  # a warm-up that captures the buckets the measured cycles meet
    instrument(be, tr)
    wall, n = run_cycles(env, be, tr, env.cycles)
    out = res["cycle"] = {"host": {"cycles": n, "wall_ms_per_cycle": round(1e3 * wall / max(n, 1), 4),
                                   "note": "each labelled call adds a perf_counter pair and a record_function "
                                           "(about 1-2 us) to the times above it",
                                   "by_code": tr.table(max(n, 1))}}
    print(f"cycle host: {out['host']['wall_ms_per_cycle']} ms per cycle; "
          + "; ".join(f"{r['code']}: {r['ms_per_cycle']} ms (self {r['self_ms_per_cycle']})"
                      for r in out["host"]["by_code"][:8]), flush=True)
    prof = profiler(env)
    wall_p, n_p = run_cycles(env, be, tr, min(env.cycles, 6), prof)
    events, text = trace_events(prof)
    with gzip.open(out_dir / "cycle_trace.json.gz", "wt") as f:
        f.write(text)
    out["profiled"] = {"cycles": n_p, "wall_ms_per_cycle": round(1e3 * wall_p / max(n_p, 1), 4),
                       "note": "under the profiler: host times are inflated; GPU times are not",
                       **cycle_gpu(events), "top_ops": top_ops(prof)}
    p = out["profiled"]
    print(f"cycle GPU: in graphs {p.get('gpu_in_graphs_us')} us, outside {p.get('gpu_outside_graphs_us')} us, "
          f"idle {p.get('gpu_idle_us')} us of {p.get('wall_us_per_cycle')} us; syncs {p.get('syncs_per_cycle')}",
          flush=True)
    out["ok"] = True


# ---------------------------------------------------------------- variants


def first_split(a: list[int], b: list[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"first split at token {i}"
    return "identical" if len(a) == len(b) else f"lengths differ ({len(a)} vs {len(b)})"


def check_variants(env: Env, res: dict, save) -> None:
    from dspark.runtime import generate
    from dspark.runtime import FixedLength

    m = env.models
    out = res["variants"] = {}
    ref: dict[str, list[list[int]]] = {}
    for name in env.args.variants.split(","):
        if env.left() < (10 if env.smoke else 20):
            out[name] = {"skipped": f"budget: {env.left():.0f} s left"}
            continue
        t0 = time.perf_counter()
        row = out[name] = {}
        try:
            be = variant_backend(env, name)
            p_bench = env.params(env.bench_tokens)
            toks = {"dspark": [], "alone": []}
            for q in m.prompts:
                toks["dspark"].append(generate(be, q, env.params(env.tokens), FixedLength()).token_ids)
                toks["alone"].append(generate(be, q, env.params(env.tokens), None).token_ids)
            if not ref:  # the first variant run is the reference (fp32 unless --variants says otherwise)
                ref, out["reference"] = toks, name
            if be.tf32_setting:
                import torch

                row["tf32"] = {"set": be.tf32_setting, "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                               "float32_matmul_precision": torch.get_float32_matmul_precision()}
            row["greedy_vs_reference"] = {k: [first_split(r, t) for r, t in zip(ref[k], toks[k])] for k in toks}
            runs = {}
            for kind, sched in (("alone", None), ("dspark", FixedLength())):
                generate(be, m.prompts[0], p_bench, sched)
                g = generate(be, m.prompts[0], p_bench, sched)
                runs[kind] = g.stats
            a, d = runs["alone"], runs["dspark"]
            ad, dd = a.to_dict(env.bench_tokens), d.to_dict(env.bench_tokens)
            row["run"] = {
                "tau": d.tau, "alone_tok_s": ad["decode_tokens_per_s"], "dspark_tok_s": dd["decode_tokens_per_s"],
                "efficiency": dd["decode_tokens_per_s"] / (d.tau * ad["decode_tokens_per_s"]),
                "cycle_ms": 1e3 * (d.times["draft"] + d.times["verify"]) / d.cycles,
                "draft_ms": 1e3 * d.times["draft"] / d.cycles, "verify_ms": 1e3 * d.times["verify"] / d.cycles,
                "alone_step_ms": 1e3 * a.times["decode"] / a.cycles}
            g = row["graph_time_ms"] = graph_times(env, be)
            failures = {role: st.capture_failures for role, st in be.stats.items() if st.capture_failures}
            if failures:  # such buckets ran eagerly: their graph_time is an eager call's
                row["capture_failures"] = failures
            P = be.buckets.context(env.start)
            t1, t8, d3 = g[f"target B=1 S=1 P={P}"], g[f"target B=1 S={GAMMA + 1} P={P}"], g[f"drafter B=1 S=3 P={P}"]
            row["graphs_only_efficiency"] = round(t1 / (t8 + d3), 3)  # the bound with nothing outside graphs
            r = row["run"]
            row["outside_graphs_ms"] = {"verify": round(r["verify_ms"] - t8, 4), "draft": round(r["draft_ms"] - d3, 4),
                                        "alone_step": round(r["alone_step_ms"] - t1, 4)}
            if name in ("fp32", "tf32", "bf16") and env.left() > (10 if env.smoke else 40):
                be4 = variant_backend(env, name, slots=4)
                row["graph_time_ms"] |= graph_times(env, be4, 4, (1, GAMMA + 1), (3,))
                del be4
            print(f"variant {name}: efficiency {r['efficiency']:.3f} (graphs only {row['graphs_only_efficiency']}), "
                  f"cycle {r['cycle_ms']:.3f} ms, alone {r['alone_step_ms']:.3f} ms, tau {r['tau']:.2f}; "
                  f"{row['greedy_vs_reference']}; {g}", flush=True)
            del be
        except Exception as e:  # noqa: BLE001 — one variant failing does not stop the others
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()
            print(f"variant {name}: FAILED {row['error']}", file=sys.stderr, flush=True)
            res.setdefault("errors", []).append(f"variant {name}: {row['error']}")
        finally:
            set_tf32(False)
            row["seconds"] = round(time.perf_counter() - t0, 1)
            if env.device == "cuda":
                import torch

                torch.cuda.empty_cache()
            save()
    out["ok"] = not any("error" in v for v in out.values() if isinstance(v, dict))


# ---------------------------------------------------------------- torch.compile, in a subprocess


def compile_child(args) -> int:
    """In the child: plain and compiled backends side by side; graph_time of each compiled step and
    its outputs against the plain one, saved after each."""
    import torch

    out_path = Path(args.compile_child)
    res: dict = {"torch": torch.__version__}

    def save():
        out_path.write_text(json.dumps(res, indent=2, default=str))

    env = Env(args, build_models(args.smoke))
    plain, comp = env.backend(), env.backend()
    if args.compile_bf16:  # both sides in bf16: the compiled step is compared with the plain bf16 one
        cast_bf16(plain)
        cast_bf16(comp)
    res["dtype"] = "bf16" if args.compile_bf16 else "fp32"
    for runner in comp.runners.values():
        runner.step.module = torch.compile(runner.step.module, dynamic=False)
    P = plain.buckets.context(env.start)
    for role, S in (("target", GAMMA + 1), ("target", 1), ("drafter", 3)):
        t0 = time.perf_counter()
        key = f"{role} B=1 S={S} P={P}"
        try:
            e = entry_for(env, comp, role, 1, S, P)  # compiles (in the capture's warm-up), then captures
            row = {"compile_and_capture_s": round(time.perf_counter() - t0, 1), "graphed": e.graphed,
                   "capture_failures": comp.runners[role].stats.capture_failures, "graph_ms": graph_ms(env, e),
                   "plain_graph_ms": graph_ms(env, entry_for(env, plain, role, 1, S, P))}
            first = "logits" if role == "target" else "draft_tokens"
            po, co = entry_for(env, plain, role, 1, S, P).run(), e.run()
            env.sync()
            x, y = po[first].float(), co[first].float()
            row["max_abs_diff_" + first] = float((x - y).abs().max())
            if role == "target":
                row["argmax_equal"] = bool((x.argmax(-1) == y.argmax(-1)).all())
        except Exception as ex:  # noqa: BLE001
            row = {"error": f"{type(ex).__name__}: {ex}", "seconds": round(time.perf_counter() - t0, 1)}
        res[key] = row
        save()
        print(f"compile {key}: {row}", flush=True)
    return 0


def check_compile(env: Env, res: dict, argv: list[str]) -> None:
    limit = min(env.args.compile_limit, env.left() - 10)
    if env.smoke or limit < 20:
        res["compile"] = {"skipped": "smoke mode" if env.smoke else f"budget: {limit:.0f} s for compiling"}
        return
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "compile.json"
        cmd = [sys.executable, __file__, "--compile-child", str(path), *argv]
        p = subprocess.Popen(cmd, start_new_session=True)
        try:
            rc = p.wait(timeout=limit)
            status = f"exit {rc}"
        except subprocess.TimeoutExpired:
            status = f"stopped at its time limit of {limit:.0f} s; what finished is below"
        finally:  # also when this process is stopped (SIGTERM -> SystemExit)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the child and inductor's compile workers
                p.wait()
        row = json.loads(path.read_text()) if path.exists() else {}
    res["compile"] = {"status": status, **row, "ok": True}


# ---------------------------------------------------------------- summary


def summary(res: dict) -> str:
    lines = [f"gpu_profile {res.get('started')} {res.get('gpu', 'CPU stand-in')} torch {res.get('torch')} "
             f"({res.get('config', {}).get('weights')})", ""]
    for name, r in res.get("steps", {}).items():
        if isinstance(r, dict):
            lines.append(f"{name}: {r.get('graph_ms')} ms/replay, {r.get('kernels_per_replay')} kernels, "
                         f"busy {r.get('busy_us')} us, idle {r.get('idle_us')} us, "
                         f"mean kernel {r.get('mean_kernel_us')} us")
            for k in r.get("top_kernels", [])[:5]:
                lines.append(f"    {k['us_per_replay']:8.1f} us  x{k['per_replay']:<5g} {k['kernel'][:100]}")
    c = res.get("cycle", {})
    if "host" in c:
        lines += ["", f"DSpark cycle (batch 1): {c['host']['wall_ms_per_cycle']} ms wall; host time by code:"]
        lines += [f"    {r['ms_per_cycle']:8.4f} ms (self {r['self_ms_per_cycle']:.4f}) "
                  f"x{r['calls_per_cycle']:<5g} {r['code']}" for r in c["host"]["by_code"][:14]]
    p = c.get("profiled", {})
    if "gpu_idle_us" in p:
        lines += [f"  profiled: GPU in graphs {p['gpu_in_graphs_us']} us, "
                  f"outside graphs {p['gpu_outside_graphs_us']} us, idle {p['gpu_idle_us']} us of {p['wall_us_per_cycle']} us; {p['syncs_per_cycle']} syncs/cycle"]
        lines += [f"    {a['us_per_cycle']:8.1f} us x{a['per_cycle']:<5g} {a['api']} in {a['code']}"
                  for a in p["api_calls_by_code"][:10]]
    lines += ["", "variants (batch 1): efficiency = DSpark tok/s / (tau x alone tok/s); "
              "graphs-only = t(S=1) / (t(S=8) + t(drafter S=3))"]
    for name, v in res.get("variants", {}).items():
        if not isinstance(v, dict):
            continue
        if "run" in v:
            r = v["run"]
            if name == "fp32":
                lines.append(f"  (efficiency 0.8 at fp32's target step needs a cycle of about "
                             f"{r['alone_step_ms'] / 0.8:.3f} ms; fp32's takes {r['cycle_ms']:.3f} ms)")
            lines.append(f"  {name:18s} eff {r['efficiency']:.3f} graphs-only {v['graphs_only_efficiency']:.3f} "
                         f"cycle {r['cycle_ms']:.3f} ms (draft {r['draft_ms']:.3f} verify {r['verify_ms']:.3f}) "
                         f"alone {r['alone_step_ms']:.3f} ms; outside graphs {v['outside_graphs_ms']}")
            lines.append(f"  {'':18s} graph ms {v['graph_time_ms']}")
            lines.append(f"  {'':18s} greedy vs reference {v['greedy_vs_reference']}")
        else:
            lines.append(f"  {name:18s} {v.get('skipped') or v.get('error')}")
    if "compile" in res:
        lines += ["", f"torch.compile: {json.dumps(res['compile'])[:1500]}"]
    if res.get("errors"):
        lines += ["", "ERRORS: " + "; ".join(res["errors"])]
    return "\n".join(lines) + "\n"


def _stopped(signum, frame):
    raise SystemExit(124)  # `timeout` stops this run: unwind (the compile child is killed), keep the saved JSON


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "out" / "gpu_profile"))
    p.add_argument("--smoke", action="store_true", help="tiny random model on the CPU stand-in device")
    p.add_argument("--budget", type=float, default=160.0, help="seconds for everything (sections skip past it)")
    p.add_argument("--compile-limit", type=float, default=60.0, help="seconds for the torch.compile subprocess")
    p.add_argument("--compile-bf16", action="store_true", help="compile the bf16 steps (cast as the bf16 variant "
                   "does) instead of the fp32 ones")
    p.add_argument("--sections", default="steps,cycle,variants,compile", help="which sections run, in order")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"which variants run (of {', '.join(VARIANTS)})")
    p.add_argument("--compile-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for v in args.variants.split(","):
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    signal.signal(signal.SIGTERM, _stopped)
    if args.compile_child:
        return compile_child(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "smoke": args.smoke,
                 "python": platform.python_version()}

    def save() -> None:
        (out / "gpu_profile.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
        (out / "gpu_profile.txt").write_text(summary(res))

    import torch

    res["torch"] = torch.__version__
    if not args.smoke and not torch.cuda.is_available():
        res["status"] = "no GPU: torch.cuda.is_available() is False; nothing was measured"
        save()
        print(f"gpu_profile: {res['status']}", file=sys.stderr)
        return 2
    if not args.smoke:
        res["gpu"], res["cuda"] = torch.cuda.get_device_name(0), torch.version.cuda
    torch.manual_seed(0)
    t0 = time.perf_counter()
    env = Env(args, build_models(args.smoke))
    res["config"] = {"weights": "random (SmolLM2-135M shapes)" if not args.smoke else "random (tiny)",
                     "dims": env.models.source.get("dims"), "gamma": GAMMA, "anchor_position": env.start,
                     "prompts": [len(q) for q in env.models.prompts], "max_seq": env.max_seq}
    res["setup_s"] = round(time.perf_counter() - t0, 1)
    save()
    sections = [("steps", lambda: check_steps(env, res)), ("cycle", lambda: check_cycle(env, res, out)),
                ("variants", lambda: check_variants(env, res, save)),
                ("compile", lambda: check_compile(env, res, argv))]
    wanted = args.sections.split(",")
    sections = [s for s in sections if s[0] in wanted]
    failed = False
    for name, run in sections:
        t1 = time.perf_counter()
        if env.left() < 5:
            res[name] = {"skipped": "budget spent"}
        else:
            try:
                run()
            except Exception as e:  # noqa: BLE001 — record it, keep the partial results, go on
                failed = True
                res[name] = {**res.get(name, {}), "ok": False, "error": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc()}
                res.setdefault("errors", []).append(f"{name}: {type(e).__name__}: {e}")
                print(f"{name}: FAILED {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        res[name]["seconds"] = round(time.perf_counter() - t1, 1)
        save()
    failed = failed or bool(res.get("errors"))
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["ok"] = not failed
    save()
    print(summary(res))
    print(f"gpu_profile: {'done' if not failed else 'SOME SECTIONS FAILED'}; results in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
