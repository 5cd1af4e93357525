"""The static schedulers: every draft verified (DeepSpec's Table-1 setting), or up to the first
raw confidence below a threshold (DeepSpec's only control)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ..sampling import sigmoid
from .base import History


@dataclass(frozen=True)
class FixedLength:
    """Verify every drafted slot (ℓ = γ): DeepSpec's Table-1 setting."""

    name = "fixed"

    def should_draft(self, history: History, rows: int) -> bool:
        return True

    def lengths(self, confidence_logits: np.ndarray, history: History) -> np.ndarray:
        R, gamma = confidence_logits.shape
        return np.full(R, gamma, np.int64)


@dataclass(frozen=True)
class StaticThreshold:
    """Verify up to the first slot whose raw confidence sigmoid(c_k) is below `threshold`."""

    threshold: float
    name = "threshold"

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise InputError(f"confidence threshold is {self.threshold}, expected a value in [0, 1]")

    def should_draft(self, history: History, rows: int) -> bool:
        return True

    def lengths(self, confidence_logits: np.ndarray, history: History) -> np.ndarray:
        below = sigmoid(confidence_logits) < self.threshold  # [R, γ]
        return np.where(below.any(1), below.argmax(1), below.shape[1]).astype(np.int64)
