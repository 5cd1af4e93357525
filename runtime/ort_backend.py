"""ONNX Runtime backend: runs the bundle's target and drafter graphs on KV buffers
preallocated at load time, through IOBinding (the caches are bound once, zero-copy)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .backend import Draft
from .errors import BundleError, InputError
from .kv import KVBuffers, past_mask
from .manifest import Manifest

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def session_options(threads: int | None) -> ort.SessionOptions:
    """The target and drafter run one after the other, never at once. Two per-session pools
    would spin against each other on a small machine (measured here: a draft+verify cycle
    took 85 ms with two spinning pools, 47 ms with spinning off, 36 ms with one shared pool),
    so every session of the process uses ONNX Runtime's global intra-op pool, sized by the
    first engine loaded (`threads`, default: every core); later sizes are ignored."""
    try:
        ort.capi._pybind_state.set_global_thread_pool_sizes(threads or os.cpu_count() or 1, 1)
    except ort.capi.onnxruntime_pybind11_state.Fail:  # the pool exists: share it
        pass
    so = ort.SessionOptions()
    so.use_per_session_threads = False
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return so


class _Graph:
    """One ONNX Runtime session with its KV buffers bound once. Graphs that write the
    cache in place (present_* outputs) get those outputs bound to the same memory."""

    def __init__(self, path: Path, provider: str, threads: int | None, kv: KVBuffers, past_names: list[str],
                 expect: dict[str, dict[int, int]]):
        if not path.exists():
            raise BundleError(f"bundle graph {path} is missing; re-run `dspark export`")
        self.path = path
        try:
            self.session = ort.InferenceSession(str(path), session_options(threads), providers=[provider])
        except Exception as e:  # onnxruntime raises its own types for corrupt files
            raise BundleError(f"cannot load {path}: {e}") from e
        self._check_shapes(path, kv, expect)
        self.binding = self.session.io_binding()
        names = [o.name for o in self.session.get_outputs()]
        self.outputs = [n for n in names if not n.startswith("present_")]  # fetched each run
        for name in self.outputs:  # bound first, so they come first in get_outputs()
            self.binding.bind_output(name, "cpu")
        for name, buf in zip(past_names, kv.arrays):
            value = ort.OrtValue.ortvalue_from_numpy(buf)
            self.binding.bind_ortvalue_input(name, value)
            if name.replace("past_", "present_") in names:
                self.binding.bind_ortvalue_output(name.replace("past_", "present_"), value)

    def _check_shapes(self, path: Path, kv: KVBuffers, expect: dict[str, dict[int, int]]) -> None:
        """The graph must be the model the manifest describes: same number of layers, and the
        static sizes in `expect` ({input or output name: {axis: size}})."""
        io = {t.name: t.shape for t in [*self.session.get_inputs(), *self.session.get_outputs()]}
        graph_layers = sum(1 for n in io if n.startswith("past_key_"))
        if graph_layers != len(kv.keys):
            raise BundleError(f"{path} has {graph_layers} layers of KV inputs, the manifest says {len(kv.keys)}: "
                              f"the graph belongs to another model; re-export the bundle")
        for name, axes in expect.items():
            shape = io.get(name)
            for axis, size in axes.items():
                if shape is None or shape[axis] != size:
                    raise BundleError(f"{path}: {name} has shape {shape}, the manifest implies size {size} on axis "
                                      f"{axis}: the graph belongs to another model; re-export the bundle")

    def run(self, **inputs: np.ndarray) -> list[np.ndarray]:
        for name, value in inputs.items():
            self.binding.bind_cpu_input(name, value)
        for name in self.outputs:
            self.binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(self.binding)
        return [v.numpy() for v in self.binding.get_outputs()[:len(self.outputs)]]


class OrtBackend:
    """A `dspark.runtime.backend.Backend` over a bundle's ONNX graphs (batch 1)."""

    def __init__(self, bundle: Path, manifest: Manifest, max_seq: int, provider: str = "cpu",
                 threads: int | None = None, speculative: bool = True, target_graph: str = "auto",
                 drafter_graph: str = "auto"):
        """target_graph: "ort" = the ONNX Runtime variant (fused contrib ops, cache written in
        place), "portable" = the standard-op graph TensorRT also reads, "auto" = "ort" on the
        CPU provider when the bundle has it. drafter_graph: "int8" = matmuls dynamically
        quantized (about 2x faster on CPU; only the proposals change, never the output
        distribution), "fp32" = the exported graph, "auto" = int8 on the CPU provider when
        the bundle has it."""
        if provider not in PROVIDERS:
            raise InputError(f"unknown ONNX Runtime provider {provider!r}; choose one of {sorted(PROVIDERS)}")
        if PROVIDERS[provider] not in ort.get_available_providers():
            raise BundleError(f"{PROVIDERS[provider]} is not available in this onnxruntime build "
                              f"(have {ort.get_available_providers()})")
        if target_graph not in ("auto", "ort", "portable"):
            raise InputError(f"unknown target graph {target_graph!r}; choose auto, ort or portable")
        if drafter_graph not in ("auto", "int8", "fp32"):
            raise InputError(f"unknown drafter graph {drafter_graph!r}; choose auto, int8 or fp32")
        if drafter_graph == "int8" and "drafter_ort" not in manifest.graphs:
            raise BundleError(f"bundle {bundle} has no int8 drafter graph (drafter_ort); re-run `dspark export`")
        if target_graph == "ort" and "target_ort" not in manifest.graphs:
            raise BundleError(f"bundle {bundle} has no ONNX Runtime target graph (target_ort); re-run `dspark export`")
        self.in_place = "target_ort" in manifest.graphs and (
            target_graph == "ort" or (target_graph == "auto" and provider == "cpu"))
        t, d = manifest.target, manifest.drafter
        L = t.num_layers
        self.block_size = d.block_size if speculative else 0
        self.vocab_size = t.vocab_size
        self.max_seq = max_seq
        self.target_kv = KVBuffers(L, 1, t.num_kv_heads, max_seq, t.head_dim)
        names = [f"past_key_{i}" for i in range(L)] + [f"past_value_{i}" for i in range(L)]
        kv_shape = {1: t.num_kv_heads, 3: t.head_dim}
        graph = manifest.graphs["target_ort" if self.in_place else "target"]
        self._target = _Graph(bundle / graph, PROVIDERS[provider], threads, self.target_kv, names,
                              {names[0]: kv_shape, "logits": {2: t.vocab_size}, "features": {2: d.feature_dim}})
        self._drafter = None
        if speculative:
            self.draft_kv = KVBuffers(d.num_layers, 1, d.num_kv_heads, max_seq, d.head_dim)
            names = [f"past_key_{i}" for i in range(d.num_layers)] + [f"past_value_{i}" for i in range(d.num_layers)]
            int8 = "drafter_ort" in manifest.graphs and (
                drafter_graph == "int8" or (drafter_graph == "auto" and provider == "cpu"))
            drafter = "drafter_ort" if int8 else "drafter"
            self._drafter = _Graph(bundle / manifest.graphs[drafter], PROVIDERS[provider], threads,
                                   self.draft_kv, names,
                                   {names[0]: {1: d.num_kv_heads, 3: d.head_dim}, "draft_probs": {2: d.vocab_size},
                                    "features": {2: d.feature_dim}})

    def target(self, tokens: np.ndarray, start: int, logit_rows: int) -> tuple[np.ndarray, np.ndarray]:
        S = len(tokens)
        if self.in_place:  # the graph writes K/V rows start..start+S-1 into the bound buffers itself
            logits, features = self._target.run(
                input_ids=np.asarray(tokens, np.int64)[None],  # [1, S]
                logit_index=np.arange(S - logit_rows, S, dtype=np.int64)[None],  # [1, K]
                seqlens_k=np.array([start + S - 1], np.int32),  # last position written
                total_len=np.array(start + S, np.int32),
            )
            return logits[0], features[0]
        logits, features, *new_kv = self._target.run(
            input_ids=np.asarray(tokens, np.int64)[None],  # [1, S]
            positions=np.arange(start, start + S, dtype=np.int64)[None],  # [1, S]
            logit_index=np.arange(S - logit_rows, S, dtype=np.int64)[None],  # [1, K]
            past_mask=past_mask(start),  # [1, max(start, 1)]
        )
        self.target_kv.write(new_kv, start)
        return logits[0], features[0]

    def draft(self, features: np.ndarray, ctx_start: int, anchor: int, start: int,
              temperature: float, uniforms: np.ndarray) -> Draft:
        gamma = self.block_size
        tokens, probs, conf, *ctx_kv = self._drafter.run(
            features=np.ascontiguousarray(features, np.float32)[None],  # [1, n, F]
            positions=np.arange(ctx_start, start + gamma, dtype=np.int64)[None],  # [1, n+γ]
            anchor=np.array([anchor], np.int64),
            temperature=np.array([temperature], np.float32),
            uniforms=np.asarray(uniforms, np.float32)[None],  # [1, γ]
            past_mask=past_mask(ctx_start),
        )
        self.draft_kv.write(ctx_kv, ctx_start)
        return Draft(tokens[0], probs[0], conf[0])
