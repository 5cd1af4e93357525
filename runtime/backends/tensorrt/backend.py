"""The TensorRT backend: the bundle's engines as steps of the shared GPU layer. Each bucket
gets its own execution context (its shapes and tensor addresses fixed at capture time), all of
an engine's contexts share one scratch allocation (the stream runs them one at a time), and
`execute_async_v3` is captured in a CUDA graph after one warm-up enqueue.

Imports without tensorrt; opening it without tensorrt, CuPy or a GPU raises a BackendError.
NOT EXECUTED with TensorRT in this project's development environment (no GPU, no TensorRT):
written against the TensorRT 10 Python API documentation; our side of the calls is run
against tests/fake_tensorrt.py, a labelled fake, which verifies nothing about TensorRT."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ...errors import BackendError, BundleError, InputError
from ..gpu.buckets import Buckets
from ..gpu.cupy_device import CupyDevice, GpuInfo
from ..gpu.device import Device, Outputs
from ..gpu.graph_backend import GraphBackend
from ...graph_io import DRAFTER_INPUTS, PAST, TARGET_INPUTS, kv_names
from ...manifest import Manifest
from .meta import check_compatible, engine_meta, rebuild_command
from .profiles import EngineShapes, profile_index


class PointerDevice(Device, Protocol):
    """A `Device` whose arrays TensorRT can read: raw device addresses and a CUDA stream handle
    (`CupyDevice`)."""

    info: GpuInfo
    stream_handle: int

    def address(self, array: Any) -> int:
        ...


def import_tensorrt():
    try:
        import tensorrt
    except ImportError as e:
        raise BackendError("the tensorrt package is not installed (pip install tensorrt-cu12, on a machine with an "
                           "NVIDIA GPU): the TensorRT backend cannot run here") from e
    return tensorrt


class TrtStep:
    """One engine as a `backends.gpu.graph_backend.Step`."""

    def __init__(self, trt, runtime, engine, device: PointerDevice, shapes: EngineShapes, rows_input: str):
        self.trt, self.engine, self.device, self.shapes = trt, engine, device, shapes
        self.runtime = runtime  # an engine must not outlive its runtime
        self.rows_input = rows_input  # the rows of a call: dim 1 of this input
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.kv_names = kv_names(PAST, sum(n.startswith(f"{PAST}_key_") for n in names))  # keys, then values
        size = getattr(engine, "device_memory_size_v2", None) or engine.device_memory_size
        self.scratch = device.zeros((max(size, 1),), "uint8")
        self.eager: dict[int, Any] = {}  # one context per profile for calls that are not captured

    def _context(self, profile: int):
        trt, e = self.trt, self.engine
        strategy = getattr(trt, "ExecutionContextAllocationStrategy", None)
        if strategy is None:
            ctx = e.create_execution_context()
        else:
            ctx = e.create_execution_context(strategy.USER_MANAGED)
            if hasattr(ctx, "set_device_memory"):
                ctx.set_device_memory(self.device.address(self.scratch), self.scratch.nbytes)
            else:
                ctx.device_memory = self.device.address(self.scratch)
        if ctx is None or not ctx.set_optimization_profile_async(profile, self.device.stream_handle):
            raise BackendError(f"TensorRT could not create an execution context on profile {profile} (see its log)")
        return ctx

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
            ctx.set_tensor_address(name, self.device.address(arr))
        outputs = {}
        for name in self.outputs:
            buf = self.device.zeros(tuple(ctx.get_tensor_shape(name)), trt.nptype(self.engine.get_tensor_dtype(name)))
            ctx.set_tensor_address(name, self.device.address(buf))
            outputs[name] = buf
        stream = self.device.stream_handle

        def launch() -> Outputs:
            if not ctx.execute_async_v3(stream):
                raise BackendError("TensorRT execute_async_v3 failed (see the TensorRT log)")
            return outputs

        return launch


def tensorrt_backend(bundle: str | Path, manifest: Manifest, max_seq: int | None = None, graphs: bool = True,
                     speculative: bool = True, device: PointerDevice | None = None, slots: int = 1) -> GraphBackend:
    """device: where the buffers live (default: a `CupyDevice` on the current GPU). slots: 1 (the
    shared GPU layer serves several, but the engines' profiles and contexts for batches are not
    wired to it: more raises a BackendError)."""
    if slots != 1:  # before any GPU work
        raise BackendError(f"the TensorRT backend serves one request at a time: slots={slots} (concurrent "
                           f"requests) is not ported to its engines yet; use the onnxruntime backend for that")
    bundle = Path(bundle)
    meta = engine_meta(manifest, bundle)
    trt = import_tensorrt()
    device = device or CupyDevice()
    shapes = check_compatible(meta, bundle, trt.__version__, device.info.compute, device.info.name)
    if max_seq not in (None, shapes.max_seq):
        raise InputError(f"the engines were built for max_seq {shapes.max_seq} (their KV inputs are that long); "
                         f"rebuild for {max_seq}: {rebuild_command(bundle, {**meta, 'shapes': {**meta['shapes'], 'max_seq': max_seq}})}")
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
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
                        Buckets(shapes.max_seq, shapes.max_query, shapes.prefill_chunk), graphs)
