"""The engine backends, behind one registry that `Engine.load` and `dspark validate` share.

    onnxruntime   the bundle's ONNX graphs on ONNX Runtime (CPU, or the CUDA execution provider)
    ort-portable  the same with the standard-op target graph (what TensorRT reads)
    tensorrt      engines built by `dspark build` on the shared GPU layer (gpu/, tensorrt/)

The PyTorch reference models (`dspark.export.backends`) are backends too, of the export side."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..manifest import Manifest
from .base import Backend, Draft, RunEvent, RunHook, StepBatch, Verdict
from .timing import RunTimer

DEFAULT_MAX_SEQ = 2048


@dataclass(frozen=True)
class BackendOptions:
    max_seq: int | None = None  # KV positions a slot holds (None: 2048 or the model's limit; tensorrt: its engines')
    slots: int = 1  # requests served at once
    provider: str = "cpu"  # ONNX Runtime execution provider
    threads: int | None = None  # ONNX Runtime intra-op threads (None: every core)
    target_graph: str = "auto"  # ONNX Runtime: auto | ort | portable
    drafter_graph: str = "auto"  # ONNX Runtime: auto | int8 | fp32


def open_backend(name: str, bundle: Path, manifest: Manifest, options: BackendOptions = BackendOptions(),
                 speculative: bool = True) -> Backend:
    """A backend by name over the bundle's graphs or engines; `speculative` False opens the target alone."""
    if name not in BACKENDS:
        raise InputError(f"unknown backend {name!r}; this runtime has: {', '.join(BACKENDS)}")
    limit = manifest.target.max_position_embeddings
    if options.max_seq is not None and not 1 < options.max_seq <= limit:
        raise InputError(f"max_seq is {options.max_seq}, expected 2..{limit} (the target's max_position_embeddings)")
    if name == "tensorrt":
        from .tensorrt.backend import tensorrt_backend

        return tensorrt_backend(bundle, manifest, options.max_seq, speculative=speculative, slots=options.slots)
    from .onnxruntime import OrtBackend

    max_seq = min(DEFAULT_MAX_SEQ, limit) if options.max_seq is None else options.max_seq
    target_graph = "portable" if name == "ort-portable" else options.target_graph
    return OrtBackend(bundle, manifest, max_seq, options.provider, options.threads, speculative, target_graph,
                      options.drafter_graph, options.slots)


BACKENDS = ("onnxruntime", "ort-portable", "tensorrt")

__all__ = ["BACKENDS", "Backend", "BackendOptions", "Draft", "RunEvent", "RunHook", "RunTimer", "StepBatch", "Verdict",
           "open_backend"]
