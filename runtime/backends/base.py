"""What the decoding loop needs from an engine. A backend runs the target and the drafter over
R request slots, each with its own preallocated KV rows; the loop (runtime/core.py) owns
everything else: which request sits in which slot, scheduling, stopping.

A batched call covers slots 0..B-1 (B = 1 + the highest busy slot; a slot below it that is not
in the step rides along as a dummy row: no context rows, no drafts verified, temperature 0). Lengths
are implied by positions: rows written at or above a position that the loop later passes as a start
are simply overwritten, so rolling back rejected tokens, and the right-padding of rows shorter than
the batch, cost nothing. A dummy row's start is where the rows its slot keeps end (a prompt being
prefilled in chunks, or a free slot's prefix kept for reuse), so it writes only above them; a
backend that pads a batch with rows of its own must not write below those either. Padding exists because the engines run static shapes (ONNX Runtime,
TensorRT): a verification batch of R rows with ℓ_r drafts each costs R·(1 + max ℓ) tokens."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..sampling import accept


@dataclass
class StepBatch:
    """One step's rows, indexed by slot [B]. The loop fills the drafting fields, the backend drafts,
    the scheduler sets `lengths`, the loop sets `tokens`, the backend verifies."""

    features: np.ndarray  # [B, n, F] target features not yet fed to the drafter, right-padded
    counts: np.ndarray  # [B] real rows of `features`: positions starts - counts .. starts - 1
    floors: np.ndarray  # [B] the drafter reads its context from this position on (older rows masked)
    starts: np.ndarray  # [B] the anchor's position
    anchors: np.ndarray  # [B] the last emitted token
    temperatures: np.ndarray  # [B] float64
    uniforms: np.ndarray  # [B, 2γ+1] the draft draws, the acceptance draws, the emitted token's draw
    lengths: np.ndarray  # [B] ℓ: drafts each row verifies (0 for dummy rows)
    tokens: np.ndarray | None = None  # [B, 1 + max ℓ] the anchor, then the drafts (padding past ℓ)

    @property
    def ctx_starts(self) -> np.ndarray:
        """[B] the position of each row's first new context row."""
        return self.starts - self.counts

    @property
    def draft_uniforms(self) -> np.ndarray:
        """[B, γ] what the drafter samples its tokens with."""
        gamma = (self.uniforms.shape[1] - 1) // 2
        return self.uniforms[:, :gamma]

    @property
    def accept_uniforms(self) -> np.ndarray:
        """[B, γ+1] the acceptance draws, then the emitted token's."""
        gamma = (self.uniforms.shape[1] - 1) // 2
        return self.uniforms[:, gamma:]


@dataclass
class Draft:
    tokens: np.ndarray  # [B, γ] int64
    # [B, γ, V] the distributions the tokens were drawn from (one-hot at T = 0), or None when every
    # row is greedy: the T = 0 acceptance rule compares tokens and never reads them, so a backend
    # may also leave greedy rows of a mixed batch unfilled
    probs: np.ndarray | None
    confidence_logits: np.ndarray  # [B, γ] raw confidence logits (zeros without a head)


@dataclass
class Verdict:
    accepted: np.ndarray  # [B] drafts accepted
    emitted: np.ndarray  # [B] the token drawn after them (residual or bonus)
    features: np.ndarray  # [B, S, F] target features of the verified rows


@dataclass(frozen=True)
class RunEvent:
    """One engine run inside a backend call, as the backend's `on_run` hook sees it."""

    kind: str  # the loop's phase: "prefill" (a prompt: the target over it, the drafter fed with it),
    # "target" (verification, or one token without drafting), "drafter" (a drafting round)
    graph: str  # which graph or engine ran (a file name of the bundle, or a step's name)
    seconds: float  # wall time of the run
    inputs: Mapping[str, np.ndarray]  # what it was fed (host arrays; valid during the call only)


RunHook = Callable[[RunEvent], None]


class Backend(Protocol):
    block_size: int  # γ (0: no drafter)
    vocab_size: int
    max_seq: int  # positions available in each slot's preallocated caches
    slots: int  # R: requests served at once
    accepts_on_device: bool  # verify() applies the acceptance rule next to the logits, on a device
    drafter_graph: str  # the drafter the SPS table's drafter cost is keyed by ("int8-greedy", "int8", "fp32")
    on_run: RunHook | None  # called after every engine run (timing, profiling); None: nothing is timed

    # prefill() takes start > 0 and last=False, and padding rows of its own (if any) never write
    # below a dummy row's start: the loop may then prefill in chunks and reuse a free slot's kept
    # prefix. A backend without this attribute (or False) gets whole prompts from position 0.
    supports_prefix: bool

    def prefill(self, slot: int, tokens: np.ndarray, ingest: bool, start: int = 0,
                last: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Prompt tokens [m] at positions start..start+m-1 of `slot`, given committed KV for
        [0, start) (a chunk of a longer prompt, or the rest of one whose prefix the slot kept).
        With `ingest`, also feeds the drafter's context cache these positions, except the prompt's
        last one when `last` (the prompt ends here): that row comes with the first drafting round,
        which so has one context row like every later one. Returns the last row's logits [V]
        (fp32) and the features of the rows the drafter has not been fed: the last one [1, F]
        with `ingest` and `last`, none [0, F] with `ingest` only, every row [m, F] without."""
        ...

    def target(self, tokens: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run the target over tokens [B, S], row r at positions starts[r]..starts[r]+S-1 of slot r,
        given committed KV for [0, starts[r]). Returns logits [B, S, V] and the context features
        [B, S, F] of every row."""
        ...

    def draft(self, batch: StepBatch) -> Draft:
        """One drafting round for slots 0..B-1. Row r: the features of positions ctx_starts[r]..
        starts[r]-1 (draft-side KV for [floors[r], ctx_starts[r]) is cached; positions below the
        floor are never read); the block is anchors[r] at starts[r] plus γ-1 masks, sampled with
        the draft uniforms at temperatures[r]."""
        ...

    def verify(self, batch: StepBatch, draft: Draft) -> Verdict:
        """The target over `batch.tokens` at `batch.starts`, then the acceptance rule of
        dspark.md §1 for row r's first lengths[r] drafts against `draft`."""
        ...


def verify_on_host(backend: Backend, batch: StepBatch, draft: Draft) -> Verdict:
    """`Backend.verify` for backends whose logits come to the host: target(), then `sampling.accept`."""
    logits, features = backend.target(batch.tokens, batch.starts)  # [B, S, V], [B, S, F]
    accepted, emitted = accept(np, batch.tokens[:, 1:], batch.lengths, draft.probs, logits, batch.temperatures,
                               batch.accept_uniforms)
    return Verdict(accepted, emitted, features)
