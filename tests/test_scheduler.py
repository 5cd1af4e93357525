"""The prefix scheduler (dspark.md §5): Θ from the SPS table as written, Algorithm 1's
admission order and prefixes, the causal early stop on the worked counterexample, the
asynchronous variant and the drafter-skipping gate. Numpy only, no models."""
from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from rules import accept_probability, residual

from dspark.runtime import (AsyncPrefixScheduler, Calibration, CostModel, PrefixScheduler, Request, SamplingParams,
                            SpsTable, generate_batch)
from dspark.runtime.backends import Draft, StepBatch, Verdict
from dspark.runtime.backends.base import verify_on_host
from dspark.runtime.schedulers.prefix import admit, capacity, top_k, visit_order
from dspark.runtime.schedulers import History


def history(*confidences: np.ndarray, undrafted: int = 0) -> History:
    return History(deque(confidences, maxlen=2), undrafted)


def logit(p: float) -> float:
    return float(np.log(p / (1 - p)))


def random_survival(rng: np.random.Generator, R: int, gamma: int) -> np.ndarray:
    """a [R, γ] with ties: some c_k exactly 1 (a_{r,j} = a_{r,j+1}), values repeated across rows."""
    c = rng.choice([1.0, 0.9, 0.75, 0.5, 0.3], size=(R, gamma))
    return np.cumprod(c, axis=1)


def random_table(rng: np.random.Generator, n: int) -> SpsTable:
    """A jagged but mostly falling SPS curve, and a grid over R ≤ 4 rows of S ≤ 5 tokens."""
    sps = tuple(float(v) for v in np.maximum.accumulate(rng.uniform(0.5, 1.5, n))[::-1] / np.arange(1, n + 1) ** 0.5)
    grid = tuple(tuple(float(sps[min(r * s, n) - 1] * rng.uniform(0.8, 1.2)) for s in range(1, 6)) for r in range(1, 5))
    return SpsTable(sps, (0.05, 0.06, 0.07, 0.08), grid)


# --- Θ exactly as written ---------------------------------------------------------------------------

def algorithm_1(a: np.ndarray, sps) -> list[int]:
    """dspark.md §5, transcribed literally: start with ℓ_r = 0, B = R, τ = R, Θ_best = R·SPS(R);
    visit all (r, j) in descending a_{r,j} (ties: smaller j); admitting one sets ℓ_r = j, B += 1,
    τ += a_{r,j}; keep it if Θ improves, otherwise stop at once."""
    R, gamma = a.shape
    ell, B, tau = [0] * R, R, float(R)
    best = R * sps(R)
    items = sorted(((a[r, j], j + 1, r) for r in range(R) for j in range(gamma)), key=lambda t: (-t[0], t[1], t[2]))
    for value, j, r in items:
        if (tau + value) * sps(B + 1) > best:
            ell[r], B, tau, best = j, B + 1, tau + value, (tau + value) * sps(B + 1)
        else:
            break
    return ell


def test_theta_is_tau_times_sps_of_batch_tokens():
    table = SpsTable((1.0, 0.8, 0.7, 0.5, 0.45, 0.4, 0.3, 0.2))
    cost = CostModel(table, padded=False)
    a = np.array([[0.9, 0.6, 0.2], [0.5, 0.4, 0.1]])
    for ells in ([0, 0], [1, 0], [2, 1], [3, 3]):
        ells = np.array(ells)
        tau = 2 + sum(a[r, :e].sum() for r, e in enumerate(ells))  # Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j})
        B = int(sum(1 + e for e in ells))  # Σ_r (1 + ℓ_r)
        assert cost.theta(tau, ells) == tau * table.sps[B - 1]
    assert table(20) == pytest.approx(0.2 * 8 / 20)  # past the table: cost in proportion to B


def test_algorithm_1_matches_the_text():
    rng = np.random.default_rng(0)
    for trial in range(300):
        R, gamma = int(rng.integers(1, 5)), int(rng.integers(1, 6))
        a, table = random_survival(rng, R, gamma), random_table(rng, 24)
        assert admit(a, CostModel(table, padded=False)).tolist() == algorithm_1(a, table), f"trial {trial}"


def test_padded_cost_is_what_the_engine_runs():
    table = SpsTable((1.0, 0.9, 0.8, 0.7, 0.6, 0.5), grid=((1.0, 0.9, 0.8), (0.95, 0.6, 0.4)))
    cost = CostModel(table)
    assert cost.steps_per_s(np.array([2, 0])) == 0.4  # 2 rows of 1 + max ℓ = 3 tokens: the grid
    assert cost.steps_per_s(np.array([1, 1, 1])) == table(6)  # 3 rows x 2 tokens: off the grid, SPS(6)
    # a second draft in a row that is already padded to it costs nothing more
    assert cost.theta(3.0, np.array([2, 2])) == cost.theta(3.0, np.array([2, 0]))


# --- prefixes -----------------------------------------------------------------------------------------

def admitted_items(a: np.ndarray, ells: np.ndarray) -> set[int]:
    R, gamma = a.shape
    return {r * gamma + j for r in range(R) for j in range(ells[r])}


@pytest.mark.parametrize("padded", [True, False])
def test_admitted_lengths_are_prefixes_of_the_visit_order(padded):
    rng = np.random.default_rng(1)
    kinds = set()
    for _ in range(300):
        R, gamma = int(rng.integers(1, 5)), int(rng.integers(1, 6))
        a, table = random_survival(rng, R, gamma), random_table(rng, 24)
        cost = CostModel(table, padded=padded)
        order = [int(i) for i in visit_order(a)]
        for r in range(R):  # a row's items are visited in order of j
            js = [i % gamma for i in order if i // gamma == r]
            assert js == sorted(js)
        ells = admit(a, cost)  # early stop: the admitted items are the first m visited
        assert admitted_items(a, ells) == set(order[:int(ells.sum())])
        k = int(rng.integers(0, R * gamma + 1))
        assert admitted_items(a, top_k(a, k)) == set(order[:k])
        full = admit(a, cost, early_stop=False)
        assert (full >= ells).all() and (full <= gamma).all()
        kinds.add(len(set(ells.tolist())))
    assert max(kinds) > 1, "the random cases should give rows different lengths"


# --- the worked counterexample -----------------------------------------------------------------------

SPS_EXAMPLE = SpsTable((1.0, 0.5, 0.45))
P_T, P_D = np.array([0.7, 0.3]), np.array([0.5, 0.5])
C2 = {0: 0.9, 1: 0.0}  # c_2 given d_1 = A (0) or B (1)


def example_scheduler(early_stop: bool) -> PrefixScheduler:
    return PrefixScheduler(Calibration.identity(2), CostModel(SPS_EXAMPLE, padded=False), early_stop=early_stop)


def example_confidences(d1: int) -> np.ndarray:
    return np.array([[logit(0.8), logit(C2[d1]) if C2[d1] > 0 else -60.0]])


def first_token_distribution(early_stop: bool) -> np.ndarray:
    """Exact distribution of the first emitted token, enumerated over d_1 with the runtime's
    scheduler and acceptance rule."""
    sched, out = example_scheduler(early_stop), np.zeros(2)
    for d1 in (0, 1):
        ell = int(sched.lengths(example_confidences(d1), history())[0])
        if ell == 0:
            out += P_D[d1] * P_T
            continue
        acc = accept_probability(P_T, P_D, d1)
        out[d1] += P_D[d1] * acc
        out += P_D[d1] * (1 - acc) * residual(P_T, P_D)
    return out


def test_counterexample_exact():
    assert example_scheduler(True).cost.theta(1.8, np.array([1])) == pytest.approx(0.9)  # Θ_1 < Θ_0 = 1
    np.testing.assert_allclose(first_token_distribution(early_stop=True), [0.7, 0.3], atol=1e-12)
    np.testing.assert_allclose(first_token_distribution(early_stop=False), [0.85, 0.15], atol=1e-12)


class ExampleBackend:
    """The counterexample as a backend: V = {A, B}, γ = 2, p_t = (0.7, 0.3) everywhere,
    p_d = (0.5, 0.5), c_1 = 0.8 and c_2 = 0.9 after A, 0 after B."""

    block_size, vocab_size, max_seq, slots = 2, 2, 64, 1
    accepts_on_device, drafter_graph, on_run = False, "fp32", None

    def prefill(self, slot, tokens, ingest):
        return np.log(P_T), np.zeros((1, 1), np.float32)

    def target(self, tokens, starts):
        B, S = tokens.shape
        return np.broadcast_to(np.log(P_T), (B, S, 2)).copy(), np.zeros((B, S, 1), np.float32)

    def draft(self, batch: StepBatch) -> Draft:
        tokens = (batch.draft_uniforms >= 0.5).astype(np.int64)  # inverse CDF of (0.5, 0.5)
        conf = np.concatenate([example_confidences(int(d[0])) for d in tokens])
        return Draft(tokens, np.full(tokens.shape + (2,), 0.5), conf)

    def verify(self, batch: StepBatch, draft: Draft) -> Verdict:
        return verify_on_host(self, batch, draft)


@pytest.mark.parametrize("early_stop,expected", [(True, 0.7), (False, 0.85)])
def test_counterexample_through_the_loop(early_stop, expected):
    n = 4000
    requests = [Request([0], SamplingParams(1.0, 4, seed)) for seed in range(n)]
    gens = generate_batch(ExampleBackend(), requests, example_scheduler(early_stop))
    p_a = np.mean([g.token_ids[1] == 0 for g in gens])  # token_ids[0] comes from prefill
    assert abs(p_a - expected) < 4 * np.sqrt(expected * (1 - expected) / n), f"P(A) = {p_a:.4f}"


# --- the asynchronous variant and the drafter gate -----------------------------------------------------

def test_async_capacity_comes_from_two_steps_ago():
    rng = np.random.default_rng(2)
    table = random_table(rng, 24)
    cal = Calibration((1.0, 0.7, 1.3))
    sched = AsyncPrefixScheduler(cal, CostModel(table))
    for _ in range(100):
        old2, old1, now = (rng.normal(0, 2, size=(int(rng.integers(1, 5)), 3)) for _ in range(3))
        k = capacity(cal.survival(old2), CostModel(table))
        got = sched.lengths(now, history(old2, old1))
        assert got.tolist() == top_k(cal.survival(now), k).tolist()
        other = rng.normal(0, 2, size=old1.shape)  # the step before does not matter
        assert sched.lengths(now, history(old2, other)).tolist() == got.tolist()
    first = rng.normal(0, 2, size=(3, 3))  # without two steps of history: Algorithm 1
    assert sched.lengths(first, history()).tolist() == admit(cal.survival(first), CostModel(table)).tolist()


def test_capacity_is_a_global_search():
    """A jagged curve: one draft does not pay, two do. The early stop stops at the first;
    the global capacity search finds the second."""
    table = SpsTable((1.0, 0.5, 0.9))
    a = np.array([[0.95, 0.9]])
    cost = CostModel(table, padded=False)
    assert admit(a, cost).tolist() == [0]
    assert capacity(a, cost) == 2


def test_drafter_gate_uses_only_older_steps():
    cal = Calibration.identity(3)
    slow = CostModel(SpsTable((1.0, 0.9, 0.85, 0.8), (0.5,)), drafter=True)  # a drafter pass: half a step
    fast = CostModel(SpsTable((1.0, 0.99, 0.98, 0.97), (0.001,)), drafter=True)
    weak, strong = np.full((1, 3), -3.0), np.full((1, 3), 4.0)
    gate = PrefixScheduler(cal, slow, skip_drafting=True, probe_every=4)
    assert gate.should_draft(history(), 1)  # nothing known yet: draft
    assert not gate.should_draft(history(weak), 1)  # weak drafts and a dear drafter: target alone
    assert gate.should_draft(history(weak, undrafted=4), 1)  # a probe, to refresh the estimate
    assert PrefixScheduler(cal, fast, skip_drafting=True).should_draft(history(strong), 1)
    assert PrefixScheduler(cal, slow).should_draft(history(weak), 1)  # gate off


def test_drafter_gate_backs_off_while_drafting_does_not_pay():
    """Probes come after 4, 8, 16, 16 skipped steps while each predicts no gain (a drafter
    pass costs half a step, probe_every 8: a base interval of 4); one that predicts a gain
    resets the interval. The base interval follows the drafter's cost in steps."""
    cal = Calibration.identity(3)
    slow = CostModel(SpsTable((1.0, 0.9, 0.85, 0.8), (0.5,)), drafter=True)
    gate = PrefixScheduler(cal, slow, skip_drafting=True, probe_every=8, max_backoff=2)
    h = history(np.full((1, 3), -3.0))

    intervals = []
    for _ in range(4):
        assert not gate.should_draft(h, 1)
        n = 1
        h.undrafted = n
        while not gate.should_draft(h, 1):
            n += 1
            h.undrafted = n
        intervals.append(n)
        h.undrafted = 0  # the probe drafted
    assert intervals == [4, 8, 16, 16]
    h.confidences.append(np.full((1, 3), 8.0))  # the probe's drafts were strong
    assert gate.should_draft(h, 1) and h.failed_probes == 0
    dear = CostModel(SpsTable((1.0, 0.9, 0.85, 0.8), (2.5,)), drafter=True)  # a pass: 2.5 steps
    assert PrefixScheduler(cal, dear, skip_drafting=True, probe_every=4).probe_interval(h, 1) == 10
    cheap = CostModel(SpsTable((1.0, 0.9, 0.85, 0.8), (0.01,)), drafter=True)
    assert PrefixScheduler(cal, cheap, skip_drafting=True).probe_interval(h, 1) == 1
