"""ONNX Runtime backend: runs the bundle's target and drafter graphs on KV buffers
preallocated at load time, through IOBinding (the caches are bound once, zero-copy)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..errors import BackendError, BundleError, InputError
from ..graph_io import CTX, NEW, PAST, PRESENT, DrafterInputs, TargetInputs, TargetOrtInputs, kv_names
from ..kv import KVBuffers, row_mask
from ..manifest import Manifest
from .base import Draft, RunEvent, RunHook, StepBatch, Verdict, verify_on_host

# Rows at temperature > 0: the int8 drafter graph drafts one call per busy row (see
# `OrtBackend.draft`), the fp32 graph one call for all rows; `drafter_graph="auto"` takes int8 up to
# this many slots and fp32 above, where one batched fp32 call costs less than int8 row by row
# (docs/results.md has the profile it was chosen from). Calls whose rows are all greedy take
# neither: they run the greedy-only int8 graph over every row in one call.
INT8_MAX_SLOTS = 2


MIN_ORT = "1.32"  # bundles are ONNX IR version 14 (onnx 1.23), read from onnxruntime 1.32 on (pyproject.toml)
KEY_ALIGN = 16  # key_count is rounded up to this: no vector loop over the keys has a tail (AVX-512: 16 lanes)


def key_count(needed: int, max_seq: int) -> int:
    """Cache positions the ONNX Runtime target's attention reads for a call that ends at `needed`:
    rounded up to KEY_ALIGN (masked keys add exact zeros; docs/quantization.md), at most max_seq."""
    return min(-(-needed // KEY_ALIGN) * KEY_ALIGN, max_seq)


QDQ_ACCURACY_LEVEL = 4  # MatMulNBits' int8-activation kernel (docs/quantization.md)


def session_options(threads: int | None) -> ort.SessionOptions:
    """The target and drafter run one after the other, never at once. Two per-session pools
    would spin against each other on a small machine (docs/results.md), so every session of the
    process uses ONNX Runtime's global intra-op pool, sized by the first engine loaded (`threads`,
    default: every core); later sizes are ignored."""
    try:
        ort.capi._pybind_state.set_global_thread_pool_sizes(threads or os.cpu_count() or 1, 1)
    except ort.capi.onnxruntime_pybind11_state.Fail:  # the pool exists: share it
        pass
    so = ort.SessionOptions()
    so.use_per_session_threads = False
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # a quantized target's DequantizeLinear → MatMul becomes MatMulNBits with int8 activations
    # per block (export/ort_graph.block_matmul): the fast kernel that keeps rows apart
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(QDQ_ACCURACY_LEVEL))
    return so


def open_session(path: Path, threads: int | None, providers: list) -> ort.InferenceSession:
    """An ONNX Runtime session over a bundle graph, or a BundleError that says what to do."""
    if not path.exists():
        raise BundleError(f"bundle graph {path} is missing; re-run `dspark export`")
    try:
        return ort.InferenceSession(str(path), session_options(threads), providers=providers)
    except Exception as e:  # onnxruntime raises its own types for corrupt files
        if "Unsupported model IR version" in str(e) or "opset" in str(e).lower():
            raise BundleError(f"cannot load {path}: it was written for a newer ONNX Runtime than this one "
                              f"(onnxruntime {ort.__version__}): {e}; upgrade it: pip install "
                              f"'onnxruntime>={MIN_ORT}'") from e
        raise BundleError(f"cannot load {path} (or the weights it names in the bundle's weights.bin): {e}; "
                          f"the bundle is damaged: export it again with `dspark export`") from e


class _Graph:
    """One ONNX Runtime session over KV buffers. Each run covers a contiguous range of slots
    [lo, hi), whose buffer slices are bound once (cached per range). Graphs that write the
    cache in place (present_* outputs) get those outputs bound to the same memory."""

    def __init__(self, path: Path, threads: int | None, kv: KVBuffers, past_names: list[str],
                 expect: dict[str, dict[int, int]]):
        self.path = path
        self.session = open_session(path, threads, ["CPUExecutionProvider"])
        self._check_shapes(path, kv, expect)
        self.kv, self.past_names = kv, past_names
        self.names = [o.name for o in self.session.get_outputs()]
        self.outputs = [n for n in self.names if not n.startswith(PRESENT)]  # fetched each run
        self.bindings: dict[tuple[int, int], ort.IOBinding] = {}

    def _check_shapes(self, path: Path, kv: KVBuffers, expect: dict[str, dict[int, int]]) -> None:
        """The graph must be the model the manifest describes: same number of layers, same
        inputs, and the static sizes in `expect` ({input or output name: {axis: size}})."""
        io = {t.name: t.shape for t in [*self.session.get_inputs(), *self.session.get_outputs()]}
        graph_layers = sum(1 for n in io if n.startswith(f"{PAST}_key_"))
        if graph_layers != len(kv.keys):
            raise BundleError(f"{path} has {graph_layers} layers of KV inputs, the manifest says {len(kv.keys)}: "
                              f"the graph belongs to another model; re-export the bundle")
        for name, axes in expect.items():
            shape = io.get(name)
            if shape is None:
                raise BundleError(f"{path} has no input or output {name!r}: it was exported by another exporter "
                                  f"version; re-export the bundle")
            for axis, size in axes.items():
                if shape[axis] != size:
                    raise BundleError(f"{path}: {name} has shape {shape}, the manifest implies size {size} on axis "
                                      f"{axis}: the graph belongs to another model; re-export the bundle")

    def _binding(self, lo: int, hi: int) -> ort.IOBinding:
        if (lo, hi) not in self.bindings:
            binding = self.session.io_binding()
            for name in self.outputs:  # bound first, so they come first in get_outputs()
                binding.bind_output(name, "cpu")
            for name, buf in zip(self.past_names, self.kv.arrays):
                value = ort.OrtValue.ortvalue_from_numpy(buf[lo:hi])  # a view: no copy on CPU
                binding.bind_ortvalue_input(name, value)
                present = name.replace(PAST, PRESENT, 1)
                if present in self.names:
                    binding.bind_ortvalue_output(present, value)
            self.bindings[lo, hi] = binding
        return self.bindings[lo, hi]

    def run(self, lo: int, hi: int, kind: str, hook: RunHook | None,
            feeds: TargetInputs | TargetOrtInputs | DrafterInputs) -> dict[str, np.ndarray]:
        """One session run over slots [lo, hi); `hook` (if any) gets its RunEvent of `kind`."""
        inputs = feeds._asdict()
        binding = self._binding(lo, hi)
        for name, value in inputs.items():
            binding.bind_cpu_input(name, value)
        for name in self.outputs:
            binding.bind_output(name, "cpu")
        t0 = time.perf_counter()
        self.session.run_with_iobinding(binding)
        if hook is not None:
            hook(RunEvent(kind, self.path.name, time.perf_counter() - t0, inputs))
        return dict(zip(self.outputs, (v.numpy() for v in binding.get_outputs()[:len(self.outputs)])))


class OrtBackend:
    """A `Backend` (backends/base.py) over a bundle's ONNX graphs, `slots` requests at once."""

    accepts_on_device = False  # the acceptance rule runs on the host (sampling.accept over numpy)
    supports_prefix = True  # prefill() from any start: chunked prefill and prefix reuse (backends/base.py)

    def __init__(self, bundle: Path, manifest: Manifest, max_seq: int, threads: int | None = None,
                 speculative: bool = True, target_graph: str = "auto", drafter_graph: str = "auto", slots: int = 1):
        """On ONNX Runtime's CPU provider (its CUDA provider: ort_cuda.py, buffers on the GPU).
        target_graph: "ort" = the ONNX Runtime variant (fused contrib ops, cache written in
        place), "portable" = the standard-op graph TensorRT also reads, "auto" = "ort" when the
        bundle has it. drafter_graph: "int8" = matmuls dynamically
        quantized (cheaper on CPU, docs/results.md; only the proposals change, never the output
        distribution), "fp32" = the exported graph, "auto" = int8 when
        the bundle has it and `slots` <= INT8_MAX_SLOTS (past that, one batched fp32 call is
        cheaper than int8 row by row). That choice is per engine, never per step, so a sampled
        request's proposals do not depend on how many others are in the batch. With int8 or
        auto, a call whose rows are all greedy runs the greedy-only int8 graph
        (`drafter_ort_greedy`) over every row at once: its proposals then depend on the batch
        (one activation scale per call), its output does not (at T = 0 the output is the
        target's argmax whatever was proposed)."""
        if target_graph not in ("auto", "ort", "portable"):
            raise InputError(f"unknown target graph {target_graph!r}; choose auto, ort or portable")
        if drafter_graph not in ("auto", "int8", "fp32"):
            raise InputError(f"unknown drafter graph {drafter_graph!r}; choose auto, int8 or fp32")
        if drafter_graph == "int8" and "drafter_ort" not in manifest.graphs:
            raise BundleError(f"bundle {bundle} has no int8 drafter graph (drafter_ort); re-run `dspark export`")
        if target_graph == "ort" and "target_ort" not in manifest.graphs:
            raise BundleError(f"bundle {bundle} has no ONNX Runtime target graph (target_ort); re-run `dspark export`")
        if slots < 1:
            raise InputError(f"slots is {slots}, expected >= 1 (requests served at once)")
        self.on_run: RunHook | None = None
        self.in_place = "target_ort" in manifest.graphs and (
            target_graph in ("ort", "auto"))
        if manifest.precision != "fp32" and not self.in_place:
            # the portable graph holds the fp32 reference of the quantized weights, another arithmetic
            raise BackendError(f"bundle {bundle} has a {manifest.precision} target, which only its ONNX Runtime graph "
                               f"runs (target_ort); use target graph auto or ort, or export with "
                               f"--precision fp32")
        if not self.in_place and "target" not in manifest.graphs:
            raise BundleError(f"bundle {bundle} has no portable target graph (target.onnx), which "
                              f"--target-graph portable runs; export the bundle with `dspark export --portable`")
        t, d = manifest.target, manifest.drafter
        L = t.num_layers
        self.block_size = d.block_size if speculative else 0
        self.vocab_size = t.vocab_size
        self.max_seq = max_seq
        self.slots = slots
        self.target_kv = KVBuffers(L, slots, t.num_kv_heads, max_seq, t.head_dim)
        names = kv_names(PAST, L)
        expect = {names[0]: {1: t.num_kv_heads, 3: t.head_dim}, "logits": {2: t.vocab_size},
                  "features": {2: d.feature_dim}}  # outputs of either target graph
        graph = manifest.graphs["target_ort" if self.in_place else "target"]
        self._target = _Graph(bundle / graph, threads, self.target_kv, names, expect)
        # A call of one row (B·S = 1, or one logits row) can take kernels of their own that round
        # differently (MLAS's M = 1 GEMV; MatMulNBits' M = 1 int8 kernel on AVX2), which would
        # make decoding alone differ from verifying. Where this machine's kernels do, a lone
        # row is padded to two (docs/quantization.md); the other graphs' ops are row-invariant.
        self.min_rows = 1  # the probe itself runs unpadded
        self.min_rows = 1 if self._lone_row_exact() else 2
        self._drafter = self._drafter_greedy = None
        self.drafter_int8 = False
        if speculative:
            self.draft_kv = KVBuffers(d.num_layers, slots, d.num_kv_heads, max_seq, d.head_dim)
            names = kv_names(PAST, d.num_layers)
            self.drafter_int8 = "drafter_ort" in manifest.graphs and (
                drafter_graph == "int8" or (drafter_graph == "auto" and slots <= INT8_MAX_SLOTS))
            drafter = "drafter_ort" if self.drafter_int8 else "drafter"
            expect = {names[0]: {1: d.num_kv_heads, 3: d.head_dim}, "features": {2: d.feature_dim}, "ctx_mask": {}}
            self._drafter = _Graph(bundle / manifest.graphs[drafter], threads,
                                   self.draft_kv, names, {**expect, "draft_probs": {2: d.vocab_size}})
            # the int8 graph without the `If` and without one-hot outputs, for calls at T = 0
            # (older bundles lack it and run drafter_ort for every row)
            if "drafter_ort_greedy" in manifest.graphs and drafter_graph in ("int8", "auto"):
                self._drafter_greedy = _Graph(bundle / manifest.graphs["drafter_ort_greedy"], threads, self.draft_kv,
                                              names, expect)
        # the SPS table's drafter cost of what greedy rows run (what `dspark profile` measures)
        self.drafter_graph = "int8-greedy" if self._drafter_greedy else "int8" if self.drafter_int8 else "fp32"

    def _greedy_call(self, temperatures: np.ndarray) -> bool:
        return self._drafter_greedy is not None and not np.any(temperatures)

    def prefill(self, slot: int, tokens: np.ndarray, ingest: bool, start: int = 0,
                last: bool = True) -> tuple[np.ndarray, np.ndarray]:
        m = len(tokens)
        begin = np.array([start], np.int64)  # [1]
        # a one-row call after a past of `start` rows, as a batch-1 verification: either target graph
        logits, features = self._run_target(slot, np.asarray(tokens, np.int64)[None], begin,
                                            np.array([[m - 1]], np.int64), "prefill")  # [1, 1, V], [1, m, F]
        if not ingest:
            return logits[0, 0], features[0]
        fed = m - 1 if last else m  # the prompt's last row comes with the first drafting round
        if fed:  # context rows start..start+fed-1 (a row's K/V depend only on its features and position);
            zero = np.zeros(1, np.int64)  # the block drafted here is discarded
            self._run_draft(slot, features[:, :fed], np.array([fed]), begin, zero, zero,
                            np.zeros(1, np.float32), np.zeros((1, self.block_size)), kind="prefill")
        return logits[0, 0], features[0, fed:]

    def target(self, tokens: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        B, S = tokens.shape
        return self._run_target(0, tokens, starts, np.tile(np.arange(S, dtype=np.int64), (B, 1)), "target")

    def verify(self, batch: StepBatch, draft: Draft) -> Verdict:
        return verify_on_host(self, batch, draft)

    def _lone_row_exact(self) -> bool:
        """Whether one row scored alone gets the bits it gets beside a second row (a probe on
        slot 0 at load: the kernels a shape takes are fixed per machine, not per input)."""
        ids = np.random.default_rng(0).integers(0, self.vocab_size, (1, 6))  # [1, 6]
        self._run_target(0, ids[:, :4], np.zeros(1, np.int64), np.array([[3, 3]]), "probe")
        one = self._run_target(0, ids[:, 4:5], np.array([4]), np.array([[0]]), "probe")
        two = self._run_target(0, ids[:, 4:6], np.array([4]), np.array([[0, 1]]), "probe")
        return all(np.array_equal(a[0, 0], b[0, 0]) for a, b in zip(one, two))

    def _run_target(self, lo: int, tokens: np.ndarray, starts: np.ndarray, logit_index: np.ndarray,
                    kind: str) -> tuple[np.ndarray, np.ndarray]:
        """tokens [B, S] for slots lo..lo+B-1 -> logits [B, K, V] of the rows logit_index [B, K], features [B, S, F].
        Fewer than `min_rows` rows are padded (a copy of the last token, written one position past
        the call: a row the loop overwrites before it is read)."""
        B, S = tokens.shape
        K = logit_index.shape[1]
        if B * S < self.min_rows:
            tokens = np.concatenate([tokens, tokens[:, -1:]], axis=1)  # [B, S + 1]
        if B * K < self.min_rows:
            logit_index = np.concatenate([logit_index, logit_index], axis=1)  # [B, 2K]
        logits, features = self._call_target(lo, tokens, starts, logit_index, kind)
        return logits[:, :K], features[:, :S]

    def _call_target(self, lo: int, tokens: np.ndarray, starts: np.ndarray, logit_index: np.ndarray,
                     kind: str) -> tuple[np.ndarray, np.ndarray]:
        B, S = tokens.shape
        if self.in_place:  # writes K/V rows start..start+S-1 of each slot in place
            out = self._target.run(lo, lo + B, kind, self.on_run, TargetOrtInputs(
                input_ids=tokens, logit_index=logit_index, starts=starts.astype(np.int64),
                key_count=np.array([key_count(int(starts.max()) + S, self.max_seq)], np.int64),
            ))
            return out["logits"], out["features"]
        out = self._target.run(lo, lo + B, kind, self.on_run, TargetInputs(
            input_ids=tokens, logit_index=logit_index,
            positions=starts[:, None] + np.arange(S, dtype=np.int64),  # [B, S]
            past_mask=row_mask(starts),  # [B, max(starts)]
        ))
        self.target_kv.write([v for k, v in out.items() if k.startswith(f"{NEW}_")], starts, lo)
        return out["logits"], out["features"]

    def draft(self, batch: StepBatch) -> Draft:
        counts, temps, u = batch.counts, batch.temperatures, batch.draft_uniforms
        args = (batch.features, counts, batch.ctx_starts, batch.floors, batch.anchors, temps, u)
        if not self.drafter_int8 or len(counts) == 1 or self._greedy_call(temps):
            return self._run_draft(0, *args)
        # The int8 graph quantizes activations with one scale per call, so one call over several
        # rows would make a sampled request's proposals depend on its neighbours: each busy row
        # drafts alone, exactly as in a solo run; dummy rows (counts 0) are skipped and left zero.
        rows = {int(r): self._run_draft(int(r), *(a[r:r + 1] for a in args)) for r in np.flatnonzero(counts)}
        B, gamma = len(counts), self.block_size
        tokens, conf = np.zeros((B, gamma), np.int64), np.zeros((B, gamma), np.float32)  # [B, γ]
        sampled = [r for r, d in rows.items() if d.probs is not None]
        probs = np.zeros((B, gamma, self.vocab_size), np.float32) if sampled else None  # [B, γ, V]
        for r, d in rows.items():
            tokens[r], conf[r] = d.tokens[0], d.confidence_logits[0]
            if d.probs is not None:
                probs[r] = d.probs[0]
        return Draft(tokens, probs, conf)

    def _run_draft(self, lo: int, features: np.ndarray, counts: np.ndarray, ctx_starts: np.ndarray,
                   floors: np.ndarray, anchors: np.ndarray, temperatures: np.ndarray, uniforms: np.ndarray,
                   kind: str = "drafter") -> Draft:
        n = int(counts.max())
        B = len(counts)
        starts = ctx_starts + counts  # [B] block positions start..start+γ-1
        positions = np.concatenate([ctx_starts[:, None] + np.arange(n), starts[:, None] + np.arange(self.block_size)],
                                   axis=1)  # [B, n+γ]
        graph = self._drafter_greedy if self._greedy_call(temperatures) else self._drafter
        out = graph.run(lo, lo + B, kind, self.on_run, DrafterInputs(
            features=np.ascontiguousarray(features[:, :n], np.float32),  # [B, n, F]
            positions=positions.astype(np.int64),
            anchor=np.asarray(anchors, np.int64),
            temperature=np.asarray(temperatures, np.float32),
            uniforms=np.asarray(uniforms, np.float32),  # [B, γ]
            past_mask=row_mask(ctx_starts, floors=floors),  # [B, max(ctx_starts)]
            ctx_mask=row_mask(counts, n),  # [B, n]
        ))
        self.draft_kv.write([v for k, v in out.items() if k.startswith(f"{CTX}_")], ctx_starts, lo)
        return Draft(out["draft_tokens"], out.get("draft_probs"), out["confidence_logits"])
