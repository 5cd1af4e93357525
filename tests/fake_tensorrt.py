"""A FAKE of the `tensorrt` module, for unit tests of dspark.runtime.trt.build on machines
without TensorRT. It is NOT TensorRT and proves nothing about TensorRT: it implements the
few calls the builder makes, records them, and checks what TensorRT would refuse for our
inputs: every network input (read from the ONNX file with `onnx`) needs a shape in every
optimization profile, of the graph's rank, equal to the graph's static dims, with
min <= opt <= max. A "plan" is JSON describing the build."""
from __future__ import annotations

import json
from types import SimpleNamespace

import onnx

__version__ = "10.99.0-fake"
NetworkDefinitionCreationFlag = SimpleNamespace(STRONGLY_TYPED=1)
MemoryPoolType = SimpleNamespace(WORKSPACE="workspace")
BuilderFlag = SimpleNamespace(TF32="tf32", FP16="fp16", BF16="bf16")
calls: list[tuple] = []  # every recorded call, in order; tests clear it


class Logger:
    WARNING = 2

    def __init__(self, level: int = 2):
        self.level = level


class TimingCache:
    def __init__(self, blob: bytes):
        self.blob = blob

    def serialize(self) -> bytes:
        builds = json.loads(self.blob or b'{"builds": 0}')["builds"]
        return json.dumps({"builds": builds + 1}).encode()


class OptimizationProfile:
    def __init__(self):
        self.shapes: dict[str, tuple] = {}

    def set_shape(self, name, lo, opt, hi) -> None:
        self.shapes[name] = (tuple(lo), tuple(opt), tuple(hi))


class BuilderConfig:
    def __init__(self):
        self.flags = {BuilderFlag.TF32}  # TensorRT enables TF32 by default
        self.profiles: list[OptimizationProfile] = []
        self.cache: TimingCache | None = None
        self.pools: dict = {}

    def set_memory_pool_limit(self, pool, size: int) -> None:
        self.pools[pool] = size

    def clear_flag(self, flag) -> None:
        self.flags.discard(flag)

    def create_timing_cache(self, blob: bytes) -> TimingCache:
        calls.append(("create_timing_cache", bytes(blob)))
        return TimingCache(bytes(blob))

    def set_timing_cache(self, cache: TimingCache, ignore_mismatch: bool) -> bool:
        self.cache = cache
        return True

    def get_timing_cache(self) -> TimingCache:
        return self.cache

    def add_optimization_profile(self, profile: OptimizationProfile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1


class Network:
    def __init__(self, flags: int):
        self.flags = flags
        self.inputs: dict[str, tuple] = {}  # name -> dims, -1 where dynamic


class OnnxParser:
    def __init__(self, network: Network, logger: Logger):
        self.network, self.errors = network, []

    def parse_from_file(self, path: str) -> bool:
        calls.append(("parse_from_file", path))
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

    def get_error(self, i: int) -> str:
        return self.errors[i]


class Builder:
    def __init__(self, logger: Logger):
        self.logger = logger

    def create_network(self, flags: int) -> Network:
        return Network(flags)

    def create_builder_config(self) -> BuilderConfig:
        return BuilderConfig()

    def create_optimization_profile(self) -> OptimizationProfile:
        return OptimizationProfile()

    def build_serialized_network(self, network: Network, config: BuilderConfig) -> bytes | None:
        calls.append(("build", network, config))
        if not network.flags & (1 << NetworkDefinitionCreationFlag.STRONGLY_TYPED) or not config.profiles:
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
        return json.dumps({"fake_plan": True, "inputs": sorted(network.inputs), "tf32": BuilderFlag.TF32 in config.flags,
                           "profiles": [p.shapes for p in config.profiles]}).encode()
