"""The engine backends, behind one registry that `Engine.load` and `dspark validate` share.

    onnxruntime   the bundle's ONNX graphs on ONNX Runtime: its CPU provider, or its CUDA provider over
                  the shared GPU layer (ort_cuda.py)
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
PROVIDERS = ("cpu", "cuda")  # ONNX Runtime's: the CPU (onnxruntime.py) or CUDA (ort_cuda.py, buffers on the GPU)


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
    if options.provider not in PROVIDERS:
        raise InputError(f"unknown ONNX Runtime provider {options.provider!r}; choose one of {', '.join(PROVIDERS)}")
    max_seq = min(DEFAULT_MAX_SEQ, limit) if options.max_seq is None else options.max_seq
    target_graph = "portable" if name == "ort-portable" else options.target_graph
    if options.provider == "cuda":
        from .ort_cuda import ort_cuda_backend

        return ort_cuda_backend(bundle, manifest, max_seq, options.slots, speculative, options.threads, target_graph,
                                options.drafter_graph)
    from .onnxruntime import OrtBackend

    return OrtBackend(bundle, manifest, max_seq, options.threads, speculative, target_graph, options.drafter_graph,
                      options.slots)


BACKENDS = ("onnxruntime", "ort-portable", "tensorrt")

__all__ = ["BACKENDS", "Backend", "BackendOptions", "Draft", "RunEvent", "RunHook", "RunTimer", "StepBatch", "Verdict",
           "open_backend"]
