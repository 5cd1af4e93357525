"""What the decoding loop needs from an engine. A backend runs the target and the
drafter over R request slots, each with its own preallocated KV rows; the loop owns
everything else (sampling, acceptance, scheduling, stopping, which request sits in
which slot). A batched call covers slots 0..B-1 (B = 1 + the highest busy slot; a free
slot below it rides along as a dummy row).

Lengths are implied by positions: rows written at or above a position that the loop
later passes as a start are simply overwritten, so rolling back rejected tokens, and
the right-padding of rows shorter than the batch, cost nothing. Padding exists because
the engines run static shapes (ONNX Runtime, TensorRT): a verification batch of R rows
with ℓ_r drafts each costs R·(1 + max ℓ) tokens, not Σ(1 + ℓ_r)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class Draft:
    tokens: np.ndarray  # [B, γ] int64
    # [B, γ, V] the distributions the tokens were drawn from (one-hot at T = 0), or None when every
    # row is greedy: the T = 0 acceptance rule compares tokens and never reads them, so a backend
    # may also leave greedy rows of a mixed batch unfilled
    probs: np.ndarray | None
    confidence_logits: np.ndarray  # [B, γ] raw confidence logits (zeros without a head)


class Backend(Protocol):
    """Optional: a backend whose logits live on a device may set `accepts_on_device = True` and
    provide `verify_on_device(tokens [B, S], starts [B], lengths [B], temperatures [B], uniforms
    [B, γ+1]) -> (accepted [B], emitted [B], features [B, S, F])`: target() over the rows, then
    the acceptance rule of dspark.md §1 for row r's first lengths[r] drafts against the last
    draft(), next to the logits (runtime/gpu/graph_backend.py). The loop then calls it instead
    of target() + sampling.verify; uniforms are the acceptance draws, then the emitted token's."""

    block_size: int  # γ (0: no drafter)
    vocab_size: int
    max_seq: int  # positions available in each slot's preallocated caches
    slots: int  # R: requests served at once

    def prefill(self, slot: int, tokens: np.ndarray, ingest: bool) -> tuple[np.ndarray, np.ndarray]:
        """A new request's prompt tokens [n] at positions 0..n-1 of `slot`. With `ingest`,
        also feeds the drafter's context cache with positions 0..n-2, so that the first
        drafting round has one context row like every later one. Returns the last row's
        logits [V] (fp32) and the features of the rows the drafter has not been fed: the last
        one [1, F] with `ingest`, every row [n, F] without."""
        ...

    def target(self, tokens: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run the target over tokens [B, S], row r at positions starts[r]..starts[r]+S-1 of
        slot r, given committed KV for [0, starts[r]). Returns logits [B, S, V] and the
        context features [B, S, F] of every row."""
        ...

    def draft(self, features: np.ndarray, counts: np.ndarray, ctx_starts: np.ndarray, anchors: np.ndarray,
              temperatures: np.ndarray, uniforms: np.ndarray, floors: np.ndarray | None = None) -> Draft:
        """One drafting round for slots 0..B-1. Row r: features[r, :counts[r]] [B, n, F] are the
        raw target features of positions ctx_starts[r]..start_r-1 (start_r = ctx_starts[r] +
        counts[r]; rows past counts[r] are padding); draft-side KV for [floors[r], ctx_starts[r])
        is cached, and positions below floors[r] (default 0) are never read: the drafter's context
        restarts there. The block is anchors[r] at start_r plus γ-1 masks; uniforms [B, γ] drive
        sampling at temperatures [B]."""
        ...
