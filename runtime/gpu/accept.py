"""The acceptance rule of dspark.md §1 (steps 6–7) without branches, for an array module `xp`
(numpy, or CuPy on the device): the target logits and draft distributions stay where they
are, and only (a, token) comes back. With numpy it computes exactly what
`dspark.runtime.sampling.verify` computes, operation for operation (tests/test_device_accept.py)."""
from __future__ import annotations

from typing import Any

from ..sampling import P_D_FLOOR, RESIDUAL_FLOOR


def accept(xp: Any, drafts: Any, p_d: Any, target_logits: Any, temperature: float, u_accept: Any,
           u_emit: float) -> Any:
    """drafts [ℓ] int64, p_d [ℓ, V], target_logits [ℓ+1, V], u_accept [ℓ] -> int64 [2]: the number
    of drafts accepted, a, and the token emitted (residual draw at slot a+1, or the bonus token)."""
    n = drafts.shape[0]
    if temperature == 0:
        greedy = target_logits.argmax(-1)  # [ℓ+1]
        a = xp.cumprod((drafts == greedy[:n]).astype(xp.int64)).sum()  # accepted while equal to the argmax
        return xp.stack([a, greedy[a]]).astype(xp.int64)
    z = target_logits.astype(xp.float64) / temperature
    z -= z.max(axis=-1, keepdims=True)
    e = xp.exp(z)
    p_t = e / e.sum(axis=-1, keepdims=True)  # [ℓ+1, V], as sampling.softmax
    k = xp.arange(n)
    ratio = p_t[k, drafts] / xp.maximum(p_d[k, drafts], P_D_FLOOR)
    a = xp.cumprod((xp.asarray(u_accept) < xp.minimum(1.0, ratio)).astype(xp.int64)).sum()  # while u < min(1, p_t/p_d)
    rejected = a < n
    row = xp.minimum(a, max(n - 1, 0))  # the rejected slot (ignored when every draft was accepted)
    r = xp.maximum(p_t[a] - p_d[row], 0.0) if n else p_t[a]
    mass = r.sum()
    residual = xp.where(mass < RESIDUAL_FLOOR, p_t[a], r / xp.where(mass < RESIDUAL_FLOOR, 1.0, mass))
    p = xp.where(rejected, residual, p_t[a])
    cdf = xp.cumsum(p)
    token = xp.minimum(xp.searchsorted(cdf, u_emit * cdf[-1], side="right"), p.shape[0] - 1)
    return xp.stack([a, token]).astype(xp.int64)
