"""Typed errors. Every error the runtime raises for bad input is a `DSparkError`,
so a service embedding the runtime can catch one type and keep serving."""


class DSparkError(Exception):
    """Base class of every error raised for bad input or a bad artifact."""


class ConfigError(DSparkError):
    """A model or drafter configuration is invalid or disagrees with another."""


class CheckpointError(DSparkError):
    """A checkpoint is missing weights, or holds weights of the wrong shape."""


class BundleError(DSparkError):
    """A bundle is missing, corrupt, or was made by another exporter or model."""


class InputError(DSparkError):
    """A request is invalid: prompt too long, bad sampling values, and so on."""


class BackendError(DSparkError):
    """A backend cannot run here: no GPU, a package it needs is missing, an engine was built
    for another TensorRT version or GPU, or the GPU lacks the requested precision."""


def mismatch(what: str, field: str, expected: object, got: object) -> str:
    """One message naming the field and both values."""
    return f"{what}: {field} is {got!r}, expected {expected!r}"
