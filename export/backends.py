"""The PyTorch reference models of a bundle as backends, for `dspark validate`: loaded from
the sources the bundle was exported from, checked against the manifest's source hashes."""
from __future__ import annotations

from pathlib import Path

from dspark.runtime.backends import Backend
from dspark.runtime.errors import InputError
from dspark.runtime.manifest import Manifest

from .bundle import draft_vocab, resolve_drafter, sha256
from .cuda_graph_backend import cuda_graph_backend
from .draft_vocab import restrict_vocab
from .precision import dequantize_into, target_weights
from .target_loader import load_target
from .torch_backend import TorchBackend

TORCH_BACKENDS = ("torch", "torch-cuda-graph")


def torch_backend(name: str, manifest: Manifest, max_seq: int, target_path: str | Path | None,
                  drafter_path: str | Path | None) -> Backend:
    """name: "torch" (TorchBackend, CPU) or "torch-cuda-graph" (the graph modules as CUDA graphs).
    target_path/drafter_path: what `dspark export` was given (None: its defaults)."""
    if name not in TORCH_BACKENDS:
        raise InputError(f"unknown PyTorch backend {name!r}; choose one of {TORCH_BACKENDS}")
    target = load_target(target_path)
    if sha256(target.source) != manifest.source_hashes.get("target"):
        raise InputError(f"target {target.source} is not the model bundle {manifest.name!r} was exported from "
                         f"(sha256 differs from the manifest's); pass --target with the exported source")
    dequantize_into(target.model, target_weights(target.model, target.source, manifest.precision))
    drafter, _, source = resolve_drafter(target, drafter_path)
    got = sha256(source) if source else "untrained"
    if got != manifest.source_hashes.get("drafter"):
        raise InputError(f"drafter {drafter_path or '(untrained default)'} is not the one bundle {manifest.name!r} "
                         f"was exported with; pass --drafter with the exported checkpoint")
    if "draft_vocab" in manifest.extra:  # the ids the bundle's drafter graphs propose, chosen as the export did
        restrict_vocab(drafter, draft_vocab(manifest.extra["draft_vocab"]["size"], target, source)[0])
    if name == "torch":
        return TorchBackend(target.model, drafter, max_seq)
    return cuda_graph_backend(target.model, drafter, max_seq)
