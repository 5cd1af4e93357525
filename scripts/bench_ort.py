#!/usr/bin/env python
"""Single-request benchmark on this CPU (issue 21): batch 1, greedy, every contender on the same
prompt token ids, `--threads` each, over the first N prompts of GSM8K and of MT-Bench (first turn),
run interleaved per prompt (every contender on prompt 1, then prompt 2, ...) after one warm-up
of each contender. Contenders:

  <p> alone              the target of each bundle (--bundle, repeatable), decoding alone on its
                         ONNX Runtime engine; <p> is the bundle's precision (fp32, gguf, ...)
  <p> dspark-<s>         DSpark on that engine, for each scheduler of --schedulers (default auto)
  llama.cpp              llama-cpp-python on the GGUF the bundles were exported from, as it is
                         (its own quantized kernels; build it with GGML_NATIVE, see pyproject.toml)
  llama.cpp lookup       the same with llama-cpp-python's prompt-lookup decoding (speculation
                         without a drafter: drafts copied from earlier n-grams of the context)
  genai int4             ONNX Runtime GenAI on an int4 model that its own model builder made from
                         the same weights (`-p int4 -e cpu`, int4_accuracy_level=4), built once
                         into --genai-dir
  transformers           transformers `generate` on the GGUF, dequantized (only with --transformers)

Each contender's top-1 agreement with the fp32 model is printed beside its speed: the share of
its generated tokens that equal the argmax of the fp32 bundle's target, scored teacher-forced
over the contender's own prompt + output in one ONNX Runtime call after the timed runs.

Per bundle it also reports the target-alone decode step (ms per token after prefill), the time
spent inside ONNX Runtime session runs (the backend's `on_run` hook, so host overhead is
measured, not estimated), DSpark's per-cycle breakdown, greedy identity of DSpark with the target
alone, and a weight-read floor: the time to read once the weight bytes a decode step reads, as
(1) an ORT graph of [1,K]x[K,N] MatMul GEMVs over as many bytes and (2) a numpy sum.

With --drafter-profile, the first bundle's drafter is profiled as well: the sequential stage's
share of the drafter's kernel time, from an ONNX Runtime profile of a fresh drafter session fed
the inputs captured from a real DSpark run (nodes attributed by the 'SequentialStage' entry of
their 'pkg.torch.onnx.class_hierarchy' metadata, which the int8 graphs keep from the exported
ones; a control-flow node counts whole, its own overhead included, and the nodes of its branches
are not counted again).

    python scripts/bench_ort.py --bundle engines/smollm2 --bundle engines/smollm2-gguf \\
        --threads 2 --out out/bench_ort.json                     # issue 21: 10 + 10 prompts, 256 tokens
    python scripts/bench_ort.py --n-prompts 1 --max-new-tokens 16  # a smoke run

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
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tqdm import tqdm

from dspark.runtime import Engine
from dspark.runtime.backends import RunEvent
from dspark.runtime.backends.onnxruntime import session_options  # the engine's own: side runs share its threads
from dspark.runtime.cpu import CpuUse
from dspark.runtime.graph_io import PAST, kv_names
from dspark.runtime.schedulers import NAMES as SCHEDULERS
from dspark.runtime.tools.prompts import bench_prompts

ROOT = Path(__file__).resolve().parents[1]
DATASETS = ("gsm8k", "mt-bench")
SEQ_MARK = "SequentialStage"
HIERARCHY_KEY = "pkg.torch.onnx.class_hierarchy"
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni")
GENAI_BUILD = ["-p", "int4", "-e", "cpu", "--extra_options", "int4_accuracy_level=4"]
GENAI, LLAMA, LOOKUP, TRANSFORMERS = "genai int4", "llama.cpp", "llama.cpp lookup", "transformers"


# ---------------------------------------------------------------------------------------------
# environment

def cpu_info() -> tuple[str, set[str]]:
    """The CPU's model name and flags (/proc/cpuinfo)."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return model, flags


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("onnxruntime", "onnxruntime_genai", "llama_cpp", "numpy", "transformers", "torch", "onnx",
                 "tokenizers"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a missing package is reported, not fatal
            out[name] = "not installed"
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
# contenders: each maps (prompt, its token ids, new-token budget) to an Output

@dataclass
class Output:
    token_ids: list[int]  # the generated ids, a final stop token included
    wall_s: float  # the whole request, prefill included
    stats: dict = field(default_factory=dict)  # the loop's Stats (engine contenders)
    ort: dict = field(default_factory=dict)  # seconds inside ORT runs: prefill, target_decode, drafter


Generate = Callable[[str, list[int], int], Output]


@dataclass
class Bundle:
    """One bundle, loaded once, with its own engine and timing hook."""
    label: str  # its precision, or its folder's name when two bundles share one
    path: Path
    engine: Engine
    log: RunLog

    @property
    def precision(self) -> str:
        return self.engine.manifest.precision


@dataclass
class Contender:
    name: str
    generate: Generate
    bundle: Bundle | None = None  # engine contenders
    scheduler: str = ""  # engine contenders: "none" (the target alone) or a DSpark scheduler

    @property
    def dspark(self) -> bool:
        return self.bundle is not None and self.scheduler != "none"


def greedy_until(tokens: Iterable[int], n_new: int, stops: set[int]) -> list[int]:
    """Token ids from an iterator of generated tokens, up to a stop token or n_new of them."""
    new: list[int] = []
    for tok in tokens:
        new.append(int(tok))
        if new[-1] in stops or len(new) >= n_new:
            break
    return new


def engine_contender(bundle: Bundle, scheduler: str, threshold: float) -> Generate:
    def generate(prompt: str, ids: list[int], n_new: int) -> Output:
        log = bundle.log
        log.runs.clear()
        t0 = time.perf_counter()
        res = bundle.engine.generate(prompt, max_new_tokens=n_new, temperature=0.0, scheduler=scheduler,
                                     threshold=threshold)
        wall = time.perf_counter() - t0
        seconds = lambda kind: sum(d for k, _, d in log.runs if k == kind)  # noqa: E731
        count = lambda kind: sum(1 for k, _, _ in log.runs if k == kind)  # noqa: E731
        st = res.stats
        stats = {"times_s": dict(st.times), "cycles": st.cycles, "emitted_sum": int(sum(st.emitted)),
                 "verified_sum": int(sum(st.verified)), "tau": st.tau,
                 "per_position_acceptance": st.per_position_acceptance}
        ort_times = {"prefill": seconds("prefill"), "target_decode": seconds("target"),
                     "drafter": seconds("drafter"), "target_calls": count("target"),
                     "drafter_calls": count("drafter")}
        return Output(list(res.token_ids), wall, stats, ort_times)
    return generate


def llama_contender(gguf: Path, threads: int, n_ctx: int, stops: set[int], lookup_tokens: int = 0) -> Generate:
    """llama-cpp-python, greedy (top-k 1, no repetition penalty); with lookup_tokens, its
    prompt-lookup decoding drafting that many tokens a step."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens) if lookup_tokens else None
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                draft_model=draft, verbose=False)

    def generate(prompt: str, ids: list[int], n_new: int) -> Output:
        t0 = time.perf_counter()
        llm.reset()  # every request from an empty cache, as the other contenders' (no shared-prefix reuse)
        new = greedy_until(llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True),
                           n_new, stops)
        return Output(new, time.perf_counter() - t0)
    return generate


def genai_contender(model_dir: Path, threads: int, stops: set[int]) -> Generate:
    """ONNX Runtime GenAI's Generator, greedy, from our prompt token ids; `threads` intra-op threads."""
    import onnxruntime_genai as og

    config = og.Config(str(model_dir))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)

    def generate(prompt: str, ids: list[int], n_new: int) -> Output:
        t0 = time.perf_counter()
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + n_new, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(np.asarray(ids, np.int32))

        def tokens():
            while not gen.is_done():
                gen.generate_next_token()
                yield gen.get_next_tokens()[0]
        new = greedy_until(tokens(), n_new, stops)
        return Output(new, time.perf_counter() - t0)
    return generate


def transformers_contender(gguf: Path, threads: int, stops: set[int]) -> Generate:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()

    def generate(prompt: str, ids: list[int], n_new: int) -> Output:
        config = GenerationConfig(max_new_tokens=n_new, do_sample=False, num_beams=1, eos_token_id=sorted(stops),
                                  pad_token_id=min(stops))
        x = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=config)
            wall = time.perf_counter() - t0
        return Output(out[0, len(ids):].tolist(), wall)
    return generate


# ---------------------------------------------------------------------------------------------
# ONNX Runtime GenAI's int4 model, built by its own model builder from the GGUF's weights

def gguf_to_hf(gguf: Path, out: Path) -> None:
    """The GGUF as a Hugging Face folder (config, fp32 safetensors, tokenizer): the weights
    transformers dequantizes from it, which is what the model builder reads."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # "gguf": transformers refuses to save such a model
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def ensure_genai_model(model_dir: Path, gguf: Path, digest: str) -> dict:
    """Build the int4 model into model_dir unless it is there; refuse one built from another file."""
    source_file = model_dir / "dspark_source.json"
    if source_file.exists():
        source = json.loads(source_file.read_text())
        if source["gguf_sha256"] != digest:
            raise SystemExit(f"{model_dir} was built from {source['gguf']} (sha256 {source['gguf_sha256'][:16]}…), "
                             f"not from {gguf}: delete it or pass another --genai-dir")
        return source
    print(f"genai     building {model_dir} with the model builder of onnxruntime-genai (once) …", flush=True)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="genai_build_", dir=model_dir.parent) as tmp:
        hf, out = Path(tmp) / "hf", Path(tmp) / "out"
        gguf_to_hf(gguf, hf)
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
               "-c", str(Path(tmp) / "cache"), *GENAI_BUILD]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"the GenAI model builder failed ({shlex.join(cmd)}):\n{done.stdout[-3000:]}"
                             f"{done.stderr[-3000:]}")
        source = {"gguf": str(gguf), "gguf_sha256": digest, "builder": shlex.join(cmd),
                  "onnxruntime_genai": versions()["onnxruntime_genai"],
                  "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        (out / "builder.log").write_text(done.stdout + done.stderr)
        (out / "dspark_source.json").write_text(json.dumps(source, indent=1) + "\n")
        out.rename(model_dir)
    return source


# ---------------------------------------------------------------------------------------------
# scoring against the fp32 target

def top1_agreement(engine: Engine, ids: list[int], new: list[int]) -> int:
    """How many of `new` equal the argmax of `engine`'s target, teacher-forced over ids + new
    (one call: row len(ids) - 1 + i scores new[i])."""
    if not new:
        return 0
    seq = np.asarray(ids + new, np.int64)
    (logits,), _ = engine.backend.target(seq[None], np.zeros(1, np.int64))
    return int((logits[len(ids) - 1:len(seq) - 1].argmax(-1) == np.asarray(new)).sum())


def check_lossless(engine: Engine, ids: list[int], ref: list[int], cand: list[int]) -> dict:
    """Greedy identity of `cand` against the target-alone `ref`; on a split, the reference's
    top-2 logit gap there (from one target pass over prompt + ref) says whether it is a near-tie."""
    if ref == cand:
        return {"identical": True, "diverged_at": None, "gap": None, "verdict": "identical"}
    from dspark.runtime.tools.parity import greedy_match

    seq = np.asarray(ids + ref, np.int64)
    (logits,), _ = engine.backend.target(seq[None], np.zeros(1, np.int64))
    m = greedy_match(ref, cand, logits[len(ids) - 1:len(seq) - 1])  # row n-1+i produced ref[i]
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
    """The target graph's initializer bytes, and those a decode step reads: all but the tensors
    only gathered from (an untied embedding: one row a token)."""
    import onnx

    g = onnx.load(str(bundle / graph), load_external_data=False).graph
    uses: dict[str, set[tuple[str, int]]] = {}
    for node in g.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, set()).add((node.op_type, i))
    total = gathered = 0
    for t in g.initializer:
        b = int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        total += b
        if uses.get(t.name) == {("Gather", 0)}:
            gathered += b
    return {"initializer_bytes": total, "gathered_bytes": gathered, "read_bytes": total - gathered,
            "initializers": len(g.initializer)}


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


@dataclass
class Floors:
    """A bundle's weight-read floors, measured before and after the timed runs (the fastest read
    seen counts)."""
    weights: dict
    ort: list[dict] = field(default_factory=list)
    numpy: list[dict] = field(default_factory=list)

    def measure(self, hidden: int, matmuls: int, threads: int, reps: int) -> None:
        self.ort.append(gemv_floor(self.weights["read_bytes"], hidden, matmuls, threads, reps))
        self.numpy.append(numpy_floor(self.weights["read_bytes"], threads, reps))

    def to_dict(self) -> dict:
        return {"weights": self.weights, "ort": merge_floors(self.ort), "numpy": merge_floors(self.numpy)}


# ---------------------------------------------------------------------------------------------
# aggregation

@dataclass
class Run:
    contender: str
    dataset: str
    index: int
    prompt_tokens: int
    new_tokens: int
    wall_s: float
    finish_reason: str
    token_ids: list[int]
    stats: dict = field(default_factory=dict)
    ort: dict = field(default_factory=dict)
    other_cpu_share: float = 0.0  # share of the machine used by other processes during this run
    top1: int | None = None  # generated tokens equal to the fp32 target's argmax (None: not scored)

    @property
    def rate(self) -> float:
        return self.new_tokens / self.wall_s

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def agg_rate(runs: list[Run]) -> float:
    wall = sum(r.wall_s for r in runs)
    return sum(r.new_tokens for r in runs) / wall if wall else float("nan")


def agg_top1(runs: list[Run]) -> float:
    scored = [r for r in runs if r.top1 is not None]
    n = sum(r.new_tokens for r in scored)
    return sum(r.top1 for r in scored) / n if n else float("nan")


def agg_target(runs: list[Run]) -> dict:
    decode = sum(r.stats["times_s"]["decode"] for r in runs)
    steps = sum(r.new_tokens - 1 for r in runs)
    ort_decode = sum(r.ort["target_decode"] for r in runs)
    return {"decode_step_ms": 1e3 * decode / steps if steps else float("nan"),
            "decode_host_share": (decode - ort_decode) / decode if decode else float("nan"),
            "ort_ms_per_step": 1e3 * ort_decode / steps if steps else float("nan"),
            "step_ms_per_prompt": [1e3 * r.stats["times_s"]["decode"] / max(1, r.new_tokens - 1) for r in runs]}


def agg_dspark(runs: list[Run], seq_share: float | None) -> dict:
    cycles = sum(r.stats["cycles"] for r in runs)
    if not cycles:
        return {"cycles": 0}
    t = lambda key: sum(r.stats["times_s"][key] for r in runs)  # noqa: E731
    loop = t("total") - t("prefill")  # every cycle, back to back
    draft, verify = t("draft"), t("verify") + t("decode")  # decode: steps the scheduler ran without drafting
    ort_d, ort_v = sum(r.ort["drafter"] for r in runs), sum(r.ort["target_decode"] for r in runs)
    per = lambda s: 1e3 * s / cycles  # noqa: E731
    out = {
        "cycles": cycles,
        "tau": sum(r.stats["emitted_sum"] for r in runs) / cycles,
        "mean_verified": sum(r.stats["verified_sum"] for r in runs) / cycles,
        "cycle_ms": per(loop),
        "draft_ms": per(draft), "verify_ms": per(verify), "rest_ms": per(loop - draft - verify),
        "ort_drafter_ms": per(ort_d), "ort_verify_ms": per(ort_v),
        "host_ms": per(loop - ort_d - ort_v),
        "host_share": (loop - ort_d - ort_v) / loop if loop else float("nan"),
    }
    if seq_share is not None:
        out.update({"draft_backbone_ms": (1 - seq_share) * out["draft_ms"],
                    "draft_sequential_ms": seq_share * out["draft_ms"],
                    "ort_backbone_ms": (1 - seq_share) * out["ort_drafter_ms"],
                    "ort_sequential_ms": seq_share * out["ort_drafter_ms"]})
    return out


# ---------------------------------------------------------------------------------------------
# set-up

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, action="append", default=[],
                   help="a bundle; repeat it for several (default engines/smollm2)")
    p.add_argument("--bundles", default="", help="bundles, comma-separated (with --bundle: both)")
    p.add_argument("--gguf", type=Path, default=None, help="the GGUF of llama.cpp, GenAI and transformers "
                   "(default: the default target; its sha256 is checked against the bundles' source hash)")
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data",
                   help="data folder (default ../shared/data relative to the repo root)")
    p.add_argument("--n-prompts", type=int, default=10, help="prompts per dataset (default 10)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per request (default 256)")
    p.add_argument("--schedulers", default="auto",
                   help="DSpark schedulers to run on each bundle, comma-separated (default auto, the runtime's "
                        "default): fixed, threshold, prefix, async, cost, auto; prefix, async and cost need the "
                        "bundle's sps.json and calibration.json, auto falls back to fixed without them")
    p.add_argument("--threshold", type=float, default=0.5, help="confidence threshold of the threshold scheduler")
    p.add_argument("--threads", type=int, default=2, help="threads of every contender (default 2): the ORT global "
                   "intra-op pool, llama.cpp n_threads, GenAI intra-op threads, torch")
    p.add_argument("--max-seq", type=int, default=2048, help="engine KV positions and llama.cpp n_ctx (default 2048)")
    p.add_argument("--genai-dir", type=Path, default=ROOT / "engines" / "genai-int4",
                   help="the GenAI int4 model, built there by its model builder when missing "
                        "(default engines/genai-int4)")
    p.add_argument("--lookup-tokens", type=int, default=10, help="tokens llama.cpp's prompt lookup drafts a step")
    p.add_argument("--no-genai", action="store_true", help="skip ONNX Runtime GenAI int4")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp and its prompt lookup (run when "
                   "llama-cpp-python is installed: CMAKE_ARGS=-DGGML_NATIVE=ON pip install -e '.[llama]')")
    p.add_argument("--transformers", action="store_true", help="add transformers `generate` (slow)")
    p.add_argument("--drafter-profile", action="store_true", help="profile the first bundle's drafter: the "
                   "sequential stage's share of its kernel time")
    p.add_argument("--floor-matmuls", type=int, default=96, help="GEMVs in the ORT weight-read graph (default 96)")
    p.add_argument("--floor-reps", type=int, default=25, help="timed repetitions of each floor measurement")
    p.add_argument("--profile-passes", type=int, default=3, help="passes over the captured drafter calls "
                   "in the profile (all but the last are warm-up)")
    p.add_argument("--out", type=Path, default=None, help="write every figure and per-prompt run to this JSON file")
    args = p.parse_args(argv)
    paths = [*args.bundle, *(Path(s.strip()) for s in args.bundles.split(",") if s.strip())]
    paths = paths or [Path("engines/smollm2")]
    args.bundle = [b if b.is_absolute() or b.exists() else ROOT / b for b in paths]
    args.schedulers = [s.strip() for s in args.schedulers.split(",") if s.strip()]
    for s in args.schedulers:
        if s not in SCHEDULERS or s == "none":
            p.error(f"unknown DSpark scheduler {s!r}; choose from {', '.join(n for n in SCHEDULERS if n != 'none')}")
    return args


def environment(args: argparse.Namespace, argv: list[str] | None) -> dict:
    """The run's date, command, machine and versions, printed as the header."""
    cpu, flags = cpu_info()
    env = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv),
           "cwd": os.getcwd(), "cpu": cpu, "cpu_flags": {f: f in flags for f in CPU_FLAGS}, "cores": os.cpu_count(),
           "affinity": len(os.sched_getaffinity(0)), "platform": platform.platform(),
           "loadavg_start": os.getloadavg(), "versions": versions(), "threads": args.threads}
    print(f"date      {env['date']}")
    print(f"command   {env['command']}   (cwd {env['cwd']})")
    print(f"machine   {cpu}, {env['cores']} cores ({env['affinity']} usable), {env['platform']}")
    print("cpu flags " + ", ".join(f"{f} {'yes' if v else 'NO'}" for f, v in env["cpu_flags"].items()))
    print("versions  " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()))
    print(f"load avg  {env['loadavg_start'][0]:.2f} {env['loadavg_start'][1]:.2f} {env['loadavg_start'][2]:.2f} "
          f"at start; {args.threads} threads for every contender", flush=True)
    return env


def load_bundles(paths: list[Path], max_seq: int, threads: int) -> list[Bundle]:
    bundles = []
    for path in paths:
        engine = Engine.load(path, max_seq=max_seq, threads=threads)
        engine.backend.on_run = log = RunLog()
        bundles.append(Bundle(engine.manifest.precision, path, engine, log))
    labels = [b.label for b in bundles]
    for b in bundles:
        if labels.count(b.label) > 1:
            b.label = b.path.name
    for b in bundles:
        m = b.engine.manifest
        print(f"bundle    {b.label}: {b.path}, target {m.target.arch} {m.target.num_layers} layers "
              f"d={m.target.hidden_size} V={m.target.vocab_size}, precision {m.precision}, drafter "
              f"γ={m.drafter.block_size} {m.drafter.num_layers} layer(s) [{m.drafter_label}]")
    return bundles


def make_contenders(args: argparse.Namespace, bundles: list[Bundle], stops: set[int], env: dict) -> list[Contender]:
    contenders = [Contender(f"{b.label} {'alone' if s == 'none' else 'dspark-' + s}",
                            engine_contender(b, s, args.threshold), b, s)
                  for b in bundles for s in ["none", *args.schedulers]]
    if args.no_llama_cpp and args.no_genai and not args.transformers:
        return contenders
    from dspark.export import default_target_path

    gguf = args.gguf or default_target_path()
    digest = sha256(gguf)
    env.update({"gguf": str(gguf), "gguf_sha256": digest})
    same = [b.label for b in bundles if b.engine.manifest.source_hashes.get("target") == digest]
    print(f"GGUF      {gguf} sha256 {digest[:16]}…, the target source of "
          + (", ".join(same) if same else "NO bundle: not the same model"))
    if not args.no_llama_cpp:
        try:
            import llama_cpp
        except ImportError:
            print("llama.cpp llama-cpp-python is not installed: llama.cpp skipped")
        else:
            env["llama_cpp_system_info"] = llama_cpp.llama_print_system_info().decode().strip()
            print(f"llama.cpp built for: {env['llama_cpp_system_info']}")
            contenders.append(Contender(LLAMA, llama_contender(gguf, args.threads, args.max_seq, stops)))
            contenders.append(Contender(LOOKUP, llama_contender(gguf, args.threads, args.max_seq, stops,
                                                                args.lookup_tokens)))
    if not args.no_genai:
        env["genai_model"] = {"dir": str(args.genai_dir), **ensure_genai_model(args.genai_dir, gguf, digest)}
        print(f"genai     {args.genai_dir}: {env['genai_model']['builder']}")
        contenders.append(Contender(GENAI, genai_contender(args.genai_dir, args.threads, stops)))
    if args.transformers:
        contenders.append(Contender(TRANSFORMERS, transformers_contender(gguf, args.threads, stops)))
    return contenders


# ---------------------------------------------------------------------------------------------
# measurement

def measure(contenders: list[Contender], work: list[tuple[str, int, str]], ids: dict[tuple[str, int], list[int]],
            n_new: int, stops: set[int]) -> list[Run]:
    """The timed runs, interleaved per prompt: every contender on prompt 1, then on prompt 2, ..."""
    runs: list[Run] = []
    with tqdm(total=len(work) * len(contenders), desc="bench", file=sys.stderr, unit="run") as bar:
        for ds, i, prompt in work:
            x = ids[(ds, i)]
            for c in contenders:
                bar.set_postfix_str(f"{ds}[{i}] {c.name}")
                watch = CpuUse()
                out = c.generate(prompt, x, n_new)
                finish = "stop" if out.token_ids and out.token_ids[-1] in stops else "length"
                runs.append(Run(c.name, ds, i, len(x), len(out.token_ids), out.wall_s, finish, out.token_ids,
                                out.stats, out.ort, watch.other_share()))
                bar.update()
    return runs


def aggregate(contenders: list[Contender], runs: list[Run], seq_share: float | None) -> dict:
    """Per dataset and overall, per contender: Σ tokens / Σ time, top-1 agreement, and the
    target-alone or DSpark figures."""
    groups = {**{ds: [r for r in runs if r.dataset == ds] for ds in DATASETS}, "overall": runs}
    res: dict = {}
    for col, rs in groups.items():
        res[col] = {}
        for c in contenders:
            sel = [r for r in rs if r.contender == c.name]
            res[col][c.name] = {"tokens_per_s": agg_rate(sel), "top1": agg_top1(sel),
                                "new_tokens": sum(r.new_tokens for r in sel), "wall_s": sum(r.wall_s for r in sel),
                                **(agg_target(sel) if c.scheduler == "none" else {}),
                                **(agg_dspark(sel, seq_share) if c.dspark else {})}
    return res


# ---------------------------------------------------------------------------------------------
# report

def fmt(v: float | None, spec: str, width: int) -> str:
    return f"{v:{spec}}".rjust(width) if v is not None and v == v else "—".rjust(width)


def print_summary(contenders: list[Contender], res: dict, ratio: Callable[[str, str, str], float],
                  cols: list[str], head: str) -> None:
    print()
    print(head)
    print("tok/s = generated tokens / wall time of the request (prefill included), Σ tokens / Σ time;\n"
          "top-1 = share of the generated tokens that equal the fp32 target's argmax after the same tokens;\n"
          "median/prompt = median over prompts (ratios: median of the per-prompt ratios)")
    print(f"{'':<22}" + "".join(f"{c:>17}" for c in cols[:-1]) + f"{cols[-1]:>15}")
    print(f"{'contender':<22}" + f"{'tok/s':>9}{'top-1':>8}" * (len(cols) - 1) + f"{'tok/s':>15}")
    for c in contenders:
        cells = [fmt(res[col][c.name][key], spec, w) for col in cols[:-1]
                 for key, spec, w in (("tokens_per_s", ".2f", 9), ("top1", ".4f", 8))]
        print(f"{c.name:<22}" + "".join(cells) + fmt(res[cols[-1]][c.name]["tokens_per_s"], ".2f", 15))
    names = {c.name for c in contenders}
    lines = []
    for c in contenders:
        if c.dspark:
            others = [f"{c.bundle.label} alone", GENAI, LLAMA, LOOKUP]
            lines += [(f"{c.name} / {o}", c.name, o) for o in others if o in names]
    if lines:
        print("ratios of tok/s" + " " * 27 + "".join(f"{col:>14}" for col in cols))
        for label, x, y in lines:
            print(f"  {label:<40}" + "".join(fmt(ratio(col, x, y), ".3f", 13) + "x" for col in cols))


def print_bundle(b: Bundle, contenders: list[Contender], res: dict, floors: dict, lossless: list[dict],
                 seq_share: float | None, threads: int) -> None:
    alone = res["overall"][f"{b.label} alone"]
    steps = alone["step_ms_per_prompt"]
    step, med_step, best_step = alone["decode_step_ms"], statistics.median(steps), min(steps)
    w, fo, fn = floors["weights"], floors["ort"], floors["numpy"]
    print()
    print(f"{b.label}: {b.path} ({b.engine.manifest.graphs['target_ort']})")
    print(f"  target alone: decode step {step:.2f} ms/token (median over prompts {med_step:.2f}, "
          f"best {best_step:.2f}); inside ORT {alone['ort_ms_per_step']:.2f} ms, "
          f"host {100 * alone['decode_host_share']:.1f} %")
    print(f"  weights: {w['initializer_bytes'] / 1e6:.1f} MB in {w['initializers']} initializers; a decode step reads "
          f"{w['read_bytes'] / 1e6:.1f} MB of them (the rest, {w['gathered_bytes'] / 1e6:.1f} MB, only gathered from: "
          f"one row a token)")
    print(f"  read them once: (1) ORT, {fo['matmuls']} MatMul GEMVs {fo['shape'][0]}x{fo['shape'][1]} · "
          f"{fo['shape'][1]}x{fo['shape'][2]}, {threads} threads: min {1e3 * fo['min_s']:.2f} ms "
          f"({fo['gbps_best']:.1f} GB/s), medians before/after "
          + " / ".join(f"{1e3 * x:.2f}" for x in fo["median_s_each"]) + " ms")
    print(f"                  (2) numpy sum, {fn['threads']} threads: min {1e3 * fn['min_s']:.2f} ms "
          f"({fn['gbps_best']:.1f} GB/s), medians before/after "
          + " / ".join(f"{1e3 * x:.2f}" for x in fn["median_s_each"])
          + f" ms; 1 thread median {1e3 * fn['single_thread_median_s']:.2f} ms")
    over = lambda ms: f"{ms / (1e3 * fo['min_s']):.2f}x, {ms / (1e3 * fn['min_s']):.2f}x"  # noqa: E731
    print(f"  decode step / floor (1), (2): mean {over(step)}; median {over(med_step)}; best {over(best_step)} "
          f"(issue target: within 1.2x)")
    for c in contenders:
        if c.bundle is not b or not c.dspark:
            continue
        d = res["overall"][c.name]
        es = [e for e in lossless if e["contender"] == c.name]
        bad = [e for e in es if not e["identical"]]
        print(f"  {c.name}: greedy output identical to the target alone on {len(es) - len(bad)}/{len(es)} prompts"
              + "".join(f"\n    {e['dataset']}[{e['index']}]: {e['verdict']}" for e in bad))
        if not d.get("cycles"):
            continue
        print(f"    τ {d['tau']:.3f} tokens per cycle, mean verified length ℓ {d['mean_verified']:.3f}; "
              f"per cycle, mean over {d['cycles']} (ms; wall from the loop's Stats, 'in ORT' = inside session runs)")
        print(f"    {'':<44}{'wall':>9}{'in ORT':>9}{'host':>9}")
        row = lambda lbl, wall, o: print(f"    {lbl:<44}{wall:>9.3f}"  # noqa: E731
                                         + (f"{o:>9.3f}{wall - o:>9.3f}" if o is not None else ""))
        row("draft (drafter call)", d["draft_ms"], d["ort_drafter_ms"])
        if seq_share is not None and "draft_backbone_ms" in d:
            row("  backbone (1 - share)", d["draft_backbone_ms"], d["ort_backbone_ms"])
            row(f"  sequential stage ({100 * seq_share:.1f} % share)", d["draft_sequential_ms"], d["ort_sequential_ms"])
        row("target (verify, or a step without drafting)", d["verify_ms"], d["ort_verify_ms"])
        row("rest of the loop (sched/accept/commit/detok)", d["rest_ms"], None)
        row("cycle", d["cycle_ms"], d["ort_drafter_ms"] + d["ort_verify_ms"])
        print(f"    host overhead = (cycle wall - time inside ORT runs) / cycle wall = {100 * d['host_share']:.1f} % "
              f"(issue target < 10 %)")


def print_profile(prof: dict, runs: list[Run]) -> None:
    print()
    print(f"drafter profile (ORT, fresh session, {prof['calls_profiled']} drafter calls captured from a real "
          f"DSpark run, last of {prof['passes']} passes): kernel {prof['kernel_us_per_call'] / 1e3:.3f} ms/call "
          f"of {prof['model_run_us_per_call'] / 1e3:.3f} ms/run")
    print(f"  sequential stage ({prof['sequential_nodes_in_graph']}/{prof['nodes_in_graph']} nodes, by "
          f"'{SEQ_MARK}' in {HIERARCHY_KEY}): {100 * prof['sequential_share']:.1f} % of the drafter's kernel time "
          f"({prof['sequential_us_per_call'] / 1e3:.3f} ms/call); backbone "
          f"{prof['backbone_us_per_call'] / 1e3:.3f} ms/call; unattributed {100 * prof['unattributed_share']:.2f} %")
    calls = sum(r.ort.get("drafter_calls", 0) for r in runs)
    ms = 1e3 * sum(r.ort.get("drafter", 0.0) for r in runs) / calls if calls else float("nan")
    print(f"  (for scale: the engine's drafter calls in the measured runs of that bundle took {ms:.3f} ms/call "
          f"inside ORT)")
    print("  sequential stage's top ops (µs/call): " + ", ".join(
        f"{k} {v:.0f}" for k, v in prof["sequential_top_ops_us_per_call"].items()))


def print_per_prompt(contenders: list[Contender], by: dict, work: list[tuple[str, int, str]]) -> None:
    print()
    print("per prompt: new tokens and tok/s per contender (DSpark: and τ)")
    print(f"{'prompt':<12}{'ptok':>5}" + "".join(f"{c.name[:17]:>19}" for c in contenders) + f"{'other%':>8}")
    for ds, i, _ in work:
        cells = []
        for c in contenders:
            r = by[(ds, i, c.name)]
            extra = f" τ{r.stats['tau']:.2f}" if c.dspark else ""
            cells.append(f"{r.new_tokens:>4} {r.rate:6.1f}{extra}".rjust(19))
        other = 100 * max(by[(ds, i, c.name)].other_cpu_share for c in contenders)
        print(f"{ds + '[' + str(i) + ']':<12}{by[(ds, i, contenders[0].name)].prompt_tokens:>5}" + "".join(cells)
              + f"{other:>8.0f}")
    print("other% = the most CPU that other processes took during any of the prompt's runs (% of the machine)")


def print_issue_targets(contenders: list[Contender], ratio: Callable[[str, str, str], float],
                        median_ratio: Callable[[list[tuple[str, int]], str, str], float],
                        keys: list[tuple[str, int]]) -> None:
    names = {c.name for c in contenders}
    checks = [(c.name, other, bound) for c in contenders if c.scheduler == "auto"
              for other, bound in ((GENAI, 1.3), (LLAMA, 1.6)) if other in names]
    if not checks:
        return
    print()
    print("issue 21 on GSM8K: DSpark on the default engine ≥ 1.3x ONNX Runtime GenAI int4 and ≥ 1.6x llama.cpp "
          "(Σ tokens / Σ time; median of per-prompt ratios in brackets)")
    for x, y, bound in checks:
        r, m = ratio("gsm8k", x, y), median_ratio([k for k in keys if k[0] == "gsm8k"], x, y)
        print(f"  {x} / {y}: {r:.3f}x ({m:.3f}x), target {bound}x: {'met' if r >= bound else 'NOT met'}")


# ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = environment(args, argv)
    bundles = load_bundles(args.bundle, args.max_seq, args.threads)
    reference = next((b for b in bundles if b.precision == "fp32"), None)  # scores top-1 agreement
    first = bundles[0].engine
    stops = set(first.manifest.stop_token_ids)
    prompts = {ds: bench_prompts(ds, args.n_prompts + 1, data_dir=args.data_dir / "bench") for ds in DATASETS}
    work = [(ds, i, prompts[ds][i]) for ds in DATASETS for i in range(args.n_prompts)]
    ids = {(ds, i): first.encode(prompt) for ds, i, prompt in work}
    for b in bundles[1:]:  # every contender gets the same token ids
        if any(b.engine.encode(prompt) != ids[(ds, i)] for ds, i, prompt in work):
            raise SystemExit(f"{b.path} tokenizes the prompts differently from {bundles[0].path}")
    contenders = make_contenders(args, bundles, stops, env)

    # warm-up, one of each, on a prompt outside the measured set; capture the drafter's inputs
    warm = prompts["gsm8k"][args.n_prompts] if len(prompts["gsm8k"]) > args.n_prompts else prompts["gsm8k"][0]
    log0 = bundles[0].log
    for c in tqdm(contenders, desc="warm-up", file=sys.stderr, leave=False):
        log0.capture = args.drafter_profile and c.dspark and c.bundle is bundles[0] and not log0.captured
        c.generate(warm, first.encode(warm), min(64, args.max_new_tokens))
    log0.capture = False
    drafter_graph = log0.captured[0][0] if log0.captured else None  # the graph greedy rows run
    captured = [inputs for graph, inputs in log0.captured if graph == drafter_graph]
    drafter_past = dict(zip(kv_names(PAST, len(first.backend.draft_kv.keys)),
                            (a.copy() for a in first.backend.draft_kv.arrays))) if captured else {}

    print("measuring: weight-read floors (before) …", file=sys.stderr, flush=True)
    floors = {b.label: Floors(weight_bytes(b.path, b.engine.manifest.graphs["target_ort"])) for b in bundles}

    def measure_floors() -> None:
        for b in bundles:
            floors[b.label].measure(b.engine.manifest.target.hidden_size, args.floor_matmuls, args.threads,
                                    args.floor_reps)
    measure_floors()

    cpu = CpuUse()
    runs = measure(contenders, work, ids, args.max_new_tokens, stops)
    disturbance = cpu.report()
    by = {(r.dataset, r.index, r.contender): r for r in runs}

    print("measuring: weight-read floors (after), drafter profile; scoring …", file=sys.stderr, flush=True)
    measure_floors()
    prof = profile_drafter(bundles[0].path, drafter_graph, args.threads, captured, drafter_past,
                           args.profile_passes) if captured else None
    lossless = [{"dataset": ds, "index": i, "contender": c.name,
                 **check_lossless(c.bundle.engine, ids[(ds, i)], by[(ds, i, f"{c.bundle.label} alone")].token_ids,
                                  by[(ds, i, c.name)].token_ids)}
                for ds, i, _ in work for c in contenders if c.dspark]
    if reference is not None:
        for r in tqdm(runs, desc="top-1 vs fp32", file=sys.stderr, leave=False):
            r.top1 = top1_agreement(reference.engine, ids[(r.dataset, r.index)], r.token_ids)

    # ---- aggregate and print ------------------------------------------------------------------
    seq_share = prof["sequential_share"] if prof else None
    keys = [(ds, i) for ds, i, _ in work]
    cols = [*DATASETS, "overall", "median/prompt"]
    res = aggregate(contenders, runs, seq_share)
    res["median/prompt"] = {c.name: {"tokens_per_s": statistics.median(by[(*k, c.name)].rate for k in keys)}
                            for c in contenders}

    def median_ratio(ks: list[tuple[str, int]], x: str, y: str) -> float:
        return statistics.median(by[(*k, x)].rate / by[(*k, y)].rate for k in ks)

    def ratio(col: str, x: str, y: str) -> float:
        if col == "median/prompt":
            return median_ratio(keys, x, y)
        return res[col][x]["tokens_per_s"] / res[col][y]["tokens_per_s"]

    head = (f"== {args.n_prompts} prompts per dataset ({len(work)} requests per contender), batch 1, greedy, "
            f"max {args.max_new_tokens} new tokens, {args.threads} threads each, interleaved per prompt after one "
            f"warm-up each ==")
    print_summary(contenders, res, ratio, cols, head)
    if reference is None:
        print("top-1: not scored, no fp32 bundle among --bundle")
    for b in bundles:
        print_bundle(b, contenders, res, floors[b.label].to_dict(), lossless, seq_share if b is bundles[0] else None,
                     args.threads)
    if prof:
        print_profile(prof, [r for r in runs if any(c.name == r.contender and c.bundle is bundles[0]
                                                     for c in contenders)])
    print_per_prompt(contenders, by, work)
    print_issue_targets(contenders, ratio, median_ratio, keys)

    cv = max(statistics.pstdev(s) / statistics.mean(s) if len(s) > 1 else 0.0
             for s in (res["overall"][f"{b.label} alone"]["step_ms_per_prompt"] for b in bundles))
    print()
    print(f"disturbance: other processes used {disturbance['other_cpu_s']:.1f} CPU-s during the "
          f"{disturbance['wall_s']:.0f} s measured loop ({100 * disturbance['other_share_of_capacity']:.1f} % of "
          f"the machine); target decode step across prompts: CV {100 * cv:.1f} % (the most varied bundle); "
          f"load avg at end {disturbance['loadavg_end'][0]:.2f}")
    if disturbance["other_share_of_capacity"] > 0.05 or cv > 0.10:
        print("  WARNING: the CPU was shared or timings varied a lot; figures may be disturbed")

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "env": env, "args": {k: [str(x) for x in v] if k == "bundle" else str(v) if isinstance(v, Path) else v
                                 for k, v in vars(args).items()},
            "bundles": [{"label": b.label, "path": str(b.path), "name": b.engine.manifest.name,
                         "precision": b.precision, "drafter_label": b.engine.manifest.drafter_label,
                         "source_hashes": b.engine.manifest.source_hashes, **floors[b.label].to_dict()}
                        for b in bundles],
            "top1_reference": None if reference is None else str(reference.path),
            "results": res, "drafter_profile": prof, "disturbance": disturbance, "lossless": lossless,
            "runs": [r.to_dict() for r in runs]}, indent=1, default=float) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
