"""Sampling and the lossless acceptance rule (dspark.md §1, steps 6–7), in numpy.

Randomness is passed in as uniform numbers so that every backend, given the same
seed, makes the same draws. The rule is split into `accept_probability` and
`residual` so that tests can evaluate it exactly, without sampling."""
from __future__ import annotations

import numpy as np

from .errors import InputError

P_D_FLOOR = 1e-8
RESIDUAL_FLOOR = 1e-8


def check_temperature(temperature: float) -> float:
    if not np.isfinite(temperature) or temperature < 0:
        raise InputError(f"temperature is {temperature}, expected a finite number >= 0 (0 = greedy)")
    return float(temperature)


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(logits / T) over the last axis, in float64 for exact bookkeeping."""
    z = logits.astype(np.float64) / temperature
    z -= z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def inverse_cdf(probs, u):
    """probs [..., V] (unnormalised is fine), u [...] in [0, 1) -> [...] the first index whose
    cumulative mass exceeds u·total. Array methods only: numpy, CuPy and torch arrays alike."""
    cdf = probs.cumsum(-1)
    below = (cdf <= (u * cdf[..., -1])[..., None]).sum(-1)
    return below.clip(max=probs.shape[-1] - 1)


def sample_from(p: np.ndarray, u: float) -> int:
    """Inverse-CDF draw: the first index whose cumulative mass exceeds u·total."""
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(p) - 1))


def sample_token(logits: np.ndarray, temperature: float, u: float) -> int:
    """One token from logits [V]: argmax at T = 0, else softmax(z / T)."""
    if temperature == 0:
        return int(np.argmax(logits))
    return sample_from(softmax(logits, temperature), u)


def accept_probability(p_t: np.ndarray, p_d: np.ndarray, token: int) -> float:
    """min(1, p_t(x) / p_d(x)) for the drafted x, with p_d floored at 1e-8."""
    return float(min(1.0, p_t[token] / max(p_d[token], P_D_FLOOR)))


def residual(p_t: np.ndarray, p_d: np.ndarray) -> np.ndarray:
    """norm(max(0, p_t - p_d)); p_t itself when the residual mass is below 1e-8."""
    r = np.maximum(p_t - p_d, 0.0)
    mass = r.sum()
    return p_t if mass < RESIDUAL_FLOOR else r / mass


def verify(drafts: np.ndarray, p_d: np.ndarray | None, target_logits: np.ndarray, temperature: float,
           u_accept: np.ndarray, u_emit: float) -> tuple[int, int]:
    """Accept a prefix of `drafts` [ℓ] against the target and emit one token.

    p_d [ℓ, V] are the draft distributions the drafts were sampled from (not read at T = 0,
    where it may be None: a draft is accepted iff it is the target's argmax); target_logits
    [ℓ+1, V] are the target's logits at the anchor and each draft. Returns (a, token):
    a drafts accepted, then `token` drawn from the residual at slot a+1 or, if all ℓ
    were accepted, the bonus token from the target's last distribution."""
    n = len(drafts)
    if temperature == 0:
        greedy = target_logits.argmax(-1)  # [ℓ+1]
        a = 0
        while a < n and drafts[a] == greedy[a]:
            a += 1
        return a, int(greedy[a])
    p_t = softmax(target_logits, temperature)  # [ℓ+1, V]
    for k in range(n):
        x = int(drafts[k])
        if u_accept[k] >= accept_probability(p_t[k], p_d[k], x):
            return k, sample_from(residual(p_t[k], p_d[k]), u_emit)
    return n, sample_from(p_t[n], u_emit)
