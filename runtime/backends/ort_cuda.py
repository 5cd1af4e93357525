"""ONNX Runtime's CUDA execution provider as steps of the shared GPU layer (gpu/): the GPU
backend for a machine without TensorRT (`--provider cuda`). It runs the bundle's portable graphs
(target.onnx, drafter.onnx) with every input, output and KV cache bound by device address through
IOBinding, so the caches never leave the GPU: each step's new K/V rows are scattered into them on
the device, and the acceptance rule runs next to the logits. ONNX Runtime is handed the device's
stream (`user_compute_stream`), so its kernels are ordered with the layer's copies and row writes.

Calls run eagerly, one binding per bucket: ONNX Runtime synchronizes its stream at the end of a
run and computes shapes on the host, which a CUDA-graph capture of the run would not survive.

UNTESTED on a GPU: no GPU with onnxruntime-gpu has run this (the wheel is several times what can
travel to the lent H200). On the CPU the same binding code runs over the CPU provider with host
arrays bound by address (tests/test_ort_cuda.py)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ..errors import BackendError, BundleError, InputError
from ..graph_io import DRAFTER_INPUTS, PAST, TARGET_INPUTS, kv_names
from ..manifest import Manifest
from .gpu.buckets import Buckets
from .gpu.device import Outputs, PointerDevice
from .gpu.graph_backend import GraphBackend
from .onnxruntime import open_session

CUDA = "CUDAExecutionProvider"
INSTALL = ("pip uninstall onnxruntime && pip install onnxruntime-gpu (the CUDA 12 build; the two wheels share "
           "the module name), plus CuPy for the device buffers: pip install 'dspark-trt[gpu-cuda12]'")
DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
          "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


class OrtStep:
    """One ONNX graph as a `backends.gpu.steps.Step`: each bucket gets an IOBinding whose inputs,
    KV caches and outputs are the shared layer's static device buffers, bound by address."""

    def __init__(self, path: Path, providers: list, threads: int | None, device: PointerDevice, device_type: str,
                 fed: tuple[str, ...]):
        """fed: the input names the runtime feeds (graph_io), besides the KV caches."""
        self.path, self.device, self.device_type = path, device, device_type
        self.session = session = open_session(path, threads, providers)
        names = [i.name for i in session.get_inputs()]
        self.kv_names = kv_names(PAST, sum(n.startswith(f"{PAST}_key_") for n in names))  # keys, then values
        if set(names) != {*fed, *self.kv_names}:
            raise BundleError(f"{path} has inputs {names}, the runtime feeds {[*fed, *self.kv_names]}: "
                              f"it was exported by another exporter version; re-export the bundle")
        self.inputs, self.outputs = session.get_inputs(), session.get_outputs()
        known = {dim for arg in self.inputs for dim in arg.shape if isinstance(dim, str)}
        for arg in self.outputs:
            if any(isinstance(dim, str) and dim not in known for dim in arg.shape):
                raise BundleError(f"output {arg.name} {arg.shape} of {path} has a dimension no input sets (its "
                                  f"buffer cannot be sized before the run): re-export the bundle")

    def _bind(self, bind: Callable[..., None], name: str, array: Any) -> None:
        bind(name, self.device_type, self.device.id, array.dtype, list(array.shape), self.device.address(array))

    def prepare(self, inputs: dict[str, Any], kv: list[Any], graphed: bool) -> Callable[[], Outputs]:
        fed = {**inputs, **dict(zip(self.kv_names, kv))}
        sizes = {}  # each symbolic dimension of the graph's inputs -> its size in this call
        for arg in self.inputs:
            sizes |= {dim: n for dim, n in zip(arg.shape, fed[arg.name].shape) if isinstance(dim, str)}
        binding = self.session.io_binding()
        for name, array in fed.items():
            self._bind(binding.bind_input, name, array)
        outputs = {}
        for arg in self.outputs:
            shape = tuple(sizes[dim] if isinstance(dim, str) else dim for dim in arg.shape)
            outputs[arg.name] = self.device.zeros(shape, np.dtype(DTYPES[arg.type]))
            self._bind(binding.bind_output, arg.name, outputs[arg.name])

        def launch() -> Outputs:
            self.session.run_with_iobinding(binding)
            return outputs

        return launch


def ort_cuda_backend(bundle: str | Path, manifest: Manifest, max_seq: int, slots: int = 1, speculative: bool = True,
                     threads: int | None = None, target_graph: str = "auto", drafter_graph: str = "auto",
                     device: PointerDevice | None = None, provider: str = "cuda") -> GraphBackend:
    """The bundle's portable graphs on ONNX Runtime's CUDA provider, `slots` requests at once.
    device: where the buffers live (default: a `CupyDevice` on the current GPU). provider "cpu"
    with a host `device` runs the same bindings on the CPU provider (how the tests drive it)."""
    bundle = Path(bundle)
    if slots < 1:
        raise InputError(f"slots is {slots}, expected >= 1 (requests served at once)")
    if target_graph not in ("auto", "portable"):
        raise InputError(f"target graph {target_graph!r}: the CUDA provider runs the portable target graph "
                         f"(target.onnx); use --target-graph auto or portable")
    if drafter_graph not in ("auto", "fp32"):
        raise InputError(f"drafter graph {drafter_graph!r}: the int8 drafter graphs are for the CPU provider; "
                         f"use --drafter-graph auto or fp32 with --provider cuda")
    if "target" not in manifest.graphs:
        raise BundleError(f"bundle {bundle} has no portable target graph (target.onnx), which the CUDA provider "
                          f"runs; export the bundle with `dspark export --portable`")
    if provider == "cuda":
        if CUDA not in ort.get_available_providers():
            raise BackendError(f"{CUDA} is not available in this onnxruntime build (have "
                               f"{ort.get_available_providers()}): {INSTALL}")
        if device is None:
            from .gpu.cupy_device import CupyDevice

            device = CupyDevice()
        providers = [(CUDA, {"device_id": str(device.id), "user_compute_stream": str(device.stream_handle)})]
    elif device is None:
        raise InputError("ort_cuda_backend on the CPU provider needs a host PointerDevice")
    else:
        providers = ["CPUExecutionProvider"]
    device_type = "cuda" if provider == "cuda" else "cpu"
    roles = (("target", TARGET_INPUTS), ("drafter", DRAFTER_INPUTS))[:2 if speculative else 1]
    steps = [OrtStep(bundle / manifest.graphs[role], providers, threads, device, device_type, fed)
             for role, fed in roles]
    d = manifest.drafter if speculative else None
    query = d.block_size + 1 if d is not None else 1
    buckets = Buckets(max_seq, query, max(512, query), max_batch=slots)
    return GraphBackend(device, manifest.target, d, steps[0], steps[1] if speculative else None, buckets,
                        graphs=False)
