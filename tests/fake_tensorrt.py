"""A FAKE of the `tensorrt` module (TensorRT 11), for unit tests of dspark.runtime.backends.tensorrt on
machines without TensorRT. It is NOT TensorRT and proves nothing about TensorRT: it implements the few
calls our builder and backend make, records them, and checks what TensorRT would refuse for our
inputs. Builder: every network input (read from the ONNX file with `onnx`) needs a shape in
every optimization profile, of the graph's rank, equal to the graph's static dims, with
min <= opt <= max; a "plan" is JSON describing the build. Runtime: an "engine" runs the ONNX
graph with ONNX Runtime on host arrays found by their addresses (`HostDevice`); a context
refuses input shapes outside its optimization profile and resolves output shapes from the
graph's symbolic dims.

The names in `REAL_API` follow the real module's: its classes, their methods with the same
parameter names, properties where it has properties, enum members it has (TensorRT 11.4: no
FP16/BF16 builder flags, no `device_memory_size`). tests/test_tensorrt_api.py checks them
against the real tensorrt-cu13 bindings where those import."""
from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from dspark.runtime.backends.gpu.cupy_device import GpuInfo
from dspark.runtime.backends.onnxruntime import session_options

__version__ = "11.4.0-fake"
MemoryPoolType = SimpleNamespace(WORKSPACE="workspace")
BuilderFlag = SimpleNamespace(TF32="tf32")  # 11 removed FP16, BF16, INT8...: strongly typed networks only
TensorIOMode = SimpleNamespace(INPUT="input", OUTPUT="output")
ExecutionContextAllocationStrategy = SimpleNamespace(STATIC="static", USER_MANAGED="user_managed")
REAL_API = ("__version__", "Logger", "MemoryPoolType", "BuilderFlag", "TensorIOMode", "ExecutionContextAllocationStrategy",
            "ITimingCache", "IOptimizationProfile", "IBuilderConfig", "INetworkDefinition", "OnnxParser", "Builder",
            "nptype", "Runtime", "ICudaEngine", "IExecutionContext")
heap: dict[int, np.ndarray] = {}  # "device" address -> host array (HostDevice allocates here)
calls: list[tuple] = []  # every recorded call, in order; tests clear it


def at(address: int, shape: tuple, dtype: np.dtype) -> np.ndarray | None:
    """The memory at `address` seen as an array of `shape` (what TensorRT reads and writes through
    a tensor address and a shape: a slice of an allocation too), or None outside every allocation."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    for base, array in heap.items():
        if base <= address and address + size <= base + array.nbytes:
            return np.ndarray(shape, dtype, buffer=array.data, offset=address - base)
    return None


class Logger:
    WARNING = 2

    def __init__(self, min_severity: int = 2):
        self.level = min_severity


class ITimingCache:
    def __init__(self, blob: bytes):
        self.blob = blob

    def serialize(self) -> bytes:
        builds = json.loads(self.blob or b'{"builds": 0}')["builds"]
        return json.dumps({"builds": builds + 1}).encode()


class IOptimizationProfile:
    def __init__(self):
        self.shapes: dict[str, tuple] = {}

    def set_shape(self, input, min, opt, max) -> None:  # noqa: A002 (TensorRT's parameter names)
        self.shapes[input] = (tuple(min), tuple(opt), tuple(max))


class IBuilderConfig:
    def __init__(self):
        self.flags = {BuilderFlag.TF32}  # TensorRT enables TF32 by default
        self.profiles: list[IOptimizationProfile] = []
        self.cache: ITimingCache | None = None
        self.pools: dict = {}

    def set_memory_pool_limit(self, pool, pool_size: int) -> None:
        self.pools[pool] = pool_size

    def clear_flag(self, flag) -> None:
        self.flags.discard(flag)

    def create_timing_cache(self, serialized_timing_cache: bytes) -> ITimingCache:
        calls.append(("create_timing_cache", bytes(serialized_timing_cache)))
        return ITimingCache(bytes(serialized_timing_cache))

    def set_timing_cache(self, cache: ITimingCache, ignore_mismatch: bool) -> bool:
        self.cache = cache
        return True

    def get_timing_cache(self) -> ITimingCache:
        return self.cache

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1


class INetworkDefinition:
    def __init__(self, flags: int):
        self.flags = flags
        self.inputs: dict[str, tuple] = {}  # name -> dims, -1 where dynamic
        self.path = ""


class OnnxParser:
    def __init__(self, network: INetworkDefinition, logger: Logger):
        self.network, self.errors = network, []

    def parse_from_file(self, model: str) -> bool:
        calls.append(("parse_from_file", model))
        self.network.path = path = model
        try:
            model = onnx.load(path, load_external_data=False)
        except Exception as e:  # noqa: BLE001
            self.errors = [f"cannot read {path}: {e}"]
            return False
        for i in model.graph.input:
            dims = i.type.tensor_type.shape.dim
            self.network.inputs[i.name] = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in dims)
        return True

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, index: int) -> str:
        return self.errors[index]


class Builder:
    def __init__(self, logger: Logger):
        self.logger = logger

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        return INetworkDefinition(flags)

    def create_builder_config(self) -> IBuilderConfig:
        return IBuilderConfig()

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile()

    def build_serialized_network(self, network: INetworkDefinition, config: IBuilderConfig) -> bytes | None:
        calls.append(("build", network, config))
        if not config.profiles:
            return None
        for p in config.profiles:
            for name, dims in network.inputs.items():
                if name not in p.shapes:
                    return None
                for shape in p.shapes[name]:
                    if len(shape) != len(dims) or any(d != -1 and d != s for d, s in zip(dims, shape)):
                        return None
                lo, opt, hi = p.shapes[name]
                if not all(a <= b <= c for a, b, c in zip(lo, opt, hi)):
                    return None
            if set(p.shapes) - set(network.inputs):
                return None
        return json.dumps({"fake_plan": True, "onnx": network.path, "inputs": sorted(network.inputs),
                           "tf32": BuilderFlag.TF32 in config.flags,
                           "profiles": [p.shapes for p in config.profiles]}).encode()


def nptype(trt_type: np.dtype) -> type:
    return np.dtype(trt_type).type


ORT_TYPES = {"tensor(float)": np.dtype(np.float32), "tensor(int64)": np.dtype(np.int64)}


class Runtime:
    def __init__(self, logger: Logger):
        self.logger = logger

    def deserialize_cuda_engine(self, serialized_engine: bytes) -> "ICudaEngine | None":
        try:
            plan = json.loads(serialized_engine)
        except ValueError:
            return None
        return ICudaEngine(plan) if plan.get("fake_plan") else None


class ICudaEngine:
    def __init__(self, plan: dict):
        self.profiles = plan["profiles"]
        self.session = ort.InferenceSession(plan["onnx"], session_options(1), providers=["CPUExecutionProvider"])
        self.io = {**{i.name: (TensorIOMode.INPUT, i) for i in self.session.get_inputs()},
                   **{o.name: (TensorIOMode.OUTPUT, o) for o in self.session.get_outputs()}}
        self.names = list(self.io)
        self.contexts: list[IExecutionContext] = []

    @property
    def num_io_tensors(self) -> int:
        return len(self.names)

    @property
    def device_memory_size_v2(self) -> int:
        return 4096

    def get_tensor_name(self, index: int) -> str:
        return self.names[index]

    def get_tensor_mode(self, name: str) -> str:
        return self.io[name][0]

    def get_tensor_dtype(self, name: str) -> np.dtype:
        return ORT_TYPES[self.io[name][1].type]

    def create_execution_context(self, strategy: str = ExecutionContextAllocationStrategy.STATIC) -> "IExecutionContext":
        self.contexts.append(IExecutionContext(self, strategy))
        return self.contexts[-1]


class IExecutionContext:
    def __init__(self, engine: ICudaEngine, strategy: str):
        self.engine, self.strategy = engine, strategy
        self.profile, self.shapes, self.addresses, self.device_memory_set = None, {}, {}, False
        self.executions = 0

    def set_device_memory(self, memory: int, size: int) -> None:
        self.device_memory_set = memory in heap and size >= self.engine.device_memory_size_v2

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        self.profile = profile_index if 0 <= profile_index < len(self.engine.profiles) else None
        return self.profile is not None

    def set_input_shape(self, name: str, shape: tuple) -> bool:
        lo, _, hi = self.engine.profiles[self.profile][name]
        ok = len(shape) == len(lo) and all(a <= s <= b for a, s, b in zip(lo, shape, hi))
        if ok:
            self.shapes[name] = tuple(shape)
        return ok

    def set_tensor_address(self, name: str, memory: int) -> bool:
        self.addresses[name] = memory
        return at(memory, (1,), np.uint8) is not None

    def get_tensor_shape(self, name: str) -> tuple:
        symbols = {}
        for inp in self.engine.session.get_inputs():
            for dim, size in zip(inp.shape, self.shapes[inp.name]):
                if isinstance(dim, str):
                    symbols.setdefault(dim, size)
        return tuple(symbols[d] if isinstance(d, str) else d for d in self.engine.io[name][1].shape)

    def execute_async_v3(self, stream_handle: int) -> bool:
        if self.strategy == ExecutionContextAllocationStrategy.USER_MANAGED and not self.device_memory_set:
            return False
        inputs = self.engine.session.get_inputs()
        if any(i.name not in self.shapes for i in inputs):
            return False
        feeds = {i.name: at(self.addresses[i.name], self.shapes[i.name], ORT_TYPES[i.type]) for i in inputs}
        if any(v is None for v in feeds.values()):
            return False
        outs = self.engine.session.run(None, feeds)
        for o, value in zip(self.engine.session.get_outputs(), outs):
            np.copyto(at(self.addresses[o.name], value.shape, value.dtype), value)
        self.executions += 1
        return True


class HostDevice:
    """A `PointerDevice` on the host for the fake engines: numpy arrays registered in `heap`
    by address; `capture` records the body and re-runs it (no graph)."""

    id = 0
    info = GpuInfo("fake GPU", (9, 0))
    name = "host (fake device)"
    stream_handle = 0

    def zeros(self, shape: tuple, dtype: Any) -> np.ndarray:
        a = np.zeros(shape, dtype)
        heap[self.address(a)] = a
        return a

    def address(self, a: np.ndarray) -> int:
        return a.__array_interface__["data"][0]

    def upload(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def download(self, src: np.ndarray) -> np.ndarray:
        return src.copy()

    def write_rows(self, cache: np.ndarray, rows: np.ndarray, positions: np.ndarray) -> None:
        n = rows.shape[2]
        for b in range(rows.shape[0]):
            cache[b][:, positions[b, :n]] = rows[b]

    def compute(self, fn: Callable[..., Any], *args: Any) -> np.ndarray:
        return np.asarray(fn(np, *(np.asarray(a) for a in args)))

    def capture(self, body: Callable[[], dict]) -> tuple[Callable[[], None], dict]:
        outputs = body()

        def rerun() -> None:
            for name, value in body().items():
                np.copyto(outputs[name], value)

        return rerun, outputs
