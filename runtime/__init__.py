"""dspark.runtime: the lean runtime (numpy + an engine backend; never torch, never dspark.export).

The core: `Engine` (engine.py) over the step-wise `EngineCore` (core.py), the backends
(backends/), the schedulers (schedulers/), sampling and the acceptance rule (sampling.py).
The commands live in `dspark.runtime.tools`."""
from .errors import BackendError, BundleError, CheckpointError, ConfigError, DSparkError, InputError
from .calibration import Calibration
from .core import (EngineCore, EngineFullError, Generation, Request, RequestOutput, UnknownRequestError, generate,
                   generate_batch)
from .request import SamplingParams, Stats
from .schedulers import AsyncPrefixScheduler, FixedLength, PrefixScheduler, StaticThreshold, make_scheduler
from .throughput import CostModel, SpsTable

__all__ = ["BackendError", "BundleError", "CheckpointError", "ConfigError", "DSparkError", "InputError",
           "EngineCore", "EngineFullError", "UnknownRequestError", "RequestOutput", "Generation", "Request",
           "SamplingParams", "Stats", "generate", "generate_batch", "FixedLength", "StaticThreshold",
           "PrefixScheduler", "AsyncPrefixScheduler", "make_scheduler", "Calibration", "CostModel", "SpsTable",
           "Engine", "Result", "AsyncEngine", "EngineError", "StreamOutput", "EngineState"]


def __getattr__(name: str):
    """`Engine` and `Result` (`from dspark.runtime import Engine`), and the `AsyncEngine` a server
    drives (async_engine.py), imported on first use so that `import dspark.runtime` stays light for
    the export side (no onnxruntime or tokenizers import)."""
    if name in ("Engine", "Result"):
        from . import engine

        return getattr(engine, name)
    if name in ("AsyncEngine", "EngineError", "StreamOutput", "EngineState"):
        from . import async_engine

        return getattr(async_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
