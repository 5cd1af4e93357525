"""Scalar views of the runtime's vectorized sampling rules (dspark.runtime.sampling), for exact
tests of one slot or one row: the same functions, called with a batch of one."""
from __future__ import annotations

import numpy as np

from dspark.runtime import sampling


def softmax(z: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(z / T) over the last axis of z [..., V] (float64)."""
    return sampling.softmax(np, np.asarray(z), np.array([temperature]))


def sample_from(p: np.ndarray, u: float) -> int:
    return int(sampling.inverse_cdf(np.asarray(p), np.asarray(u)))


def sample_token(z: np.ndarray, temperature: float, u: float) -> int:
    return int(sampling.sample(np, np.asarray(z)[None], [temperature], [u])[0])


def accept_probability(p_t: np.ndarray, p_d: np.ndarray, token: int, rule=sampling.accept_probabilities) -> float:
    """min(1, p_t(x) / p_d(x)) of one draft x (or what `rule`, a broken variant, says)."""
    return float(rule(np, np.asarray(p_t)[None], np.asarray(p_d)[None], np.array([token]))[0])


def residual(p_t: np.ndarray, p_d: np.ndarray, rule=sampling.residual) -> np.ndarray:
    return rule(np, np.asarray(p_t), np.asarray(p_d))


def verify(drafts: np.ndarray, p_d: np.ndarray | None, target_logits: np.ndarray, temperature: float,
           u_accept: np.ndarray, u_emit: float) -> tuple[int, int]:
    """`sampling.accept` for one row verifying all its drafts [ℓ]: p_d [ℓ, V] (None at T = 0),
    target_logits [ℓ+1, V]. Returns (a, token)."""
    n = len(drafts)
    u = np.zeros((1, n + 1))
    u[0, :n], u[0, n] = u_accept, u_emit
    a, token = sampling.accept(np, np.asarray(drafts, np.int64)[None], np.array([n]),
                               None if p_d is None else np.asarray(p_d)[None], np.asarray(target_logits)[None],
                               np.array([temperature]), u)
    return int(a[0]), int(token[0])
