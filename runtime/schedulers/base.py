"""What every verification-length scheduler sees and answers: how many drafted slots ℓ_r ∈ {0..γ}
each request verifies.

Every scheduler here decides whether slot k of request r is verified from information
available before d_{r,k} is sampled (c_{r,1..k} depend on d_{r,1..k-1} only; other
requests' drafts are independent of it), which is what keeps decoding lossless
(dspark.md §5). `should_draft` is asked before the drafter runs, so it can only use
older steps."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class History:
    """What the loop remembers for the schedulers, owned by one `EngineCore`."""

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
