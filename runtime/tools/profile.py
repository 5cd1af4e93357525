"""`dspark profile --bundle DIR`: measure SPS(B), the target's verification steps per second
at B batch tokens, over the useful range (R rows of S = 1..γ+1 tokens, R up to --max-slots),
and the drafter's seconds per pass at R rows; store them as the bundle's sps.json and
draw the curve with the per-cycle phase breakdown (drafter, verification, the loop).

Rows are measured on a geometric grid of R and interpolated linearly (in step time) in
between; SPS(B) at a B that several shapes reach is their mean step rate."""
from __future__ import annotations

import datetime
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..backends import RunTimer, StepBatch
from ..core import Request, generate_batch
from ..cpu import CpuUse, cpu_signature
from ..engine import Engine
from ..errors import InputError
from ..manifest import Manifest
from ..request import SamplingParams
from ..schedulers import FixedLength
from ..throughput import SPS_FILE, SpsTable
from .plots import pyplot

ROW_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
DRAFT_CONTEXT_ROWS = 2  # new context rows per request in a typical drafting round (a + 1)


@dataclass(frozen=True)
class ProfileConfig:
    max_slots: int = 16  # the largest batch of requests measured
    context: int = 256  # committed positions every row attends to while measured
    repeats: int = 5  # timed runs per shape (the median counts), after one warm-up
    breakdown_tokens: int = 48  # tokens generated per request for the phase breakdown


# What `dspark export` measures unless told not to (about 30 s on a 2-core CPU): enough for the
# default scheduler to plan with; past 8 slots the table extrapolates, `dspark profile` measures.
QUICK = ProfileConfig(max_slots=8, repeats=3, breakdown_tokens=16)
# Past this share of the machine's CPU used by other processes while profiling, the table is
# suspect: a table measured beside a compile run once put a decode step at 48 ms instead of 12
# (docs/results.md), and `auto` then verified where drafting did not pay.
BUSY_SHARE = 0.25


def memory_needed(manifest: Manifest, bundle: Path, slots: int, max_seq: int) -> int:
    """Bytes: KV buffers of target and drafter, plus the graphs' weights."""
    t, d = manifest.target, manifest.drafter
    kv = 2 * 4 * slots * max_seq * (t.num_layers * t.num_kv_heads * t.head_dim + d.num_layers * d.num_kv_heads * d.head_dim)
    weights = sum(p.stat().st_size for p in bundle.iterdir() if p.name.endswith((".onnx", ".data", ".bin")))
    return kv + weights


def available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _interleaved_medians(calls: dict, repeats: int) -> dict:
    """{key: fn} -> {key: median seconds of fn()}, timed in `repeats` rounds that each call every
    fn once (after a warm-up round), so that a slow or fast phase of a shared machine falls on
    every shape alike instead of skewing the one measured during it."""
    for fn in calls.values():
        fn()
    times: dict = {k: [] for k in calls}
    for _ in range(repeats):
        for key, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _fill_rows(measured: dict[int, np.ndarray], max_slots: int) -> np.ndarray:
    """{R: values [..]} on a grid of R -> [max_slots, ..], linear in R between measured rows."""
    rows = sorted(measured)
    table = np.array([measured[r] for r in rows])  # [n, ..]
    return np.stack([np.array([np.interp(r, rows, table[:, i]) for i in range(table.shape[1])])
                     for r in range(1, max_slots + 1)])


def profile(bundle: str | Path, cfg: ProfileConfig, png: str | Path | None = None, **engine_kwargs) -> dict:
    bundle = Path(bundle)
    manifest = Manifest.load(bundle)
    gamma = manifest.drafter.block_size
    s_max = gamma + 1
    max_seq = cfg.context + cfg.breakdown_tokens + 2 * s_max + 1
    if cfg.max_slots < 1 or cfg.context < 1 or cfg.repeats < 1:
        raise InputError(f"max_slots, context and repeats must be >= 1 (got {cfg.max_slots}, {cfg.context}, "
                         f"{cfg.repeats})")
    if max_seq > manifest.target.max_position_embeddings:
        raise InputError(f"--context {cfg.context} needs {max_seq} positions; the target has "
                         f"{manifest.target.max_position_embeddings}")
    need, avail = memory_needed(manifest, bundle, cfg.max_slots, max_seq), available_memory()
    fix = f"profiling {cfg.max_slots} slots of {max_seq} positions needs about {need / 2**30:.2f} GiB"
    if avail is not None and need > 0.8 * avail:
        raise InputError(f"{fix}, but only {avail / 2**30:.2f} GiB of memory is available: lower --max-slots "
                         f"or --context")
    try:
        return _measure(bundle, manifest, cfg, max_seq, png, engine_kwargs, CpuUse())
    except MemoryError as e:
        raise InputError(f"{fix} and ran out of memory: lower --max-slots or --context") from e
    except RuntimeError as e:  # ONNX Runtime reports a failed allocation (e.g. on a GPU) as a RuntimeError
        if "alloc" not in str(e).lower() and "memory" not in str(e).lower():
            raise
        raise InputError(f"{fix} and the engine could not allocate it ({e}): lower --max-slots or --context") from e


def _measure(bundle: Path, manifest: Manifest, cfg: ProfileConfig, max_seq: int, png: str | Path | None,
             engine_kwargs: dict, cpu_use: CpuUse) -> dict:
    gamma = manifest.drafter.block_size
    s_max = gamma + 1
    engine = Engine.load(bundle, max_seq=max_seq, slots=cfg.max_slots, read_tables=False, **engine_kwargs)
    be, rng = engine.backend, np.random.default_rng(0)
    V = manifest.target.vocab_size
    for slot in range(cfg.max_slots):  # every row attends to `context` committed positions
        be.prefill(slot, rng.integers(0, V, cfg.context), True)

    rows = sorted({r for r in ROW_GRID if r <= cfg.max_slots} | {cfg.max_slots})
    own = be.drafter_graph
    drafters = {own: be}
    if own != "int8-greedy" and "drafter_ort" in manifest.graphs and engine_kwargs.get("provider", "cpu") == "cpu":
        # an engine with fewer slots may run the other drafter graph (OrtBackend, INT8_MAX_SLOTS);
        # at T = 0 every CPU engine runs the greedy-only graph, when the bundle has it
        other = Engine.load(bundle, max_seq=max_seq, slots=cfg.max_slots, read_tables=False,
                            **{**engine_kwargs, "drafter_graph": "fp32" if own == "int8" else "int8"}).backend
        drafters[other.drafter_graph] = other
    calls = {}
    for R in rows:
        starts = np.full(R, cfg.context, np.int64)
        for S in range(1, s_max + 1):
            calls["verify", R, S] = lambda t=rng.integers(0, V, (R, S)), st=starts: be.target(t, st)
        batch = StepBatch(  # each row ingests a typical round's new context rows, greedy
            features=np.zeros((R, DRAFT_CONTEXT_ROWS, manifest.drafter.feature_dim), np.float32),
            counts=np.full(R, DRAFT_CONTEXT_ROWS), floors=np.zeros(R, np.int64), starts=starts,
            anchors=np.zeros(R, np.int64), temperatures=np.zeros(R), uniforms=np.zeros((R, 2 * gamma + 1)),
            lengths=np.zeros(R, np.int64))
        for graph, b in drafters.items():
            calls[graph, R] = lambda b=b, batch=batch: b.draft(batch)
    seconds = _interleaved_medians(calls, cfg.repeats)
    step = _fill_rows({R: np.array([seconds["verify", R, S] for S in range(1, s_max + 1)]) for R in rows},
                      cfg.max_slots)  # [R_max, S_max] seconds
    by_graph = {g: _fill_rows({R: np.array([seconds[g, R]]) for R in rows}, cfg.max_slots)[:, 0]
                for g in drafters}  # [R_max] seconds per drafter pass
    drafter = by_graph[own]
    by_tokens: dict[int, list[float]] = {}
    for R in range(1, cfg.max_slots + 1):
        for S in range(1, s_max + 1):
            by_tokens.setdefault(R * S, []).append(step[R - 1, S - 1])
    Bs = sorted(by_tokens)
    mean_s = [float(np.mean(by_tokens[b])) for b in Bs]
    sps = 1.0 / np.interp(np.arange(1, Bs[-1] + 1), Bs, mean_s)  # [B_max]
    table = SpsTable(tuple(float(v) for v in sps), tuple(float(v) for v in drafter),
                     tuple(tuple(float(1.0 / v) for v in row) for row in step),
                     {g: tuple(float(v) for v in d) for g, d in by_graph.items()})

    breakdown = {R: phase_breakdown(be, R, cfg, rng) for R in sorted({1, cfg.max_slots})}
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "context": cfg.context, "repeats": cfg.repeats, "rows_measured": rows, "tokens_per_row": s_max,
            "graph": "target_ort" if be.in_place else "target", "precision": manifest.precision, "cpu": cpu_signature(),
            "engine": engine_kwargs,
            "phase_breakdown_ms_per_cycle": breakdown, "other_cpu_share": cpu_use.other_share()}
    if meta["other_cpu_share"] > BUSY_SHARE:
        warnings.warn(f"other processes used {meta['other_cpu_share']:.0%} of this machine's CPU while {bundle} was "
                      "profiled: its SPS table may misjudge what verification costs, and the scheduler with it; "
                      f"run `dspark profile --bundle {bundle}` again on a quiet machine", stacklevel=2)
    table.save(bundle, meta)
    path = plot(table, breakdown, s_max, Path(png or bundle / "sps.png"))
    return {"file": str(bundle / SPS_FILE), "png": str(path), "sps": table.sps, "draft_s": table.draft_s,
            "breakdown": breakdown, "rows": rows}


def phase_breakdown(be, R: int, cfg: ProfileConfig, rng: np.random.Generator) -> dict[str, float]:
    """ms per cycle of R random-prompt requests decoded at once, verifying all γ drafts: inside the
    drafter's and the target's runs (the backend's timing hook), and the rest of the loop."""
    V = be.vocab_size
    requests = [Request(rng.integers(0, V, cfg.context).tolist(), SamplingParams(0.0, cfg.breakdown_tokens))
                for _ in range(R)]
    timer = be.on_run = RunTimer()
    try:
        t0 = time.perf_counter()
        gens = generate_batch(be, requests, FixedLength())
        wall = time.perf_counter() - t0
    finally:
        be.on_run = None
    s = gens[0].stats  # every request sits in every step: they share one timeline
    cycles = max(s.cycles, 1)
    prefill = sum(g.stats.times["prefill"] for g in gens)
    per = {"draft": timer.seconds["drafter"], "verify": timer.seconds["target"]}
    per["loop"] = wall - prefill - per["draft"] - per["verify"]
    return {k: 1000.0 * v / cycles for k, v in per.items()} | {"cycles": s.cycles}


def plot(table: SpsTable, breakdown: dict, s_max: int, path: Path) -> Path:
    plt = pyplot()
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 3.6))
    B = np.arange(1, len(table.sps) + 1)
    ax1.plot(B, table.sps, "k-", lw=1.2, label="SPS(B), mean over shapes")
    for S in range(1, s_max + 1):
        R = np.arange(1, len(table.grid) + 1)
        ax1.plot(R * S, [table.grid[r - 1][S - 1] for r in R], ".", ms=3, label=f"S = {S}")
    ax1.set(xlabel="batch tokens B = R·S", ylabel="verification steps / s", title="SPS(B)", xscale="log",
            yscale="log")
    ax1.legend(fontsize=6, ncol=2)
    ax2.plot(np.arange(1, len(table.draft_s) + 1), 1000 * np.array(table.draft_s), "o-", ms=3)
    ax2.set(xlabel="requests R", ylabel="ms per drafter pass", title="drafter cost")
    labels = [f"R = {r}" for r in breakdown]
    bottom = np.zeros(len(breakdown))
    for phase in ("draft", "verify", "loop"):
        v = np.array([b[phase] for b in breakdown.values()])
        ax3.bar(labels, v, bottom=bottom, label=phase)
        bottom += v
    ax3.set(ylabel="ms per cycle", title="cycle phases (γ drafts verified)")
    ax3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_report(summary: dict) -> str:
    sps, draft = summary["sps"], summary["draft_s"]
    picks = sorted({1, 2, 4, 8, 16, 32, 64, 128, len(sps)} & set(range(1, len(sps) + 1)))
    lines = ["B      " + " ".join(f"{b:>7}" for b in picks),
             "SPS(B) " + " ".join(f"{sps[b - 1]:>7.1f}" for b in picks),
             f"drafter: {1000 * draft[0]:.2f} ms at R = 1, {1000 * draft[-1]:.2f} ms at R = {len(draft)}"]
    for R, b in summary["breakdown"].items():
        lines.append(f"cycle at R = {R}: draft {b['draft']:.2f} ms, verify {b['verify']:.2f} ms, "
                     f"loop {b['loop']:.2f} ms ({b['cycles']} cycles)")
    lines.append(f"wrote {summary['file']} and {summary['png']}")
    return "\n".join(lines)
