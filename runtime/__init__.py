"""dspark.runtime: the lean runtime (numpy + an engine backend; never torch)."""
from .errors import BundleError, CheckpointError, ConfigError, DSparkError, InputError
from .generate import Generation, SamplingParams, Stats, generate
from .scheduler import FixedLength, StaticThreshold

__all__ = ["BundleError", "CheckpointError", "ConfigError", "DSparkError", "InputError", "Generation",
           "SamplingParams", "Stats", "generate", "FixedLength", "StaticThreshold"]
