"""A request's sampling parameters, checked once for every entry point (CLI, Python API, server),
and the statistics the decoding loop keeps for it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .errors import InputError


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy; > 0 samples from softmax(z / T), losslessly
    max_new_tokens: int = 256
    seed: int = 0  # of the request's own random stream
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    stop_token_ids: tuple[int, ...] = ()  # a stop token ends the request after it

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float, np.floating)) or not math.isfinite(t) or t < 0:
            raise InputError(f"temperature is {t}, expected a finite number >= 0 (0 = greedy)")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens is {self.max_new_tokens}, expected >= 1")
        if not _is_int(self.seed) or self.seed < 0:
            raise InputError(f"seed is {self.seed}, expected an integer >= 0")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise InputError(f"stop is {self.stop!r}, expected a list of non-empty strings")
        if not all(_is_int(i) and i >= 0 for i in self.stop_token_ids):
            raise InputError(f"stop_token_ids is {self.stop_token_ids!r}, expected token ids >= 0")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))


@dataclass
class Stats:
    """Per request. A cycle is one step of the loop: drafted and verified, or (the drafter skipped,
    or no speculation) one target token."""

    drafted: list[bool] = field(default_factory=list)  # whether the drafter ran, per cycle
    emitted: list[int] = field(default_factory=list)  # τ per cycle (accepted + emitted token)
    verified: list[int] = field(default_factory=list)  # ℓ per cycle
    batch: list[int] = field(default_factory=list)  # requests in the step, per cycle
    attempts: np.ndarray | None = None  # [γ] cycles in which slot k was verified with 1..k-1 accepted
    accepts: np.ndarray | None = None  # [γ] of those, cycles in which slot k was accepted
    confidences: list[np.ndarray] = field(default_factory=list)  # raw confidence logits [γ] per drafted cycle
    cached_tokens: int = 0  # prompt tokens whose KV a slot kept from an earlier request (not prefilled)
    # seconds in the engine calls (verify includes the acceptance rule; prefill sums a prompt's chunks),
    # and from joining to finishing
    times: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0,
                                                             "decode": 0.0, "total": 0.0})

    @property
    def cycles(self) -> int:
        return len(self.emitted)

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
            "drafted_cycles": int(sum(self.drafted)),
            "mean_verified": float(np.mean(self.verified)) if self.verified else 0.0,
            "mean_batch": float(np.mean(self.batch)) if self.batch else 0.0,
            "cached_tokens": self.cached_tokens,
            "per_position_acceptance": self.per_position_acceptance,
            "tokens_per_s": new_tokens / self.times["total"] if self.times["total"] > 0 else 0.0,
            "decode_tokens_per_s": (new_tokens - 1) / decode_time if decode_time > 0 else 0.0,
            "times_s": dict(self.times),
        }
