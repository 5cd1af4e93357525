"""Greedy identity "in the floating-point sense" (dspark.md §1).

Two greedy decodes of the same model are identical up to the first position where the
reference's top-2 logit gap is below `eps`; a split at a larger gap is a bug."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

NEAR_TIE = 1e-3


@dataclass(frozen=True)
class GreedyMatch:
    ok: bool
    diverged_at: int | None  # index into the generated tokens, None when identical
    gap: float | None  # the reference's top-2 logit gap at that index

    def __str__(self) -> str:
        if self.diverged_at is None:
            return "identical"
        if self.gap is None:
            return f"lengths differ after {self.diverged_at} identical tokens"
        verdict = "near-tie, allowed" if self.ok else "BUG: not a near-tie"
        return f"diverged at generated token {self.diverged_at} (top-2 gap {self.gap:.2e}: {verdict})"


def top2_gap(logits: np.ndarray) -> float:
    """logits [V] -> largest minus second largest."""
    top = np.partition(logits.astype(np.float64), -2)[-2:]
    return float(top[1] - top[0])


def greedy_match(reference: Sequence[int], candidate: Sequence[int], reference_logits: np.ndarray,
                 eps: float = NEAR_TIE) -> GreedyMatch:
    """reference_logits [len(reference), V]: the logits that produced each reference token.

    A candidate that is a prefix of the reference (or vice versa) counts as identical
    only if both stopped for a reason; compare equal budgets."""
    for i, (r, c) in enumerate(zip(reference, candidate)):
        if r != c:
            gap = top2_gap(reference_logits[i])
            return GreedyMatch(gap < eps, i, gap)
    if len(reference) != len(candidate):
        return GreedyMatch(False, min(len(reference), len(candidate)), None)
    return GreedyMatch(True, None, None)
