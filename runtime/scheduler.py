"""Verification-length schedulers: how many drafted slots ℓ ∈ {0..γ} to verify.

Every scheduler here decides whether slot k is verified from information available
before d_k is sampled (the confidences c_1..c_k depend on d_1..d_{k-1} only), which
is what keeps decoding lossless (dspark.md §5)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InputError


@dataclass(frozen=True)
class FixedLength:
    """Verify every drafted slot (ℓ = γ): DeepSpec's Table-1 setting."""

    name = "fixed"

    def length(self, confidence_logits: np.ndarray) -> int:
        return len(confidence_logits)


@dataclass(frozen=True)
class StaticThreshold:
    """Verify up to the first slot whose raw confidence sigmoid(c_k) is below `threshold`."""

    threshold: float
    name = "threshold"

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise InputError(f"confidence threshold is {self.threshold}, expected a value in [0, 1]")

    def length(self, confidence_logits: np.ndarray) -> int:
        c = 1.0 / (1.0 + np.exp(-confidence_logits.astype(np.float64)))
        below = np.nonzero(c < self.threshold)[0]
        return int(below[0]) if len(below) else len(c)


Scheduler = FixedLength | StaticThreshold
