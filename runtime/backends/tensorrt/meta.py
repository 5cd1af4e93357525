"""The engine metadata a bundle records (`manifest.extra["tensorrt"]`) and the checks made
before an engine is deserialized: TensorRT engines run only under the TensorRT version and on
the GPU architecture that built them. Pure logic."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import BackendError, BundleError
from ...manifest import Manifest
from .profiles import EngineShapes


def rebuild_command(bundle: Path, meta: dict[str, Any] | None) -> str:
    cmd = f"dspark build --bundle {bundle} --backend tensorrt"
    if meta:
        s = meta.get("shapes", {})
        cmd += f" --precision {meta.get('precision', 'fp32')}"
        cmd += "".join(f" --{k.replace('_', '-')} {s[k]}" for k in ("max_seq", "max_batch", "prefill_chunk") if k in s)
    return cmd


def engine_meta(manifest: Manifest, bundle: Path) -> dict[str, Any]:
    meta = manifest.extra.get("tensorrt")
    if not isinstance(meta, dict) or not isinstance(meta.get("engines"), dict):
        raise BundleError(f"bundle {bundle} has no TensorRT engines; build them on the GPU that will run them: "
                          f"{rebuild_command(bundle, None)}")
    return meta


def check_compatible(meta: dict[str, Any], bundle: Path, trt_version: str, compute: tuple[int, int],
                     gpu_name: str) -> EngineShapes:
    """Raise a BackendError naming the rebuild command unless the engines were built by this
    TensorRT version for this GPU architecture; return their shapes."""
    built_cc = tuple(meta.get("compute_capability", ()))
    if meta.get("tensorrt_version") != trt_version:
        raise BackendError(f"the engines in {bundle} were built with TensorRT {meta.get('tensorrt_version')}, this "
                           f"is TensorRT {trt_version}: an engine runs only under the version that built it. "
                           f"Rebuild: {rebuild_command(bundle, meta)}")
    if built_cc != compute:
        built = ".".join(map(str, built_cc)) or "?"
        raise BackendError(f"the engines in {bundle} were built for compute capability {built} "
                           f"({meta.get('gpu_name')}), this GPU is {compute[0]}.{compute[1]} ({gpu_name}). "
                           f"Rebuild on this GPU: {rebuild_command(bundle, meta)}")
    try:
        return EngineShapes(**meta["shapes"])
    except (KeyError, TypeError) as e:
        raise BundleError(f"{bundle}/manifest.json: malformed TensorRT metadata ({e}); "
                          f"rebuild: {rebuild_command(bundle, None)}") from e
