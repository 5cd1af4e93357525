"""The speculative decoding loop: prefill → draft → schedule → verify → accept → commit.

One loop for every backend (dspark.md §1). Batch 1; the target alone when
`scheduler` is None."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .backend import Backend
from .errors import InputError
from .sampling import check_temperature, sample_token, verify
from .scheduler import Scheduler


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    max_new_tokens: int = 256
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens is {self.max_new_tokens}, expected >= 1")


@dataclass
class Stats:
    cycles: int = 0
    emitted: list[int] = field(default_factory=list)  # τ per cycle (accepted + emitted token)
    verified: list[int] = field(default_factory=list)  # ℓ per cycle
    attempts: np.ndarray | None = None  # [γ] cycles in which slot k was verified with 1..k-1 accepted
    accepts: np.ndarray | None = None  # [γ] of those, cycles in which slot k was accepted
    # verify: the target call and the acceptance rule (on the host or, for some backends, the device)
    times: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0,
                                                             "decode": 0.0, "total": 0.0})

    @property
    def tau(self) -> float:
        return float(np.mean(self.emitted)) if self.emitted else 0.0

    @property
    def per_position_acceptance(self) -> list[float | None]:
        if self.attempts is None:
            return []
        return [float(a / n) if n else None for a, n in zip(self.accepts, self.attempts)]

    def to_dict(self, new_tokens: int) -> dict:
        decode_time = self.times["total"] - self.times["prefill"]
        return {
            "tau": self.tau,
            "cycles": self.cycles,
            "mean_verified": float(np.mean(self.verified)) if self.verified else 0.0,
            "per_position_acceptance": self.per_position_acceptance,
            "tokens_per_s": new_tokens / self.times["total"] if self.times["total"] > 0 else 0.0,
            "decode_tokens_per_s": (new_tokens - 1) / decode_time if decode_time > 0 else 0.0,
            "times_s": dict(self.times),
        }


@dataclass
class Generation:
    token_ids: list[int]
    stats: Stats
    finish_reason: str  # "stop" (a stop token) | "stop_string" | "length"


def generate(backend: Backend, prompt_ids: Sequence[int], params: SamplingParams,
             scheduler: Scheduler | None, on_tokens: Callable[[list[int]], bool] | None = None) -> Generation:
    """Decode up to `params.max_new_tokens` tokens after `prompt_ids`.

    `on_tokens` receives each committed chunk; returning True ends decoding (stop strings)."""
    n, gamma, T = len(prompt_ids), backend.block_size, params.temperature
    if n == 0:
        raise InputError("the prompt is empty")
    need = n + params.max_new_tokens + gamma + 1
    if need > backend.max_seq:
        raise InputError(f"prompt of {n} tokens + max_new_tokens {params.max_new_tokens} + block {gamma + 1} "
                         f"= {need} exceeds the context of {backend.max_seq} positions")
    stops = set(params.stop_token_ids)
    on_device = getattr(backend, "accepts_on_device", False)  # optional Backend capability
    rng = np.random.default_rng(params.seed)
    stats = Stats(attempts=np.zeros(gamma, np.int64), accepts=np.zeros(gamma, np.int64))
    out: list[int] = []
    reason = ""
    t_start = time.perf_counter()

    def commit(tokens: list[int]) -> bool:
        """Append tokens up to the first stop token or the budget; True when decoding ends."""
        keep, done = [], False
        for t in tokens:
            keep.append(t)
            if t in stops or len(out) + len(keep) >= params.max_new_tokens:
                done = True
                break
        out.extend(keep)
        if on_tokens is not None and keep and on_tokens(keep):
            nonlocal reason
            reason, done = "stop_string", True
        return done

    logits, feats = backend.target(np.asarray(prompt_ids, dtype=np.int64), 0, 1)  # [1, V], [n, F]
    anchor = sample_token(logits[-1], T, rng.random())
    stats.times["prefill"] = time.perf_counter() - t_start
    done = commit([anchor])
    ctx, ctx_start, start = feats, 0, n  # context rows for positions ctx_start..start-1

    while not done:
        if scheduler is None:  # the target alone
            t0 = time.perf_counter()
            logits, _ = backend.target(np.asarray([anchor], dtype=np.int64), start, 1)
            anchor = sample_token(logits[0], T, rng.random())
            start += 1
            stats.times["decode"] += time.perf_counter() - t0
            stats.cycles += 1
            stats.emitted.append(1)
            stats.verified.append(0)
            done = commit([anchor])
            continue
        u = rng.random(2 * gamma + 1)  # draft draws, acceptance draws, the emitted token's draw
        t0 = time.perf_counter()
        draft = backend.draft(ctx, ctx_start, anchor, start, T, u[:gamma])
        t1 = time.perf_counter()
        ell = min(scheduler.length(draft.confidence_logits), params.max_new_tokens - len(out) - 1)
        proposed = draft.tokens[:ell]
        block = np.concatenate([[anchor], proposed]).astype(np.int64)
        if on_device:  # the same rule, applied where the logits are (runtime/gpu/accept.py)
            a, token, feats = backend.verify_on_device(block, start, T, u[gamma:2 * gamma], u[2 * gamma])
        else:
            logits, feats = backend.target(block, start, ell + 1)
            a, token = verify(proposed, draft.probs[:ell], logits, T, u[gamma:2 * gamma], u[2 * gamma])
        t2 = time.perf_counter()
        stats.times["draft"] += t1 - t0
        stats.times["verify"] += t2 - t1
        stats.cycles += 1
        stats.verified.append(ell)
        stats.emitted.append(a + 1)
        stats.attempts[:min(a + 1, ell)] += 1
        stats.accepts[:a] += 1
        done = commit([int(t) for t in proposed[:a]] + [token])
        ctx, ctx_start, start, anchor = feats[:a + 1], start, start + a + 1, token

    stats.times["total"] = time.perf_counter() - t_start
    return Generation(out, stats, reason or ("stop" if out[-1] in stops else "length"))
