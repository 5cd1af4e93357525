"""The acceptance rule of dspark.md §1 step 7, tested exactly (no sampling).

One verification slot emits the draft d (drawn from p_d) if it is accepted, else one
token from the residual. Its output distribution,
    P(x) = p_d(x)·accept(x) + [Σ_d p_d(d)·(1 - accept(d))]·residual(x),
must be p_t exactly, for any p_d."""
from __future__ import annotations

import math

import numpy as np
import pytest

from rules import accept_probability, residual, sample_from, sample_token, softmax, verify

from dspark.runtime import SamplingParams
from dspark.runtime.errors import InputError

V = 6


def one_slot_output(p_t: np.ndarray, p_d: np.ndarray) -> np.ndarray:
    """Exact distribution of the token one verification slot emits."""
    accept = np.array([accept_probability(p_t, p_d, d) for d in range(len(p_t))])
    r = residual(p_t, p_d)
    return p_d * accept + np.sum(p_d * (1.0 - accept)) * r / r.sum()


def _pairs() -> list[tuple[str, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1234)

    def dirichlet(alpha: float) -> np.ndarray:
        return rng.dirichlet(np.full(V, alpha))

    def with_zeros(p: np.ndarray, idx: list[int]) -> np.ndarray:
        p = p.copy()
        p[idx] = 0.0
        return p / p.sum()

    pairs = []
    for i in range(6):
        pairs.append((f"random{i}", dirichlet(1.0), dirichlet(1.0)))
    for i in range(3):
        pairs.append((f"peaked{i}", dirichlet(0.2), dirichlet(0.2)))
    p_t = dirichlet(1.0)
    pairs.append(("p_d zero where p_t > 0", p_t, with_zeros(dirichlet(1.0), [0, 3])))
    pairs.append(("p_t zero where p_d > 0", with_zeros(dirichlet(1.0), [1, 4]), dirichlet(1.0)))
    pairs.append(("disjoint supports", with_zeros(dirichlet(1.0), [0, 1, 2]), with_zeros(dirichlet(1.0), [3, 4, 5])))
    pairs.append(("p_d == p_t", p_t, p_t.copy()))
    pairs.append(("one-hot p_d", p_t, np.eye(V)[2]))
    pairs.append(("one-hot p_d on a p_t zero", with_zeros(p_t, [5]), np.eye(V)[5]))
    pairs.append(("one-hot p_t", np.eye(V)[4], dirichlet(1.0)))
    pairs.append(("uniform p_d", p_t, np.full(V, 1.0 / V)))
    return pairs


PAIRS = _pairs()


@pytest.mark.parametrize("name,p_t,p_d", PAIRS, ids=[p[0] for p in PAIRS])
def test_one_slot_emits_exactly_p_t(name, p_t, p_d):
    assert abs(p_t.sum() - 1) < 1e-15 and abs(p_d.sum() - 1) < 1e-15
    np.testing.assert_allclose(one_slot_output(p_t, p_d), p_t, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name,p_t,p_d", PAIRS, ids=[p[0] for p in PAIRS])
def test_rule_pieces(name, p_t, p_d):
    for d in range(V):
        a = accept_probability(p_t, p_d, d)
        assert 0.0 <= a <= 1.0
        if p_d[d] > 0:
            assert a == pytest.approx(min(1.0, p_t[d] / p_d[d]), rel=1e-15)
    r = residual(p_t, p_d)
    assert np.all(r >= 0) and r.sum() == pytest.approx(1.0, abs=1e-12)
    # the rejection mass equals the residual's mass (both are TV(p_t, p_d))
    reject = sum(p_d[d] * (1 - accept_probability(p_t, p_d, d)) for d in range(V))
    assert reject == pytest.approx(0.5 * np.abs(p_t - p_d).sum(), abs=1e-12)
    if reject > 1e-8:
        np.testing.assert_allclose(r, np.maximum(p_t - p_d, 0) / np.maximum(p_t - p_d, 0).sum(), atol=1e-15)
        assert np.all(r[p_t <= p_d] == 0)  # never emits a token the draft already over-covers


def test_guards():
    p_t = np.array([0.5, 0.5, 0.0])
    assert accept_probability(p_t, np.array([0.0, 1.0, 0.0]), 0) == 1.0  # p_d floored, no division by zero
    assert accept_probability(p_t, np.array([0.0, 1.0, 0.0]), 2) == 0.0
    assert accept_probability(np.array([1e-9, 1.0]), np.array([0.0, 1.0]), 0) == pytest.approx(0.1)  # 1e-9 / 1e-8
    np.testing.assert_array_equal(residual(p_t, p_t), p_t)  # no residual mass: fall back to p_t
    almost = p_t + np.array([-4e-9, 4e-9, 0.0])
    np.testing.assert_array_equal(residual(p_t, almost), p_t)  # mass 4e-9 < 1e-8


# ----- verify() with chosen uniforms ----------------------------------------------------------

def logits_of(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(p > 0, np.log(np.maximum(p, 1e-300)), -1e4)


def u_for(p: np.ndarray, token: int) -> float:
    """A uniform in the middle of `token`'s inverse-CDF interval."""
    cdf = np.cumsum(p) / p.sum()
    lo = cdf[token - 1] if token else 0.0
    assert cdf[token] > lo, "that token has no mass"
    return float((lo + cdf[token]) / 2)


P_T = np.array([[0.10, 0.60, 0.20, 0.05, 0.05, 0.00],  # slot 1
                [0.30, 0.10, 0.10, 0.40, 0.05, 0.05],  # slot 2
                [0.05, 0.05, 0.50, 0.10, 0.10, 0.20]])  # bonus
P_D = np.array([[0.05, 0.30, 0.50, 0.05, 0.05, 0.05],
                [0.05, 0.05, 0.10, 0.20, 0.55, 0.05]])
Z_T = logits_of(P_T)


def test_softmax_of_the_test_logits():
    np.testing.assert_allclose(softmax(Z_T, 1.0), P_T, atol=1e-12)


def test_verify_greedy():
    z = np.array([[0.0, 3.0, 1.0, 0, 0, 0],  # argmax 1
                  [2.0, 0.0, 1.0, 0, 0, 0],  # argmax 0
                  [0.0, 0.0, 0.0, 0, 5, 0]])  # argmax 4
    p_d = np.zeros((2, V))  # unused at T = 0
    u = np.array([0.99, 0.99])
    assert verify(np.array([1, 0]), p_d, z, 0.0, u, 0.99) == (2, 4)  # all accepted: bonus argmax
    assert verify(np.array([1, 2]), p_d, z, 0.0, u, 0.99) == (1, 0)  # stops at slot 2, emits its argmax
    assert verify(np.array([3, 0]), p_d, z, 0.0, u, 0.99) == (0, 1)  # slot 1 wrong, even if slot 2 is right
    assert verify(np.array([], np.int64), p_d[:0], z[:1], 0.0, u[:0], 0.5) == (0, 1)  # ℓ = 0


def test_verify_bonus_path():
    drafts = np.array([1, 3])  # accept probs: min(1, .6/.3) = 1, min(1, .4/.2) = 1
    for tok in range(V):
        assert verify(drafts, P_D, Z_T, 1.0, np.array([0.999, 0.999]), u_for(P_T[2], tok)) == (2, tok)


def test_verify_accept_threshold():
    drafts = np.array([2, 4])  # accept probs: .2/.5 = 0.4, .05/.55
    a1 = 0.2 / 0.5
    r1 = residual(P_T[0], P_D[0])
    np.testing.assert_allclose(r1, [0.05 / 0.35, 0.30 / 0.35, 0, 0, 0, 0], atol=1e-12)
    assert verify(drafts, P_D, Z_T, 1.0, np.array([a1 + 1e-9, 0.0]), u_for(r1, 0)) == (0, 0)
    assert verify(drafts, P_D, Z_T, 1.0, np.array([a1 + 1e-9, 0.0]), u_for(r1, 1)) == (0, 1)
    assert verify(drafts, P_D, Z_T, 1.0, np.array([a1 - 1e-9, 0.99]), 0.3)[0] == 1


def test_verify_residual_path():
    drafts = np.array([1, 4])  # slot 1 accepted surely (p_t > p_d), slot 2: .05/.55
    r2 = np.maximum(P_T[1] - P_D[1], 0)
    r2 /= r2.sum()  # (.25, .05, 0, .2, 0, 0) / .5
    assert r2[2] == r2[4] == r2[5] == 0
    for tok in (0, 1, 3):
        assert verify(drafts, P_D, Z_T, 1.0, np.array([0.999, 0.5]), u_for(r2, tok)) == (1, tok)
    # the residual's zero cells are never emitted, whatever the draw
    emitted = {verify(drafts, P_D, Z_T, 1.0, np.array([0.0, 0.5]), u)[1] for u in np.linspace(0, 1, 1001)[:-1]}
    assert emitted == {0, 1, 3}
    # accepted at slot 2 when u < 0.05 / 0.55: then the bonus comes from P_T[2]
    assert verify(drafts, P_D, Z_T, 1.0, np.array([0.5, 0.05 / 0.55 - 1e-9]), u_for(P_T[2], 5)) == (2, 5)


def test_verify_rejects_a_draft_the_target_excludes():
    drafts = np.array([5, 0])  # p_t(5) = 0 at slot 1: accept probability 0, even with u = 0
    assert verify(drafts, P_D, Z_T, 1.0, np.array([0.0, 0.0]), u_for(P_T[0], 1))[0] == 0


def test_verify_ell_zero():
    for tok in range(5):  # P_T[0] has no mass on token 5
        assert verify(np.array([], np.int64), P_D[:0], Z_T[:1], 1.0, np.zeros(0), u_for(P_T[0], tok)) == (0, tok)


def test_verify_temperature_divides_target_logits():
    z = np.array([[np.log(0.6), np.log(0.4), -1e4, -1e4, -1e4, -1e4], [0, 0, 0, 0, 0, 0]])
    p_t = softmax(z[0], 0.5)  # (.36, .16) / .52
    p_d = np.array([[0.0, 1.0, 0, 0, 0, 0]])
    a = p_t[1]  # accept probability of draft 1 at T = 0.5
    assert verify(np.array([1]), p_d, z, 0.5, np.array([a - 1e-9]), 0.0)[0] == 1
    assert verify(np.array([1]), p_d, z, 0.5, np.array([a + 1e-9]), 0.0) == (0, 0)


# ----- sampling helpers -----------------------------------------------------------------------

def test_sample_from_is_the_inverse_cdf():
    p = np.array([0.125, 0.25, 0.125, 0.5])  # exact in binary: the boundaries are exact
    # "the first index whose cumulative mass exceeds u": a boundary u belongs to the next cell
    cases = [(0.0, 0), (0.1249, 0), (0.125, 1), (0.3749, 1), (0.375, 2), (0.4999, 2), (0.5, 3), (0.999999, 3)]
    for u, tok in cases:
        assert sample_from(p, u) == tok, u
        assert sample_from(10 * p, u) == tok, u  # proportional: u·total
    q = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    assert sample_from(q, 0.0) == 1 and sample_from(q, 0.5) == 3 and sample_from(q, 0.9999) == 3
    # a uniform grid of u reproduces p: each cell's u-interval has length p_i
    grid = (np.arange(100_000) + 0.5) / 100_000
    counts = np.bincount([sample_from(q, u) for u in grid[::10]], minlength=5) / 10_000
    np.testing.assert_allclose(counts, q, atol=1e-4)
    r = np.random.default_rng(0).dirichlet(np.ones(7))
    counts = np.bincount([sample_from(r, u) for u in grid], minlength=7) / len(grid)
    np.testing.assert_allclose(counts, r, atol=2e-5)


def test_sample_token():
    z = np.array([0.5, 2.0, -1.0])
    assert sample_token(z, 0.0, 0.0) == 1 and sample_token(z, 0.0, 0.999) == 1
    p = softmax(z, 0.7)
    assert [sample_token(z, 0.7, u_for(p, t)) for t in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("bad", [-1.0, -1e-12, math.nan, math.inf, -math.inf])
def test_temperature_rejects(bad):
    with pytest.raises(InputError, match="temperature"):
        SamplingParams(temperature=bad)


@pytest.mark.parametrize("ok", [0.0, 1e-6, 0.7, 1.0, 2.5])
def test_temperature_accepts(ok):
    t = SamplingParams(temperature=ok).temperature
    assert t == ok and type(t) is float
    assert SamplingParams(temperature=np.float32(0.5)).temperature == 0.5
