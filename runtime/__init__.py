"""dspark.runtime: the lean runtime (numpy + an engine backend; never torch)."""
from .errors import BackendError, BundleError, CheckpointError, ConfigError, DSparkError, InputError
from .calibration import Calibration
from .generate import Generation, Request, SamplingParams, Stats, generate, generate_batch
from .prefix import AsyncPrefixScheduler, PrefixScheduler
from .scheduler import FixedLength, StaticThreshold
from .throughput import CostModel, SpsTable

__all__ = ["BackendError", "BundleError", "CheckpointError", "ConfigError", "DSparkError", "InputError", "Generation",
           "Request", "SamplingParams", "Stats", "generate", "generate_batch", "FixedLength", "StaticThreshold",
           "PrefixScheduler", "AsyncPrefixScheduler", "Calibration", "CostModel", "SpsTable", "Engine", "Result"]


def __getattr__(name: str):
    """`Engine` and `Result` (README: `from dspark.runtime import Engine`), imported on first use so
    that `import dspark.runtime` stays light for the export side (no onnxruntime import)."""
    if name in ("Engine", "Result"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
