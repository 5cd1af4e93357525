"""The hardware-aware prefix scheduler (dspark.md §5, Algorithm 1) and its asynchronous variant.

Items (r, j) are visited in descending survival probability a_{r,j}, ties broken by the
smaller j (so each request's admitted slots form a prefix: a_{r,j} is non-increasing in
j) and then by the smaller slot index r."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..calibration import Calibration
from ..throughput import CostModel
from .base import History


def visit_order(a: np.ndarray) -> np.ndarray:
    """a [R, γ] -> flat indices r·γ + j in admission order: a descending, then j, then r."""
    R, gamma = a.shape
    r, j = np.divmod(np.arange(R * gamma), gamma)
    return np.lexsort((r, j, -a.ravel()))


def admit(a: np.ndarray, cost: CostModel, early_stop: bool = True) -> np.ndarray:
    """Algorithm 1: a [R, γ] -> ℓ [R]. Start from ℓ = 0 (B = R, τ = R); admitting (r, j) sets
    ℓ_r = j (1-based) and τ = R + Σ_r Σ_{j'≤ℓ_r} a_{r,j'}; an admission is kept when Θ improves.
    With `early_stop` the first non-improving item ends the search, which keeps decoding
    lossless; without it the search goes on (biased: dspark.md §5's counterexample)."""
    R, gamma = a.shape
    ells = np.zeros(R, np.int64)
    tau = float(R)
    best = cost.theta(tau, ells)
    for flat in visit_order(a):
        r, j = divmod(int(flat), gamma)
        old = ells[r]  # <= j: a row's items come in order of j
        ells[r] = j + 1
        gain = float(a[r, old:j + 1].sum())
        theta = cost.theta(tau + gain, ells)
        if theta > best:
            best, tau = theta, tau + gain
        else:
            ells[r] = old
            if early_stop:
                break
    return ells


def top_k(a: np.ndarray, k: int) -> np.ndarray:
    """The k first items in admission order, as lengths ℓ [R] (prefixes by construction)."""
    R, gamma = a.shape
    return np.bincount(visit_order(a)[:k] // gamma, minlength=R).astype(np.int64)


def capacity(a: np.ndarray, cost: CostModel) -> int:
    """The number of items K whose top-K admission maximises Θ over every K (a global search)."""
    R, gamma = a.shape
    ells = np.zeros(R, np.int64)
    tau = float(R)
    best, best_k = cost.theta(tau, ells), 0
    for k, flat in enumerate(visit_order(a), start=1):
        r = int(flat) // gamma
        tau += float(a.ravel()[flat])
        ells[r] += 1
        theta = cost.theta(tau, ells)
        if theta > best:
            best, best_k = theta, k
    return best_k


@dataclass(frozen=True)
class PrefixScheduler:
    """Algorithm 1 with the causal early stop, on calibrated survival probabilities.

    skip_drafting (beyond the paper): before drafting, predict Θ of a drafted step from the
    previous drafted step's confidences and skip the drafter (one target token per request)
    when the target alone is predicted faster. A drafted step (a probe) refreshes the
    prediction after `probe_every` times the drafter's cost in target steps (at least one step),
    so that probing costs about 1/probe_every of the steps it interrupts: every 2 steps for a
    drafter pass of a fifth of a step, every 9 for one of 1.1 steps. The interval doubles with
    every probe in a row that predicts no gain, up to 2**max_backoff times, so that a large
    batch where drafting never pays spends little on probes. Decided from older steps only:
    lossless."""

    calibration: Calibration
    cost: CostModel
    early_stop: bool = True
    skip_drafting: bool = False
    probe_every: int = 8
    max_backoff: int = 4
    name: str = "prefix"

    def probe_interval(self, history: History, rows: int) -> int:
        """Skipped steps before the next probe."""
        drafter_in_steps = self.cost.sps.draft_time(rows) * self.cost.sps.rate(rows, 1)
        base = max(1, math.ceil(self.probe_every * drafter_in_steps))
        return base << min(max(history.failed_probes - 1, 0), self.max_backoff)

    def should_draft(self, history: History, rows: int) -> bool:
        if not self.skip_drafting or not history.confidences:
            return True
        if history.undrafted:  # no newer information than when skipping began: wait for the probe
            return history.undrafted >= self.probe_interval(history, rows)
        a = self.calibration.survival(history.confidences[-1])  # [R_old, γ]
        ells = admit(a, self.cost)
        tau = len(a) + sum(float(a[r, :e].sum()) for r, e in enumerate(ells))
        pays = self.cost.theta(tau, ells) > self.cost.theta_alone(len(a))
        history.failed_probes = 0 if pays else history.failed_probes + 1
        return pays

    def lengths(self, confidence_logits: np.ndarray, history: History) -> np.ndarray:
        return admit(self.calibration.survival(confidence_logits), self.cost, self.early_stop)


@dataclass(frozen=True)
class AsyncPrefixScheduler:
    """The production variant: the batch capacity K (draft tokens admitted) is searched globally
    on the confidences of two drafted steps ago, so it is known before the current step and
    cannot depend on its drafts; the current step admits the top-K current items. Until two
    steps of history exist it falls back to Algorithm 1 with the early stop."""

    calibration: Calibration
    cost: CostModel
    name = "async"

    def should_draft(self, history: History, rows: int) -> bool:
        return True

    def lengths(self, confidence_logits: np.ndarray, history: History) -> np.ndarray:
        a = self.calibration.survival(confidence_logits)
        if len(history.confidences) < 2:
            return admit(a, self.cost)
        return top_k(a, capacity(self.calibration.survival(history.confidences[-2]), self.cost))
