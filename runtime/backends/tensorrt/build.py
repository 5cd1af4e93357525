"""`dspark build --backend tensorrt`: TensorRT engines from a bundle's ONNX graphs, built on
the GPU that will run them. Strongly typed networks (TensorRT 11 has no other kind: the
precision is the graphs' own), two optimization profiles per engine
(runtime/backends/tensorrt/profiles.py), a timing cache kept across builds, and the engine
metadata written into the manifest. A quantized bundle (int8, int4) builds from its portable
graph, which reads the weight blocks through DequantizeLinear (export/portable_qdq.py): TensorRT's
weight-only quantization, activations in the graph's own fp32.

NOT EXECUTED: no TensorRT engine has been built by this project, on any machine. Written
against the TensorRT 11 Python API of the tensorrt-cu13 11.4.0.106 bindings (backend.py). The CPU
tests drive it against tests/fake_tensorrt.py, a stand-in that checks our calls and our
profiles against the ONNX inputs: a unit test of this module, not TensorRT verification."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import BackendError, BundleError
from ..gpu.cupy_device import gpu_info
from ...graph_io import PAST
from ...manifest import Manifest
from .backend import create, import_tensorrt
from .profiles import PROFILE_NAMES, EngineShapes, check_precision, drafter_profiles, target_profiles

KV_PREFIXES = (f"{PAST}_key_", f"{PAST}_value_")  # the cache inputs: their shapes are fixed, not worth recording
ROLES = ("target", "drafter")  # "target" is the portable graph: target_ort holds ONNX Runtime contrib ops


def default_timing_cache(trt_version: str, compute: tuple[int, int]) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "dspark" / f"tensorrt-{trt_version}-sm{compute[0]}{compute[1]}.timing"


def _write(path: Path, data: bytes) -> None:
    """Atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def build_tensorrt(bundle: str | Path, *, precision: str = "fp32", max_seq: int | None = None, max_batch: int = 1,
                   prefill_chunk: int = 512, timing_cache: str | Path | None = None, workspace_gib: float = 8.0,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build both engines into the bundle; returns the metadata written to the manifest."""
    bundle = Path(bundle)
    manifest = Manifest.load(bundle)
    missing = [r for r in ROLES if r not in manifest.graphs]
    if missing:
        raise BundleError(f"bundle {bundle} has no ONNX graph for {', '.join(missing)}: nothing to build from; "
                          f"export it with `dspark export --portable`")
    trt = import_tensorrt()
    gpu = gpu_info()
    prec = check_precision(precision, manifest.dtype, gpu.compute)
    shapes = EngineShapes.for_manifest(manifest, max_seq, max_batch, prefill_chunk)
    cache_path = Path(timing_cache) if timing_cache else default_timing_cache(trt.__version__, gpu.compute)
    cache_blob = cache_path.read_bytes() if cache_path.exists() else b""
    log(f"TensorRT {trt.__version__} on {gpu.name} (sm {gpu.compute[0]}.{gpu.compute[1]}), {precision}, {shapes}; "
        f"timing cache {cache_path} ({len(cache_blob)} bytes)")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = create(trt, "builder", lambda: trt.Builder(logger))
    profiles = {"target": target_profiles(manifest, shapes), "drafter": drafter_profiles(manifest, shapes)}
    engines = {}
    for role in ROLES:
        t0 = time.perf_counter()
        network = builder.create_network(0)  # strongly typed: 11 ignores the deprecated STRONGLY_TYPED flag
        parser = trt.OnnxParser(network, logger)
        path = bundle / manifest.graphs[role]
        if not parser.parse_from_file(str(path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise BundleError(f"TensorRT {trt.__version__} cannot parse {path}: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
        if not prec.tf32:
            config.clear_flag(trt.BuilderFlag.TF32)  # fp32 means fp32 matmuls, not TF32
        cache = config.create_timing_cache(cache_blob)
        if cache is None or not config.set_timing_cache(cache, False):
            log(f"timing cache {cache_path} does not fit this TensorRT/GPU; starting a new one")
            config.set_timing_cache(config.create_timing_cache(b""), False)
        for name in PROFILE_NAMES:
            profile = builder.create_optimization_profile()
            for tensor, (lo, opt, hi) in profiles[role][name].items():
                profile.set_shape(tensor, lo, opt, hi)
            config.add_optimization_profile(profile)
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise BackendError(f"TensorRT failed to build the {role} engine from {path} (its log above says why)")
        engines[role] = f"{role}.{precision}.plan"
        _write(bundle / engines[role], bytes(plan))
        cache_blob = bytes(config.get_timing_cache().serialize())
        log(f"built {engines[role]} ({len(bytes(plan)) / 2**20:.1f} MiB) in {time.perf_counter() - t0:.0f} s")
    _write(cache_path, cache_blob)
    meta = {
        "tensorrt_version": trt.__version__,
        "compute_capability": list(gpu.compute),
        "gpu_name": gpu.name,
        "precision": precision,
        "weights": manifest.precision,  # int8/int4: the portable graph's DequantizeLinear of the blocks (weight-only)
        "shapes": shapes.to_dict(),
        "profiles": {role: {name: {k: [list(s) for s in v] for k, v in p.items() if not k.startswith(KV_PREFIXES)}
                            for name, p in profiles[role].items()} for role in ROLES},
        "engines": engines,
        "timing_cache": str(cache_path),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    manifest.extra["tensorrt"] = meta
    manifest.files.update({f: (bundle / f).stat().st_size for f in engines.values()})
    manifest.save(bundle)
    return meta
