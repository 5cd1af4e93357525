"""Sampling and the lossless acceptance rule (dspark.md §1, steps 6–7), vectorized over rows.

Every function takes its arrays from one array module `xp`: numpy on the host, CuPy next to a
device's logits. `inverse_cdf` uses array methods only, so the PyTorch models draw their drafts
with it too. Randomness comes in as uniform numbers, so that every backend, given the same seed,
makes the same draws."""
from __future__ import annotations

from typing import Any

import numpy as np

P_D_FLOOR = 1e-8  # p_d is clamped to at least this in the acceptance ratio
RESIDUAL_FLOOR = 1e-8  # a residual with less mass than this is replaced by p_t


def sigmoid(x: Any) -> np.ndarray:
    """1 / (1 + exp(-x)) in float64, without overflow for large |x|."""
    return np.exp(-np.logaddexp(0.0, -np.asarray(x, np.float64)))


def inverse_cdf(probs: Any, u: Any) -> Any:
    """probs [..., V] (unnormalised is fine), u [...] in [0, 1) -> [...] the first index whose
    cumulative mass exceeds u·total. Array methods only: numpy, CuPy and torch arrays alike."""
    cdf = probs.cumsum(-1)
    below = (cdf <= (u * cdf[..., -1])[..., None]).sum(-1)
    return below.clip(max=probs.shape[-1] - 1)


def softmax(xp: Any, logits: Any, temperatures: Any) -> Any:
    """softmax(logits / T) over the last axis in float64; logits [B, ..., V], temperatures [B] > 0."""
    t = xp.asarray(temperatures, xp.float64).reshape((-1,) + (1,) * (logits.ndim - 1))
    z = logits.astype(xp.float64) / t
    z -= z.max(axis=-1, keepdims=True)
    e = xp.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def sample(xp: Any, logits: Any, temperatures: Any, u: Any) -> Any:
    """One token per row: logits [B, V], temperatures [B], u [B] -> [B] int64; the argmax where T = 0,
    else an inverse-CDF draw from softmax(z / T)."""
    temperatures = xp.asarray(temperatures)
    tokens = logits.argmax(-1).astype(xp.int64)
    hot = xp.flatnonzero(temperatures > 0)
    if len(hot):
        p = softmax(xp, logits[hot], temperatures[hot])
        tokens[hot] = inverse_cdf(p, xp.asarray(u)[hot])
    return tokens


def residual(xp: Any, p_t: Any, p_d: Any) -> Any:
    """norm(max(0, p_t - p_d)) over the last axis; p_t itself where the residual's mass is below 1e-8."""
    r = xp.maximum(p_t - p_d, 0.0)
    mass = r.sum(-1, keepdims=True)
    small = mass < RESIDUAL_FLOOR
    return xp.where(small, p_t, r / xp.where(small, 1.0, mass))


def accept_probabilities(xp: Any, p_t: Any, p_d: Any, drafts: Any) -> Any:
    """min(1, p_t(x) / p_d(x)) of each draft x: p_t, p_d [..., n, V], drafts [..., n] -> [..., n]."""
    x = drafts[..., None]
    return xp.minimum(1.0, xp.take_along_axis(p_t, x, -1)[..., 0]
                      / xp.maximum(xp.take_along_axis(p_d, x, -1)[..., 0], P_D_FLOOR))


def accept(xp: Any, drafts: Any, lengths: Any, p_d: Any, logits: Any, temperatures: Any, u: Any) -> tuple[Any, Any]:
    """Accept a prefix of each row's drafts against the target and emit one token.

    drafts [B, n] (row b verifies its first lengths[b] <= n), p_d [B, >= n, V] the distributions they
    were drawn from (read only for rows with T > 0; None when every row is greedy), logits [B, n+1, V]
    the target's logits at the anchor and each draft, temperatures [B], u [B, γ+1] (acceptance draws,
    then the emitted token's). Returns (a, token), [B] int64 each: a drafts accepted, then a token
    drawn from the residual at slot a+1 or, when all were accepted, the bonus token from the target's
    distribution there. Greedy rows accept while the draft is the target's argmax and emit the argmax."""
    B, S = logits.shape[:2]
    n = S - 1
    lengths, temperatures, u = xp.asarray(lengths), xp.asarray(temperatures), xp.asarray(u)
    within = xp.arange(n)[None, :] < lengths[:, None]  # [B, n]
    top = logits.argmax(-1)  # [B, S]
    ok = (drafts[:, :n] == top[:, :n]) & within  # greedy rows: the draft is the argmax
    emitted = top.astype(xp.int64)  # [B, S]: greedy rows emit the argmax at slot a+1
    hot = xp.flatnonzero(temperatures > 0)
    if len(hot):
        p_t = softmax(xp, logits[hot], temperatures[hot])  # [h, S, V]
        q = p_d[hot, :n].astype(xp.float64)  # [h, n, V]
        ok[hot] = (u[hot, :n] < accept_probabilities(xp, p_t[:, :n], q, drafts[hot, :n])) & within[hot]
    accepted = xp.cumprod(ok, axis=1).sum(1).astype(xp.int64)  # [B]: up to the first rejection
    tokens = emitted[xp.arange(B), accepted]
    if len(hot):
        a = accepted[hot]
        rows = xp.arange(len(hot))
        target = p_t[rows, a]  # [h, V] the target's distribution at slot a+1
        rejected = (a < lengths[hot])[:, None]
        drafted = q[rows, xp.minimum(a, max(n - 1, 0))] if n else target  # the rejected slot's p_d
        p = xp.where(rejected, residual(xp, target, drafted), target)
        tokens[hot] = inverse_cdf(p, u[hot, -1])
    return accepted, tokens
