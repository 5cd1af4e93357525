"""What the decoding loop needs from an engine. A backend runs the target and the
drafter for one sequence; the loop owns everything else (sampling, acceptance,
scheduling, stopping). Lengths are implied by positions: rows written at or above
a position that the loop later passes as `start` are simply overwritten, so rolling
back rejected tokens costs nothing."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class Draft:
    tokens: np.ndarray  # [γ] int64
    probs: np.ndarray  # [γ, V] the distributions the tokens were drawn from (one-hot at T = 0)
    confidence_logits: np.ndarray  # [γ] raw confidence logits (zeros without a head)


class Backend(Protocol):
    """Optional: a backend whose logits live on a device may set `accepts_on_device = True` and
    provide `verify_on_device(tokens, start, temperature, u_accept, u_emit) -> (a, token,
    features)`, which runs the target over [anchor, drafts] and applies the acceptance rule
    against the last draft() there (runtime/gpu/graph_backend.py); the loop then uses it."""

    block_size: int  # γ
    vocab_size: int
    max_seq: int  # positions available in the preallocated caches

    def target(self, tokens: np.ndarray, start: int, logit_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Run the target over tokens [S] at positions start..start+S-1, given committed
        KV for [0, start). Returns the logits of the last `logit_rows` rows [logit_rows, V]
        (fp32) and the context features of every row [S, F]."""
        ...

    def draft(self, features: np.ndarray, ctx_start: int, anchor: int, start: int,
              temperature: float, uniforms: np.ndarray) -> Draft:
        """One drafting round: features [start - ctx_start, F] are the raw target features
        of positions ctx_start..start-1 (draft-side KV for [0, ctx_start) is cached);
        the block is the anchor at `start` plus γ-1 masks; uniforms [γ] drive sampling."""
        ...
