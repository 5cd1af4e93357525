"""Verification-length schedulers: how many drafted slots ℓ_r ∈ {0..γ} each request verifies.

Every scheduler here decides whether slot k of request r is verified from information
available before d_{r,k} is sampled (c_{r,1..k} depend on d_{r,1..k-1} only; other
requests' drafts are independent of it), which is what keeps decoding lossless
(dspark.md §5). `should_draft` is asked before the drafter runs, so it can only use
older steps. The Algorithm-1 schedulers are in `prefix.py`."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .errors import InputError


@dataclass
class History:
    """What the loop remembers for the schedulers, owned by one `generate_batch` call."""

    confidences: deque  # raw confidence logits [R_t, γ] of the last drafted steps, oldest first
    undrafted: int = 0  # steps run without drafting since the last drafted one
    failed_probes: int = 0  # drafted steps in a row after which drafting was predicted not to pay


class Scheduler(Protocol):
    name: str

    def should_draft(self, history: History, rows: int) -> bool:
        """Whether to run the drafter this step at all (else every request gets one target token)."""
        ...

    def lengths(self, confidence_logits: np.ndarray, history: History) -> np.ndarray:
        """confidence_logits [R, γ] of the active requests in slot order -> ℓ [R] int."""
        ...


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) in float64, without overflow for large |x|."""
    return np.exp(-np.logaddexp(0.0, -np.asarray(x, np.float64)))


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
