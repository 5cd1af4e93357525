#!/usr/bin/env python
"""Benchmark, side by side on this CPU (batch 1, greedy):

  (a) the target alone on the bundle's ONNX Runtime engine  (engine.generate(..., scheduler="none"))
  (b) DSpark on the same engine                             (scheduler "fixed", "auto", or any of --schedulers)
  (c) transformers `generate` on the same model             (the GGUF the bundle was exported from)
  (d) llama.cpp on that GGUF, as it is (Q4_1 weights)        (llama-cpp-python, when it is installed)

over the first N prompts of GSM8K and of MT-Bench (first turn), run interleaved per prompt
(a, b, c for prompt 1, then prompt 2, ...) after one warm-up of each contender.

It also measures
  * the time spent inside ONNX Runtime session runs (the backend's timing hook, `on_run`), so
    host overhead = cycle wall time - time inside ORT is measured, not estimated;
  * the sequential stage's share of the drafter's kernel time, from an ONNX Runtime profile of a
    fresh drafter session fed the inputs captured from a real DSpark run (nodes attributed by the
    'SequentialStage' entry of their 'pkg.torch.onnx.class_hierarchy' metadata, which the int8
    graphs keep from the exported ones; a control-flow node counts whole, its own overhead
    included, and the nodes of its branches are not counted again);
  * a weight-read floor: the time to read the target's weight bytes once, as (1) an ORT graph of
    [1,K]x[K,N] MatMul GEMVs over the same number of bytes and (2) a two-thread numpy sum;
  * the target-alone decode step (ms per token after prefill) and its ratio to that floor.

    python scripts/bench_ort.py                                   # 5 + 5 prompts, 256 new tokens
    python scripts/bench_ort.py --n-prompts 2 --max-new-tokens 64 --out /tmp/bench.json

This is a benchmark, not a test: it prints figures, it asserts nothing.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tqdm import tqdm

from dspark.runtime.backends import RunEvent
from dspark.runtime.backends.onnxruntime import session_options  # the engine's own: side runs share its threads
from dspark.runtime.graph_io import PAST, kv_names
from dspark.runtime.schedulers import NAMES as SCHEDULERS
from dspark.runtime.tools.prompts import bench_prompts

ROOT = Path(__file__).resolve().parents[1]
DATASETS = ("gsm8k", "mt-bench")
SEQ_MARK = "SequentialStage"
HIERARCHY_KEY = "pkg.torch.onnx.class_hierarchy"


# ---------------------------------------------------------------------------------------------
# environment

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("onnxruntime", "numpy", "transformers", "torch", "onnx", "tokenizers", "llama_cpp"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a missing package is reported, not fatal
            out[name] = "not installed"
    return out


class CpuUse:
    """CPU seconds used by other processes over an interval: machine busy time (/proc/stat)
    minus this process's user+system time. A large value means the timings were disturbed."""

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK")
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy(), self._own()

    @staticmethod
    def _busy() -> float:
        try:
            f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError):
            return float("nan")
        idle = f[3] + (f[4] if len(f) > 4 else 0)
        return float(sum(f[:8]) - idle)

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def other_share(self) -> float:
        wall = time.perf_counter() - self.t0
        other = max(0.0, (self._busy() - self.busy0) / self.hz - (self._own() - self.own0))
        return other / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0

    def report(self) -> dict:
        wall = time.perf_counter() - self.t0
        busy = (self._busy() - self.busy0) / self.hz
        own = self._own() - self.own0
        other = max(0.0, busy - own)
        cores = os.cpu_count() or 1
        return {"wall_s": wall, "machine_busy_cpu_s": busy, "this_process_cpu_s": own, "other_cpu_s": other,
                "other_share_of_capacity": other / (wall * cores) if wall > 0 else 0.0,
                "loadavg_end": os.getloadavg()}


# ---------------------------------------------------------------------------------------------
# ORT timing

class RunLog:
    """The engine's timing hook (`backend.on_run`): every engine run as (kind, graph, seconds), and
    while `capture` is set the inputs of the drafting rounds (copied)."""

    def __init__(self):
        self.runs: list[tuple[str, str, float]] = []
        self.capture = False
        self.captured: list[tuple[str, dict[str, np.ndarray]]] = []

    def __call__(self, event: RunEvent) -> None:
        self.runs.append((event.kind, event.graph, event.seconds))
        if self.capture and event.kind == "drafter":
            self.captured.append((event.graph, {k: np.array(v, copy=True) for k, v in event.inputs.items()}))


# ---------------------------------------------------------------------------------------------
# contenders

@dataclass
class Run:
    contender: str
    dataset: str
    index: int
    prompt_tokens: int
    new_tokens: int
    wall_s: float
    finish_reason: str = ""
    token_ids: list[int] = field(default_factory=list)
    stats: dict = field(default_factory=dict)  # the loop's Stats (engine contenders)
    ort: dict = field(default_factory=dict)  # seconds inside ORT runs: prefill, target_decode, drafter
    other_cpu_share: float = 0.0  # share of the machine used by other processes during this run

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def run_engine(engine, log: RunLog, contender: str, scheduler: str, threshold: float, prompt: str,
               max_new_tokens: int, dataset: str, index: int) -> Run:
    log.runs.clear()
    t0 = time.perf_counter()
    res = engine.generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0, scheduler=scheduler,
                          threshold=threshold)
    wall = time.perf_counter() - t0
    seconds = lambda kind: sum(d for k, _, d in log.runs if k == kind)  # noqa: E731
    count = lambda kind: sum(1 for k, _, _ in log.runs if k == kind)  # noqa: E731
    ort_times = {"prefill": seconds("prefill"), "target_decode": seconds("target"), "drafter": seconds("drafter"),
                 "target_calls": count("target"), "drafter_calls": count("drafter")}
    st = res.stats
    stats = {"times_s": dict(st.times), "cycles": st.cycles, "emitted_sum": int(sum(st.emitted)),
             "verified_sum": int(sum(st.verified)), "tau": st.tau,
             "per_position_acceptance": st.per_position_acceptance}
    return Run(contender, dataset, index, res.prompt_tokens, len(res.token_ids), wall, res.finish_reason,
               list(res.token_ids), stats=stats, ort=ort_times)


def run_transformers(model, torch, gen_config, ids: list[int], dataset: str, index: int) -> Run:
    x = torch.tensor([ids], dtype=torch.long)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gen_config)
        wall = time.perf_counter() - t0
    new = out[0, len(ids):].tolist()
    stops = set(gen_config.eos_token_id)
    reason = "stop" if new and new[-1] in stops else "length"
    return Run("transformers", dataset, index, len(ids), len(new), wall, reason, new)


def run_llama(llm, ids: list[int], n_new: int, stops: set[int], dataset: str, index: int) -> Run:
    """Greedy llama.cpp (top-k 1, no repetition penalty) from the same prompt token ids."""
    new: list[int] = []
    t0 = time.perf_counter()
    for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        new.append(int(tok))
        if tok in stops or len(new) >= n_new:
            break
    wall = time.perf_counter() - t0
    return Run("llama.cpp", dataset, index, len(ids), len(new), wall, "stop" if new[-1] in stops else "length", new)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_lossless(engine, prompt: str, ref: list[int], cand: list[int]) -> dict:
    """Greedy identity of `cand` against the target-alone `ref`; on a split, the reference's
    top-2 logit gap there (from one target pass over prompt + ref) says whether it is a near-tie."""
    if ref == cand:
        return {"identical": True, "diverged_at": None, "gap": None, "verdict": "identical"}
    from dspark.runtime.tools.parity import greedy_match

    ids = engine.encode(prompt)
    seq = np.asarray(ids + ref, np.int64)
    (logits,), _ = engine.backend.target(seq[None], np.zeros(1, np.int64))
    logits = logits[len(ids) - 1:len(seq) - 1]  # row n-1+i produced ref[i]
    m = greedy_match(ref, cand, logits)
    return {"identical": False, "diverged_at": m.diverged_at, "gap": m.gap, "verdict": str(m)}


# ---------------------------------------------------------------------------------------------
# drafter profile: sequential stage's share of kernel time

def profile_drafter(bundle: Path, graph: str, threads: int, captured: list[dict], past: dict[str, np.ndarray],
                    passes: int = 3) -> dict:
    import onnx

    model_path = bundle / graph
    g0 = onnx.load(str(model_path), load_external_data=False).graph

    def is_seq(node) -> bool:  # the int8 graphs carry the metadata of the nodes they were made from
        md = {p.key: p.value for p in node.metadata_props}
        return SEQ_MARK in md.get(HIERARCHY_KEY, "")

    def walk(graph, inherited: bool = False, nested: bool = False):
        """(node, sequential?, inside a control-flow branch?); branch nodes belong to their If's stage."""
        for n in graph.node:
            seq = inherited or is_seq(n)
            yield n, seq, nested
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    yield from walk(a.g, seq, True)

    nodes0 = list(walk(g0))
    by_name = {n.name: seq for n, seq, _ in nodes0}
    by_output = {o: seq for n, seq, _ in nodes0 for o in n.output if o}
    in_branch = {n.name for n, _, nested in nodes0 if nested}
    n_seq_nodes = sum(by_name.values())

    with tempfile.TemporaryDirectory(prefix="bench_ort_prof_") as tmp:
        so = session_options(threads)
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / "drafter")
        so.optimized_model_filepath = str(Path(tmp) / "drafter_opt.onnx")
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "drafter_opt.data")
        so.log_severity_level = 3
        sess = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
        for _ in range(passes):
            for feeds in captured:
                sess.run(None, {**feeds, **past})
        prof_file = sess.end_profiling()
        events = json.loads(Path(prof_file).read_text())
        g1 = onnx.load(so.optimized_model_filepath, load_external_data=False).graph
    nodes1 = list(walk(g1))
    opt_nodes = {n.name: n for n, _, _ in nodes1}
    in_branch |= {n.name for n, _, nested in nodes1 if nested}

    def attribute(name: str) -> bool | None:
        if name in by_name:
            return by_name[name]
        head = name.split("/", 1)[0]  # fused nodes: "<original>/<FusionName>..."
        if head in by_name:
            return by_name[head]
        node = opt_nodes.get(name)
        if node is not None:  # nodes the optimizer created keep the tensors of the ones they replace
            for t in list(node.output) + list(node.input):
                if t in by_output:
                    return by_output[t]
        return None

    runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    run_durs = [e["dur"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    warm = len(captured) * (passes - 1)
    t_from = runs[warm] if len(runs) > warm else 0
    seq_us = back_us = other_us = 0.0
    seq_ops: dict[str, float] = {}
    unattributed: dict[str, float] = {}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time") or e["ts"] < t_from:
            continue
        name, dur, op = e["name"][:-len("_kernel_time")], float(e["dur"]), e.get("args", {}).get("op_name", "?")
        if name in in_branch:  # already inside its control-flow node's time, which also counts the
            continue  # branch's own overhead (docs/results.md)
        cls = attribute(name)
        if cls is True:
            seq_us += dur
            seq_ops[op] = seq_ops.get(op, 0.0) + dur
        elif cls is False:
            back_us += dur
        else:
            other_us += dur
            unattributed[name] = unattributed.get(name, 0.0) + dur
    kernel = seq_us + back_us + other_us
    measured_runs = run_durs[warm:] if len(run_durs) > warm else run_durs
    return {
        "calls_profiled": len(captured), "passes": passes, "warm_passes": passes - 1,
        "sequential_nodes_in_graph": n_seq_nodes, "nodes_in_graph": len(nodes0),
        "kernel_us_per_call": kernel / max(1, len(captured)),
        "model_run_us_per_call": (sum(measured_runs) / len(measured_runs)) if measured_runs else None,
        "sequential_us_per_call": seq_us / max(1, len(captured)),
        "backbone_us_per_call": back_us / max(1, len(captured)),
        "unattributed_us_per_call": other_us / max(1, len(captured)),
        "sequential_share": seq_us / kernel if kernel else 0.0,
        "unattributed_share": other_us / kernel if kernel else 0.0,
        "sequential_top_ops_us_per_call": {k: v / max(1, len(captured)) for k, v in
                                           sorted(seq_ops.items(), key=lambda kv: -kv[1])[:6]},
        "unattributed_nodes": sorted(unattributed, key=lambda k: -unattributed[k])[:10],
    }


# ---------------------------------------------------------------------------------------------
# weight-read floor

def weight_bytes(bundle: Path, graph: str) -> dict:
    import onnx

    g = onnx.load(str(bundle / graph), load_external_data=False).graph
    itemsize = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.BFLOAT16: 2,
                onnx.TensorProto.INT64: 8, onnx.TensorProto.INT32: 4, onnx.TensorProto.INT8: 1,
                onnx.TensorProto.UINT8: 1, onnx.TensorProto.DOUBLE: 8}
    total, big = 0, 0
    for t in g.initializer:
        n = int(np.prod(t.dims)) if len(t.dims) else 1
        b = n * itemsize.get(t.data_type, 4)
        total += b
        if len(t.dims) == 2:
            big += b
    return {"initializer_bytes": total, "matrix_bytes": big, "initializers": len(g.initializer)}


def gemv_floor(total_bytes: int, k: int, n_matmuls: int, threads: int, reps: int) -> dict:
    """ORT graph of n independent [1,K]x[K,N] MatMuls (distinct random weights) over total_bytes."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    n = max(1, round(total_bytes / (4 * k * n_matmuls)))
    rng = np.random.default_rng(0)
    inits, nodes, outputs = [], [], []
    for i in range(n_matmuls):
        inits.append(numpy_helper.from_array(rng.standard_normal((k, n), dtype=np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"gemv_{i}"))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, n]))
    graph = helper.make_graph(nodes, "weight_read_floor", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    blob = model.SerializeToString()
    del model, graph, inits
    so = session_options(threads)
    so.log_severity_level = 3
    sess = ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])
    del blob
    x = {"x": rng.standard_normal((1, k), dtype=np.float32)}
    for _ in range(3):
        sess.run(None, x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sess.run(None, x)
        times.append(time.perf_counter() - t0)
    del sess
    b = 4 * k * n * n_matmuls
    return {"bytes": b, "matmuls": n_matmuls, "shape": [1, k, n], "min_s": min(times),
            "median_s": statistics.median(times), "gbps_median": b / statistics.median(times) / 1e9}


def numpy_floor(total_bytes: int, threads: int, reps: int) -> dict:
    """Read total_bytes once: sum over `threads` contiguous parts, one per thread."""
    buf = np.ones(total_bytes // 4, np.float32)
    parts = np.array_split(buf, threads)

    def timed(fn) -> list[float]:
        fn()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        multi = timed(lambda: [f.result() for f in [pool.submit(np.add.reduce, p) for p in parts]])
    single = timed(lambda: np.add.reduce(buf))
    del buf, parts
    return {"bytes": total_bytes, "threads": threads, "min_s": min(multi), "median_s": statistics.median(multi),
            "gbps_median": total_bytes / statistics.median(multi) / 1e9,
            "single_thread_median_s": statistics.median(single)}


def merge_floors(ms: list[dict]) -> dict:
    out = dict(ms[0])
    out["min_s"] = min(m["min_s"] for m in ms)
    out["median_s_each"] = [m["median_s"] for m in ms]
    out["min_s_each"] = [m["min_s"] for m in ms]
    out["median_s"] = min(m["median_s"] for m in ms)
    out["gbps_best"] = out["bytes"] / out["min_s"] / 1e9
    return out


# ---------------------------------------------------------------------------------------------
# aggregation

def agg_rate(runs: list[Run]) -> float:
    wall = sum(r.wall_s for r in runs)
    return sum(r.new_tokens for r in runs) / wall if wall else float("nan")


def agg_target(runs: list[Run]) -> dict:
    decode = sum(r.stats["times_s"]["decode"] for r in runs)
    steps = sum(r.new_tokens - 1 for r in runs)
    ort_decode = sum(r.ort["target_decode"] for r in runs)
    return {"tokens_per_s": agg_rate(runs), "decode_step_ms": 1e3 * decode / steps if steps else float("nan"),
            "decode_host_share": (decode - ort_decode) / decode if decode else float("nan"),
            "ort_ms_per_step": 1e3 * ort_decode / steps if steps else float("nan"),
            "step_ms_per_prompt": [1e3 * r.stats["times_s"]["decode"] / max(1, r.new_tokens - 1) for r in runs]}


def agg_dspark(runs: list[Run], seq_share: float | None) -> dict:
    cycles = sum(r.stats["cycles"] for r in runs)
    if not cycles:
        return {"tokens_per_s": agg_rate(runs), "cycles": 0}
    t = lambda key: sum(r.stats["times_s"][key] for r in runs)  # noqa: E731
    loop = t("total") - t("prefill")  # every cycle, back to back
    draft, verify = t("draft"), t("verify") + t("decode")  # decode: steps the scheduler ran without drafting
    ort_d, ort_v = sum(r.ort["drafter"] for r in runs), sum(r.ort["target_decode"] for r in runs)
    per = lambda s: 1e3 * s / cycles  # noqa: E731
    out = {
        "tokens_per_s": agg_rate(runs), "cycles": cycles,
        "tau": sum(r.stats["emitted_sum"] for r in runs) / cycles,
        "mean_verified": sum(r.stats["verified_sum"] for r in runs) / cycles,
        "cycle_ms": per(loop),
        "draft_ms": per(draft), "verify_ms": per(verify), "rest_ms": per(loop - draft - verify),
        "ort_drafter_ms": per(ort_d), "ort_verify_ms": per(ort_v),
        "host_ms": per(loop - ort_d - ort_v),
        "host_share": (loop - ort_d - ort_v) / loop if loop else float("nan"),
        "draft_host_ms": per(draft - ort_d), "verify_host_ms": per(verify - ort_v),
    }
    if seq_share is not None:
        out.update({"draft_backbone_ms": (1 - seq_share) * out["draft_ms"],
                    "draft_sequential_ms": seq_share * out["draft_ms"],
                    "ort_backbone_ms": (1 - seq_share) * out["ort_drafter_ms"],
                    "ort_sequential_ms": seq_share * out["ort_drafter_ms"]})
    return out


# ---------------------------------------------------------------------------------------------

def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, default=ROOT / "engines" / "smollm2", help="bundle (default engines/smollm2)")
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data",
                   help="data folder (default ../shared/data relative to the repo root)")
    p.add_argument("--n-prompts", type=int, default=5, help="prompts per dataset (default 5)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per request (default 256)")
    p.add_argument("--schedulers", default="fixed,auto",
                   help="DSpark schedulers to run, comma-separated (default fixed,auto: every γ drafts verified, "
                        "and the runtime's default): fixed, threshold, prefix, async, cost, auto; prefix, async "
                        "and cost need the bundle's sps.json and calibration.json (`dspark profile`, "
                        "`dspark calibrate`), auto falls back to fixed without them")
    p.add_argument("--threshold", type=float, default=0.5, help="confidence threshold of the threshold scheduler")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="ORT intra-op threads and torch threads (default: every core)")
    p.add_argument("--max-seq", type=int, default=2048, help="engine KV positions (default 2048)")
    p.add_argument("--no-transformers", action="store_true", help="skip contender (c)")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip contender (d), run when llama-cpp-python "
                   "is installed (CMAKE_ARGS=-DGGML_NATIVE=ON pip install -e '.[llama]': it compiles from source, minutes)")
    p.add_argument("--floor-matmuls", type=int, default=96, help="GEMVs in the ORT weight-read graph (default 96)")
    p.add_argument("--floor-reps", type=int, default=25, help="timed repetitions of each floor measurement")
    p.add_argument("--profile-passes", type=int, default=3, help="passes over the captured drafter calls "
                   "in the profile (all but the last are warm-up)")
    p.add_argument("--out", type=Path, default=None, help="write every figure and per-prompt run to this JSON file")
    args = p.parse_args(argv)
    bundle = args.bundle if args.bundle.is_absolute() or args.bundle.exists() else ROOT / args.bundle
    schedulers = [s.strip() for s in args.schedulers.split(",") if s.strip()]
    for s in schedulers:
        if s not in SCHEDULERS or s == "none":
            raise SystemExit(f"unknown DSpark scheduler {s!r}; choose from {', '.join(n for n in SCHEDULERS if n != 'none')}")

    env = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv),
           "cwd": os.getcwd(), "cpu": cpu_model(), "cores": os.cpu_count(),
           "affinity": len(os.sched_getaffinity(0)), "platform": platform.platform(),
           "loadavg_start": os.getloadavg(), "versions": versions(), "threads": args.threads}
    print(f"date      {env['date']}")
    print(f"command   {env['command']}   (cwd {env['cwd']})")
    print(f"machine   {env['cpu']}, {env['cores']} cores ({env['affinity']} usable), {env['platform']}")
    print("versions  " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()))
    print(f"load avg  {env['loadavg_start'][0]:.2f} {env['loadavg_start'][1]:.2f} {env['loadavg_start'][2]:.2f} "
          f"at start; threads: ORT {args.threads} (one global intra-op pool), torch {args.threads}", flush=True)

    from dspark.runtime import Engine

    engine = Engine.load(bundle, max_seq=args.max_seq, threads=args.threads)
    m = engine.manifest
    log = engine.backend.on_run = RunLog()
    prompts = {name: bench_prompts(name, args.n_prompts + 1, data_dir=args.data_dir / "bench") for name in DATASETS}
    print(f"bundle    {bundle}: target {m.target.arch} {m.target.num_layers} layers d={m.target.hidden_size} "
          f"V={m.target.vocab_size}, drafter γ={m.drafter.block_size} {m.drafter.num_layers} layer(s) "
          f"[{m.drafter_label}]")

    model = torch = gen_config = None
    gguf = None
    if not args.no_transformers:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.utils import logging as hf_logging

        from dspark.export import default_target_path

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        torch.set_num_threads(args.threads)
        gguf = default_target_path()
        digest = sha256(gguf)
        same = digest == m.source_hashes.get("target")
        print(f"GGUF      {gguf} sha256 {digest[:16]}… "
              f"{'== bundle target source hash (same model)' if same else '!= bundle target source hash: NOT the same model'}")
        env.update({"gguf": str(gguf), "gguf_sha256": digest, "gguf_matches_bundle": same})
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        stops = list(m.stop_token_ids)
        gen_config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, num_beams=1,
                                      eos_token_id=stops, pad_token_id=stops[0])

    llm = None
    if not args.no_llama_cpp:
        try:
            from llama_cpp import Llama
        except ImportError:
            print("llama.cpp: llama-cpp-python is not installed, contender (d) skipped")
        else:
            from dspark.export import default_target_path

            gguf = gguf or default_target_path()
            llm = Llama(model_path=str(gguf), n_ctx=args.max_seq, n_threads=args.threads, n_batch=512, verbose=False)
            print(f"llama.cpp {gguf.name} as it is (its own quantized kernels), {args.threads} threads")

    contenders = (["target"] + [f"dspark-{s}" for s in schedulers] + ([] if args.no_transformers else ["transformers"])
                  + ([] if llm is None else ["llama.cpp"]))
    sched_of = {"target": "none", **{f"dspark-{s}": s for s in schedulers}}

    def one(name: str, prompt: str, n_new: int, dataset: str, index: int) -> Run:
        if name == "llama.cpp":
            return run_llama(llm, engine.encode(prompt), n_new, set(m.stop_token_ids), dataset, index)
        if name == "transformers":
            gen_config.max_new_tokens = n_new
            return run_transformers(model, torch, gen_config, engine.encode(prompt), dataset, index)
        return run_engine(engine, log, name, sched_of[name], args.threshold, prompt, n_new, dataset, index)

    # warm-up, one of each, on a prompt outside the measured set; capture the drafter's inputs
    warm_prompt = prompts["gsm8k"][args.n_prompts] if len(prompts["gsm8k"]) > args.n_prompts else prompts["gsm8k"][0]
    for name in tqdm(contenders, desc="warm-up", file=sys.stderr, leave=False):
        log.capture = name.startswith("dspark") and not log.captured
        one(name, warm_prompt, min(64, args.max_new_tokens), "warmup", -1)
    log.capture = False
    drafter_graph = log.captured[0][0] if log.captured else None  # the graph greedy rows run
    captured = [inputs for graph, inputs in log.captured if graph == drafter_graph]
    drafter_past = dict(zip(kv_names(PAST, len(engine.backend.draft_kv.keys)),
                            (a.copy() for a in engine.backend.draft_kv.arrays)))

    # weight-read floors, once before and once after the measured runs (the floor is the fastest read seen)
    print("measuring: weight-read floors (before) …", file=sys.stderr, flush=True)
    wb = weight_bytes(bundle, m.graphs["target"])
    floors = {"ort": [gemv_floor(wb["initializer_bytes"], m.target.hidden_size, args.floor_matmuls, args.threads,
                                 args.floor_reps)],
              "numpy": [numpy_floor(wb["initializer_bytes"], args.threads, args.floor_reps)]}

    # the measured, interleaved runs
    runs: list[Run] = []
    lossless: list[dict] = []
    cpu = CpuUse()
    work = [(ds, i, prompts[ds][i]) for ds in DATASETS for i in range(args.n_prompts)]
    with tqdm(total=len(work) * len(contenders), desc="bench", file=sys.stderr, unit="run") as bar:
        for ds, i, prompt in work:
            mine: dict[str, Run] = {}
            for name in contenders:
                bar.set_postfix_str(f"{ds}[{i}] {name}")
                watch = CpuUse()
                mine[name] = r = one(name, prompt, args.max_new_tokens, ds, i)
                r.other_cpu_share = watch.other_share()
                runs.append(r)
                bar.update()
            ref = mine["target"].token_ids
            for name in contenders[1:]:
                if name.startswith("dspark"):
                    lossless.append({"dataset": ds, "index": i, "contender": name,
                                     **check_lossless(engine, prompt, ref, mine[name].token_ids)})
                else:
                    d = first_divergence(ref, mine[name].token_ids)
                    lossless.append({"dataset": ds, "index": i, "contender": name, "identical": d is None,
                                     "diverged_at": d, "gap": None,
                                     "verdict": "identical" if d is None else f"diverged at generated token {d}"})
    disturbance = cpu.report()

    # the drafter's profile, then the weight-read floors
    print("measuring: drafter profile, weight-read floors (after) …", file=sys.stderr, flush=True)
    prof = None
    if captured:
        prof = profile_drafter(bundle, drafter_graph, args.threads, captured, drafter_past,
                               args.profile_passes)
    floors["ort"].append(gemv_floor(wb["initializer_bytes"], m.target.hidden_size, args.floor_matmuls,
                                    args.threads, args.floor_reps))
    floors["numpy"].append(numpy_floor(wb["initializer_bytes"], args.threads, args.floor_reps))
    floor_ort, floor_np = merge_floors(floors["ort"]), merge_floors(floors["numpy"])

    # ---- aggregate and print ------------------------------------------------------------------
    seq_share = prof["sequential_share"] if prof else None
    groups = {ds: [r for r in runs if r.dataset == ds] for ds in DATASETS}
    groups["overall"] = runs
    cols = [*DATASETS, "overall"]
    res: dict = {c: {} for c in cols}
    for col, rs in groups.items():
        for name in contenders:
            sel = [r for r in rs if r.contender == name]
            if name == "target":
                res[col][name] = agg_target(sel)
            elif name.startswith("dspark"):
                res[col][name] = agg_dspark(sel, seq_share)
            else:
                res[col][name] = {"tokens_per_s": agg_rate(sel)}
            res[col][name]["new_tokens"] = sum(r.new_tokens for r in sel)
            res[col][name]["wall_s"] = sum(r.wall_s for r in sel)

    # a robust column: medians over prompts (ratios: median of the per-prompt ratios, whose
    # contenders ran back to back), little moved by one prompt that another process disturbed
    by = {(r.dataset, r.index, r.contender): r for r in runs}
    keys = [(ds, i) for ds, i, _ in work]
    rate = lambda k, name: by[(*k, name)].new_tokens / by[(*k, name)].wall_s  # noqa: E731
    med = {}
    for name in contenders:
        med[name] = {"tokens_per_s": statistics.median(rate(k, name) for k in keys)}
        if name.startswith("dspark"):
            rs = [by[(*k, name)] for k in keys if by[(*k, name)].stats["cycles"]]
            med[name]["tau"] = statistics.median(r.stats["tau"] for r in rs) if rs else float("nan")
            med[name]["mean_verified"] = (statistics.median(r.stats["verified_sum"] / r.stats["cycles"] for r in rs)
                                          if rs else float("nan"))
    med["target"]["decode_step_ms"] = statistics.median(res["overall"]["target"]["step_ms_per_prompt"])
    med["target"]["new_tokens"] = float("nan")
    res["median/prompt"] = med
    cols.append("median/prompt")

    def ratio(col: str, x: str, y: str) -> float:
        if col == "median/prompt":
            return statistics.median(rate(k, x) / rate(k, y) for k in keys)
        return res[col][x]["tokens_per_s"] / res[col][y]["tokens_per_s"]

    W = 14
    line = lambda label, vals, fmt="{:>14.2f}": print(f"{label:<34}" + "".join(  # noqa: E731
        (fmt.format(v) if isinstance(v, (int, float)) and v == v else f"{'—':>{W}}") for v in vals))
    label_of = {"target": "(a) target alone, ORT", "transformers": "(c) transformers generate",
                "llama.cpp": "(d) llama.cpp, Q4_1 GGUF",
                **{f"dspark-{s}": f"(b) DSpark {s}, ORT" for s in schedulers}}
    n_runs = len(work)
    print()
    print(f"== {args.n_prompts} prompts per dataset ({n_runs} requests per contender), batch 1, greedy, "
          f"max {args.max_new_tokens} new tokens, run interleaved per prompt after one warm-up each ==")
    print("tokens/s = generated tokens / wall time of the request (prefill included); per dataset and overall: "
          "Σ tokens / Σ time;\nmedian/prompt: median over prompts (ratios: median of per-prompt ratios)")
    print(f"{'':<34}" + "".join(f"{c:>{W}}" for c in cols))
    for name in contenders:
        line(label_of[name], [res[c][name]["tokens_per_s"] for c in cols])
    line("  new tokens (a)", [res[c]["target"]["new_tokens"] for c in cols], "{:>14.0f}")
    print("ratios")
    for s in schedulers:
        name = f"dspark-{s}"
        line(f"  DSpark {s} / target alone", [ratio(c, name, "target") for c in cols], "{:>13.3f}x")
        if not args.no_transformers:
            line(f"  DSpark {s} / transformers", [ratio(c, name, "transformers") for c in cols], "{:>13.3f}x")
    if not args.no_transformers:
        line("  target alone / transformers", [ratio(c, "target", "transformers") for c in cols], "{:>13.3f}x")
    if llm is not None:
        for name in contenders[:-1]:
            if name != "transformers":
                line(f"  {label_of[name][4:].replace(', ORT', '')} / llama.cpp",
                     [ratio(c, name, "llama.cpp") for c in cols], "{:>13.3f}x")
    for s in schedulers:
        name = f"dspark-{s}"
        line(f"τ (tokens per cycle), {s}", [res[c][name].get("tau", float("nan")) for c in cols], "{:>14.3f}")
        line(f"mean verified length ℓ, {s}", [res[c][name].get("mean_verified", float("nan")) for c in cols],
             "{:>14.3f}")
    line("target decode step, ms/token (a)", [res[c]["target"]["decode_step_ms"] for c in cols])

    print()
    print("per prompt: new tokens and tokens/s per contender; τ; greedy identity vs (a)")
    hdr = (f"{'prompt':<12}{'ptok':>5}" + "".join(f"{n[:16]:>18}" for n in contenders)
           + f"{'other%':>8}   identity vs (a)")
    print(hdr)
    for ds, i, _ in work:
        cells = []
        for name in contenders:
            r = by[(ds, i, name)]
            extra = f" τ{r.stats['tau']:.2f}" if name.startswith("dspark") else ""
            cells.append(f"{r.new_tokens:>4} {r.new_tokens / r.wall_s:6.1f}{extra}".rjust(18))
        ident = " ".join(f"{e['contender'].replace('dspark-', '')}:{'=' if e['identical'] else 'split@' + str(e['diverged_at'])}"
                         for e in lossless if e["dataset"] == ds and e["index"] == i)
        other = 100 * max(by[(ds, i, name)].other_cpu_share for name in contenders)
        print(f"{ds + '[' + str(i) + ']':<12}{by[(ds, i, 'target')].prompt_tokens:>5}" + "".join(cells)
              + f"{other:>8.0f}   " + ident)
    print("other% = the most CPU that other processes took during any of the prompt's runs (% of the machine)")

    print()
    print("greedy losslessness, (b) vs (a): token ids identical per prompt")
    for s in schedulers:
        es = [e for e in lossless if e["contender"] == f"dspark-{s}"]
        bad = [e for e in es if not e["identical"]]
        print(f"  DSpark {s}: identical on {len(es) - len(bad)}/{len(es)} prompts"
              + "".join(f"\n    {e['dataset']}[{e['index']}]: {e['verdict']}" for e in bad))
    for name, tag in (("transformers", "(c) transformers"), ("llama.cpp", "(d) llama.cpp, Q4_1 arithmetic")):
        es = [e for e in lossless if e["contender"] == name]
        if es:
            print(f"  {tag} vs (a) (informational, different kernels): identical on "
                  f"{sum(e['identical'] for e in es)}/{len(es)} prompts"
                  + "".join(f"; {e['dataset']}[{e['index']}] split@{e['diverged_at']}" for e in es
                            if not e["identical"]))

    print()
    if prof:
        print(f"drafter profile (ORT, fresh session, {prof['calls_profiled']} drafter calls captured from a real "
              f"DSpark run, last of {prof['passes']} passes): kernel {prof['kernel_us_per_call'] / 1e3:.3f} ms/call "
              f"of {prof['model_run_us_per_call'] / 1e3:.3f} ms/run")
        print(f"  sequential stage ({prof['sequential_nodes_in_graph']}/{prof['nodes_in_graph']} nodes, by "
              f"'{SEQ_MARK}' in {HIERARCHY_KEY}): {100 * prof['sequential_share']:.1f} % of the drafter's kernel time "
              f"({prof['sequential_us_per_call'] / 1e3:.3f} ms/call); backbone "
              f"{prof['backbone_us_per_call'] / 1e3:.3f} ms/call; unattributed {100 * prof['unattributed_share']:.2f} %")
        engine_calls = sum(r.ort.get("drafter_calls", 0) for r in runs)
        engine_ms = 1e3 * sum(r.ort.get("drafter", 0.0) for r in runs) / engine_calls if engine_calls else float("nan")
        print(f"  (for scale: the engine's drafter calls in the measured runs took {engine_ms:.3f} ms/call inside ORT)")
        print("  sequential stage's top ops (µs/call): " + ", ".join(
            f"{k} {v:.0f}" for k, v in prof["sequential_top_ops_us_per_call"].items()))
    for s in schedulers:
        d = res["overall"][f"dspark-{s}"]
        if not d.get("cycles"):
            continue
        print(f"DSpark {s}: per-cycle breakdown, mean over {d['cycles']} cycles (ms/cycle; wall from the loop's "
              f"Stats, 'in ORT' = inside session runs)")
        print(f"  {'':<40}{'wall':>9}{'in ORT':>9}{'host':>9}")
        row = lambda lbl, w, o: print(f"  {lbl:<40}{w:>9.3f}" + (f"{o:>9.3f}{w - o:>9.3f}" if o is not None else ""))  # noqa: E731
        row("draft (drafter call)", d["draft_ms"], d["ort_drafter_ms"])
        if seq_share is not None:
            print(f"    {'backbone (1 - share)':<38}{d['draft_backbone_ms']:>9.3f}{d['ort_backbone_ms']:>9.3f}")
            print(f"    {f'sequential stage ({100 * seq_share:.1f} % share)':<38}{d['draft_sequential_ms']:>9.3f}"
                  f"{d['ort_sequential_ms']:>9.3f}")
        row("target (verify, or a step without drafting)", d["verify_ms"], d["ort_verify_ms"])
        row("rest of the loop (sched/accept/commit/detok)", d["rest_ms"], 0.0)
        row("cycle", d["cycle_ms"], d["ort_drafter_ms"] + d["ort_verify_ms"])
        print(f"  host overhead = (cycle wall - time inside ORT runs) / cycle wall = {100 * d['host_share']:.1f} % "
              f"({d['host_ms']:.3f} ms/cycle; issue target < 10 %)")
    t = res["overall"]["target"]
    print(f"(a) target alone: host overhead per decode step = {100 * t['decode_host_share']:.1f} % "
          f"(step {t['decode_step_ms']:.3f} ms, inside ORT {t['ort_ms_per_step']:.3f} ms)")

    print()
    step = t["decode_step_ms"]
    print(f"weight-read floor: target weights = {wb['initializer_bytes'] / 1e6:.1f} MB in {wb['initializers']} "
          f"initializers ({wb['matrix_bytes'] / 1e6:.1f} MB in matrices), fp32")
    best_step = min(t["step_ms_per_prompt"])
    fo, fn = 1e3 * floor_ort["min_s"], 1e3 * floor_np["min_s"]
    print(f"  (1) ORT, {floor_ort['matmuls']} MatMul GEMVs {floor_ort['shape'][0]}x{floor_ort['shape'][1]} · "
          f"{floor_ort['shape'][1]}x{floor_ort['shape'][2]} ({floor_ort['bytes'] / 1e6:.1f} MB, {args.threads} threads, "
          f"distinct random weights): min {fo:.2f} ms ({floor_ort['gbps_best']:.1f} GB/s); medians before/after "
          + " / ".join(f"{1e3 * x:.2f}" for x in floor_ort["median_s_each"]) + " ms")
    print(f"  (2) numpy sum, {floor_np['threads']} threads over {floor_np['threads']} halves: min {fn:.2f} ms "
          f"({floor_np['gbps_best']:.1f} GB/s); medians before/after "
          + " / ".join(f"{1e3 * x:.2f}" for x in floor_np["median_s_each"])
          + f" ms; 1 thread median {1e3 * floor_np['single_thread_median_s']:.2f} ms")
    print(f"  target decode step (mean over all tokens) {step:.2f} ms = {step / fo:.2f}x floor (1), "
          f"{step / fn:.2f}x floor (2)   (issue target: within 1.2x)")
    med_step = med["target"]["decode_step_ms"]
    print(f"  target decode step (median over prompts)  {med_step:.2f} ms = {med_step / fo:.2f}x floor (1), "
          f"{med_step / fn:.2f}x floor (2)")
    print(f"  target decode step (best prompt)          {best_step:.2f} ms = {best_step / fo:.2f}x floor (1), "
          f"{best_step / fn:.2f}x floor (2)")
    print()
    steps = res["overall"]["target"]["step_ms_per_prompt"]
    cv = statistics.pstdev(steps) / statistics.mean(steps) if len(steps) > 1 else 0.0
    print(f"disturbance: other processes used {disturbance['other_cpu_s']:.1f} CPU-s during the "
          f"{disturbance['wall_s']:.0f} s measured loop ({100 * disturbance['other_share_of_capacity']:.1f} % of "
          f"the machine); target decode step across prompts: CV {100 * cv:.1f} % "
          f"(min {min(steps):.2f}, max {max(steps):.2f} ms); load avg at end {disturbance['loadavg_end'][0]:.2f}")
    if disturbance["other_share_of_capacity"] > 0.05 or cv > 0.10:
        print("  WARNING: the CPU was shared or timings varied a lot; figures may be disturbed")

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "env": env, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "bundle": str(bundle), "manifest": {"name": m.name, "drafter_label": m.drafter_label,
                                                "source_hashes": m.source_hashes},
            "results": res, "drafter_profile": prof, "weight_bytes": wb, "floor_ort": floor_ort,
            "floor_numpy": floor_np, "disturbance": disturbance, "lossless": lossless,
            "runs": [r.to_dict() for r in runs]}, indent=1, default=float) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
