"""The TensorRT backend: the bundle's engines as steps of the shared GPU layer. Each bucket
gets its own execution context (its shapes and tensor addresses fixed at capture time), all of
an engine's contexts share one scratch allocation (the stream runs them one at a time), and
`execute_async_v3` is captured in a CUDA graph after one warm-up enqueue.

Imports without tensorrt; opening it without tensorrt (11 or newer), CuPy or a GPU raises a
BackendError. NOT EXECUTED: no TensorRT engine has been built or run by this project, on any
machine. Written against the TensorRT 11 Python API as the tensorrt-cu13 11.4.0.106 bindings
declare it (their classes and pybind11 signatures, read on a CPU: tests/test_tensorrt_api.py
checks tests/fake_tensorrt.py against them); our side of the calls runs against that fake, a
labelled stand-in that verifies nothing about TensorRT itself."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import BackendError, BundleError, InputError
from ..gpu.buckets import Buckets
from ..gpu.cupy_device import CupyDevice
from ..gpu.device import Outputs, PointerDevice
from ..gpu.graph_backend import GraphBackend
from ...graph_io import DRAFTER_INPUTS, PAST, TARGET_INPUTS, kv_names
from ...manifest import Manifest
from .meta import check_compatible, engine_meta, rebuild_command
from .profiles import EngineShapes, profile_index


TENSORRT_MAJOR = 11  # strongly typed networks only, device_memory_size_v2: the API this package calls
INSTALL = "pip install 'dspark-trt[tensorrt]' (CUDA 13), or 'dspark-trt[tensorrt-cuda12]' for a CUDA 12 driver"


def import_tensorrt():
    try:
        import tensorrt
    except ImportError as e:  # not installed, or its native libraries (tensorrt-cu13-libs) do not load
        raise BackendError(f"the tensorrt package is not installed or does not load ({e}): {INSTALL}, on a machine "
                           f"with an NVIDIA GPU; the TensorRT backend cannot run here") from e
    major = str(tensorrt.__version__).split(".")[0]
    if not major.isdigit() or int(major) < TENSORRT_MAJOR:
        raise BackendError(f"TensorRT {tensorrt.__version__} is installed; the TensorRT backend needs TensorRT "
                           f"{TENSORRT_MAJOR} or newer: {INSTALL}")
    return tensorrt


def create(trt, what: str, make: Callable[[], Any]) -> Any:
    """A TensorRT Builder or Runtime, or a BackendError. When the native library returns no
    object the 11.4 bindings raise TypeError("pybind11::init(): factory function returned
    nullptr") (seen over stub libraries that return none); when real TensorRT returns none, e.g.
    under a driver older than its CUDA, was not observed (no GPU here)."""
    try:
        return make()
    except (TypeError, RuntimeError) as e:
        raise BackendError(f"TensorRT {trt.__version__} could not create its {what} ({e}; its log above says why): "
                           f"check that the NVIDIA driver supports the CUDA this TensorRT was built for "
                           f"(nvidia-smi); {INSTALL}") from e


class TrtStep:
    """One engine as a `backends.gpu.graph_backend.Step`."""

    def __init__(self, trt, runtime, engine, device: PointerDevice, shapes: EngineShapes, rows_input: str):
        self.trt, self.engine, self.device, self.shapes = trt, engine, device, shapes
        self.runtime = runtime  # an engine must not outlive its runtime
        self.rows_input = rows_input  # the rows of a call: dim 1 of this input
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.kv_names = kv_names(PAST, sum(n.startswith(f"{PAST}_key_") for n in names))  # keys, then values
        self.scratch = device.zeros((max(engine.device_memory_size_v2, 1),), "uint8")  # the largest profile's
        self.eager: dict[int, Any] = {}  # one context per profile for calls that are not captured

    def _context(self, profile: int):
        ctx = self.engine.create_execution_context(self.trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if ctx is not None:
            ctx.set_device_memory(self.device.address(self.scratch), self.scratch.nbytes)
        if ctx is None or not ctx.set_optimization_profile_async(profile, self.device.stream_handle):
            raise BackendError(f"TensorRT could not create an execution context on profile {profile} (see its log)")
        return ctx

    def _bind(self, ctx, name: str, array: Any) -> Any:
        if not ctx.set_tensor_address(name, self.device.address(array)):
            raise BackendError(f"TensorRT refused the address of {name} (see its log)")
        return array

    def prepare(self, inputs: dict[str, Any], kv: list[Any], graphed: bool) -> Callable[[], Outputs]:
        batch, rows = inputs[self.rows_input].shape[:2]
        profile = profile_index(self.shapes, batch, rows)
        if graphed:
            ctx = self._context(profile)
        else:
            ctx = self.eager.get(profile) or self.eager.setdefault(profile, self._context(profile))
        trt = self.trt
        for name, arr in [*inputs.items(), *zip(self.kv_names, kv)]:
            want = trt.nptype(self.engine.get_tensor_dtype(name))
            if arr.dtype != want:
                raise BundleError(f"engine input {name} is {want}, the runtime holds {arr.dtype}: rebuild the engines")
            if not ctx.set_input_shape(name, tuple(arr.shape)):
                raise InputError(f"TensorRT rejected shape {tuple(arr.shape)} for {name} (outside the profiles)")
            self._bind(ctx, name, arr)
        outputs = {}
        for name in self.outputs:
            buf = self.device.zeros(tuple(ctx.get_tensor_shape(name)), trt.nptype(self.engine.get_tensor_dtype(name)))
            outputs[name] = self._bind(ctx, name, buf)
        stream = self.device.stream_handle

        def launch() -> Outputs:
            if not ctx.execute_async_v3(stream):
                raise BackendError("TensorRT execute_async_v3 failed (see the TensorRT log)")
            return outputs

        return launch


def tensorrt_backend(bundle: str | Path, manifest: Manifest, max_seq: int | None = None, graphs: bool = True,
                     speculative: bool = True, device: PointerDevice | None = None, slots: int = 1) -> GraphBackend:
    """device: where the buffers live (default: a `CupyDevice` on the current GPU). slots: requests
    served at once (the shared GPU layer's batch buckets), at most the `--max-batch` the engines'
    verification profile was built for; prefill calls run at batch 1 (the prefill profile)."""
    bundle = Path(bundle)
    meta = engine_meta(manifest, bundle)
    built = meta.get("shapes", {}).get("max_batch", 1)
    if not 1 <= slots <= built:  # before any GPU work
        raise InputError(f"slots={slots}: the engines in {bundle} serve 1 to {built} requests at once (their "
                         f"profiles' max_batch); rebuild for {max(slots, 1)}: "
                         f"{rebuild_command(bundle, {**meta, 'shapes': {**meta['shapes'], 'max_batch': max(slots, 1)}})}")
    trt = import_tensorrt()
    device = device or CupyDevice()
    shapes = check_compatible(meta, bundle, trt.__version__, device.info.compute, device.info.name)
    if max_seq not in (None, shapes.max_seq):
        raise InputError(f"the engines were built for max_seq {shapes.max_seq} (their KV inputs are that long); "
                         f"rebuild for {max_seq}: {rebuild_command(bundle, {**meta, 'shapes': {**meta['shapes'], 'max_seq': max_seq}})}")
    runtime = create(trt, "runtime", lambda: trt.Runtime(trt.Logger(trt.Logger.WARNING)))
    steps = {}
    for role, rows_input in (("target", TARGET_INPUTS[0]), ("drafter", DRAFTER_INPUTS[0])):  # input_ids, features
        path = bundle / meta["engines"][role]
        engine = runtime.deserialize_cuda_engine(path.read_bytes()) if path.exists() else None
        if engine is None:
            raise BackendError(f"TensorRT {trt.__version__} could not load {path} (see its log); "
                               f"rebuild: {rebuild_command(bundle, meta)}")
        steps[role] = TrtStep(trt, runtime, engine, device, shapes, rows_input)
    return GraphBackend(device, manifest.target, manifest.drafter if speculative else None, steps["target"],
                        steps["drafter"] if speculative else None,
                        Buckets(shapes.max_seq, shapes.max_query, shapes.prefill_chunk, max_batch=slots), graphs)
