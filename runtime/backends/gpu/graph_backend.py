"""A `Backend` (backends/base.py) over two engine steps on one device, for any engine:
the KV caches and static inputs live here, each call is rounded to a shape bucket, and calls
of up to γ+1 rows are captured once per bucket as a CUDA graph and replayed after that.
Lengths reach the graphs as device data (positions, past_mask, logit_index), never as
shapes or host scalars, so one graph serves every call of its bucket.

Concurrent requests: every KV cache holds R slots [R, Hkv, S_max, D]. A step's drafting round
and verification each run once over slots 0..B-1 (backends/base.py), padded to a batch bucket
with dummy rows of the slots above (which write only at position max_seq - 1, so a prompt being
prefilled there in chunks, or a prefix kept for reuse, survives), and the acceptance rule runs
over every row. A prompt runs over its own slot alone (a view of the
caches at that slot), eagerly unless it lands in slot 0 and is at most γ+1 rows long. Graphs are
captured per (batch bucket, query length, context bucket)."""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from ...config import DrafterConfig, TargetConfig
from ...errors import InputError
from ...graph_io import CTX, NEW, DrafterInputs, TargetInputs
from ...kv import row_mask
from ...sampling import accept
from ..base import Draft, RunEvent, RunHook, StepBatch, Verdict, verify_on_host
from .buckets import Buckets
from .device import Device, Outputs
from .steps import GraphStats, Step, StepRunner


class GraphBackend:
    """`Backend` over a target step and an optional drafter step (None: the target alone), for
    `buckets.max_batch` request slots."""

    drafter_graph = "fp32"  # the exported drafter graph, the same for every row
    # prefill() from any start (chunked prefill, prefix reuse): the core's dummy rows write above what
    # their slots keep, and the rows that pad a call to its batch bucket write only at position
    # max_seq - 1, which no request reaches (check_prompt keeps a block's room free at the end)
    supports_prefix = True

    def __init__(self, device: Device, target_cfg: TargetConfig, drafter_cfg: DrafterConfig | None,
                 target_step: Step, drafter_step: Step | None, buckets: Buckets, graphs: bool = True,
                 kv_dtype: np.dtype = np.dtype(np.float32), device_acceptance: bool = True):
        """device_acceptance: verify() runs the acceptance rule next to the logits (sampling.accept
        over the device's array module) and drafts keep their distributions on the device."""
        t = target_cfg
        self.device, self.buckets = device, buckets
        self.accepts_on_device = device_acceptance
        self.on_run: RunHook | None = None
        self._draft_out: Outputs | None = None  # the last drafting round's outputs, on the device
        self.vocab_size, self.max_seq, self.slots = t.vocab_size, buckets.max_seq, buckets.max_batch
        self.block_size = drafter_cfg.block_size if drafter_step is not None else 0
        if drafter_step is not None and buckets.max_query < self.block_size + 1:
            raise InputError(f"buckets.max_query is {buckets.max_query}, the drafter needs γ+1 = {self.block_size + 1}")
        R, S = self.slots, buckets.max_seq
        kv_t = [device.zeros((R, t.num_kv_heads, S, t.head_dim), kv_dtype) for _ in range(2 * t.num_layers)]
        self._target = StepRunner(device, target_step, kv_t, NEW, t.num_layers, graphs)
        self._drafter = None
        if drafter_step is not None:
            c = drafter_cfg
            kv_d = [device.zeros((R, c.num_kv_heads, S, c.head_dim), kv_dtype) for _ in range(2 * c.num_layers)]
            self._drafter = StepRunner(device, drafter_step, kv_d, CTX, c.num_layers, graphs)

    @property
    def runners(self) -> dict[str, StepRunner]:
        """The steps by role ("target", "drafter"): their static buffers, graphs and stats."""
        return {"target": self._target} | ({"drafter": self._drafter} if self._drafter is not None else {})

    @property
    def stats(self) -> dict[str, GraphStats]:
        return {role: runner.stats for role, runner in self.runners.items()}

    def _timed(self, kind: str, graph: str, t0: float, inputs: dict[str, np.ndarray]) -> None:
        """The hook's event for a call that began at t0 and has read its outputs back (so the device is done)."""
        if self.on_run is not None:
            self.on_run(RunEvent(kind, graph, time.perf_counter() - t0, inputs))

    def _rows(self, lo: int, batch: int) -> int:
        """The rows a call over slots lo..lo+batch-1 runs at: a batch bucket for calls from slot 0
        (dummy rows of free slots pad it), the slot alone for a prefill into another slot."""
        if lo < 0 or lo + batch > self.slots:
            raise InputError(f"a call over slots {lo}..{lo + batch - 1}; this backend has {self.slots} slots")
        return self.buckets.batch(batch) if lo == 0 else batch

    def prefill(self, slot: int, tokens: np.ndarray, ingest: bool, start: int = 0,
                last: bool = True) -> tuple[np.ndarray, np.ndarray]:
        # start > 0 runs as the layer's own prompt chunks after the first do (a past of `start` rows);
        # on the CPU TorchDevice only: not run on a GPU, nor with TensorRT
        tokens = np.asarray(tokens, np.int64)[None]  # [1, m]
        m = tokens.shape[1]
        zero, begin = np.zeros(1, np.int64), np.array([start], np.int64)  # [1]
        t0 = time.perf_counter()
        logits, feats = self._target_rows(slot, tokens, begin, 1)  # [1, 1, V], [1, m, F]
        self._timed("prefill", "target", t0, {"input_ids": tokens})
        if not ingest:
            return logits[0, 0], feats[0]
        fed = m - 1 if last else m  # the prompt's last row comes with the first drafting round
        if fed:  # context rows start..start+fed-1; the block drafted here is discarded
            t0 = time.perf_counter()
            out = self._draft_rows(slot, feats[:, :fed], np.array([fed]), begin, zero, zero, np.zeros(1),
                                   np.zeros((1, self.block_size)))
            self.device.download(out["draft_tokens"])
            self._timed("prefill", "drafter", t0, {"features": feats[:, :fed]})
        return logits[0, 0], feats[0, fed:]

    def target(self, tokens: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        out = self._target_rows(0, np.asarray(tokens, np.int64), np.asarray(starts, np.int64), tokens.shape[1])
        self._timed("target", "target", t0, {"input_ids": tokens})
        return out  # [B, S, V], [B, S, F]

    def _target_rows(self, lo: int, tokens: np.ndarray, starts: np.ndarray,
                     logit_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """tokens [B, n] of slots lo.., row b at starts[b].. -> logits of the last `logit_rows` rows
        [B, K, V], features [B, n, F]."""
        B, n = tokens.shape
        if not 1 <= logit_rows <= n or int(starts.max()) + n > self.max_seq:
            raise InputError(f"target call: {n} tokens at {starts.tolist()}, {logit_rows} logit rows, "
                             f"max_seq {self.max_seq}")
        logits, feats = [], []
        for c0, c1 in self.buckets.chunks(n):
            out, wanted = self._target_chunk(lo, tokens, starts, c0, c1, n - logit_rows)
            if wanted:
                logits.append(self.device.download(out["logits"])[:B].astype(np.float32, copy=False))
            feats.append(self.device.download(out["features"])[:B].astype(np.float32, copy=False))
        return np.concatenate(logits, axis=1), np.concatenate(feats, axis=1)

    def _target_chunk(self, lo: int, tokens: np.ndarray, starts: np.ndarray, c0: int, c1: int,
                      first: int) -> tuple[Outputs, bool]:
        """Columns c0..c1-1 of a call over slots lo.. (tokens [B, n] at starts [B]), with logits for
        the columns from `first` on; returns the outputs (on the device, rows padded to the batch
        bucket) and whether this chunk has any of those columns."""
        B = len(tokens)
        Bp = self._rows(lo, B)
        cols = np.arange(max(c0, first), c1, dtype=np.int64) - c0
        index = cols if len(cols) else np.array([c1 - c0 - 1], np.int64)  # one row is always computed
        starts = _pad(starts, Bp)  # [Bp]: padding rows read no past
        past = starts + c0  # [Bp] committed rows before this chunk
        positions = np.minimum(past[:, None] + np.arange(c1 - c0), self.max_seq - 1)  # [Bp, S]; padding clipped
        positions[B:] = self.max_seq - 1  # the bucket's padding rows write only there (supports_prefix)
        out = self._target(TargetInputs(
            input_ids=_pad(tokens[:, c0:c1], Bp),  # [Bp, S]
            positions=positions,
            logit_index=np.tile(index, (Bp, 1)),  # [Bp, K]
            past_mask=row_mask(past, self.buckets.context(int(past.max()))),  # [Bp, P]
        )._asdict(), lo, rows=c1 - c0, keep=lo == 0 and self.buckets.graphable(c1 - c0))
        return out, len(cols) > 0

    def verify(self, batch: StepBatch, draft: Draft) -> Verdict:
        """The target over [anchor, d_1..d_ℓ] (tokens [B, S], ℓ_b = lengths[b] <= S-1), then the
        acceptance rule against the last drafting round: on the device with `accepts_on_device`
        (only (a, token) per row and the features come back), else on the host."""
        if not self.accepts_on_device:
            return verify_on_host(self, batch, draft)
        tokens, starts = np.asarray(batch.tokens, np.int64), np.asarray(batch.starts, np.int64)
        B, S = tokens.shape
        if self._draft_out is None or not S <= self.buckets.max_query or int((starts + 1 + batch.lengths).max()) > self.max_seq:
            raise InputError(f"verify: {S} tokens at {starts.tolist()} (needs a drafting round first, at most "
                             f"{self.buckets.max_query} tokens, max_seq {self.max_seq})")
        t0 = time.perf_counter()
        out, _ = self._target_chunk(0, tokens, starts, 0, S, 0)
        a, token = self.device.compute(
            lambda xp, drafts, p_d, logits, lengths, temps, u: xp.stack(
                accept(xp, drafts, lengths, p_d[:B], logits[:B], temps, u)),
            tokens[:, 1:], self._draft_out["draft_probs"], out["logits"], batch.lengths, batch.temperatures,
            batch.accept_uniforms)
        feats = self.device.download(out["features"])[:B].astype(np.float32, copy=False)  # [B, S, F]
        self._timed("target", "target", t0, {"input_ids": tokens})
        return Verdict(np.asarray(a, np.int64), np.asarray(token, np.int64), feats)

    def draft(self, batch: StepBatch) -> Draft:
        B = len(batch.counts)
        t0 = time.perf_counter()
        out = self._draft_rows(0, batch.features, batch.counts, batch.ctx_starts, batch.floors, batch.anchors,
                               batch.temperatures, batch.draft_uniforms)
        d = self.device
        tokens = d.download(out["draft_tokens"])[:B].astype(np.int64, copy=False)  # [B, γ]
        confidence = d.download(out["confidence_logits"])[:B].astype(np.float32, copy=False)  # [B, γ]
        self._timed("drafter", "drafter", t0, {"features": batch.features})
        if self.accepts_on_device:
            return DeviceDraft(tokens, confidence, d, out["draft_probs"])
        return Draft(tokens, d.download(out["draft_probs"])[:B].astype(np.float32, copy=False), confidence)

    def _draft_rows(self, lo: int, features: np.ndarray, counts: np.ndarray, ctx_starts: np.ndarray,
                    floors: np.ndarray, anchors: np.ndarray, temperatures: np.ndarray, uniforms: np.ndarray) -> Outputs:
        """A drafting round for slots lo..: row b feeds context rows features[b, :counts[b]] (features
        [B, n, F], right-padded) at ctx_starts[b].., then drafts its block after them; cached rows below
        floors[b] are masked. Context columns go in chunks: a chunk's K/V depend only on its features
        and positions, so every chunk but the last drafts blocks whose outputs are dropped. Returns the
        last chunk's outputs (on the device, rows padded to the batch bucket)."""
        if self._drafter is None:
            raise InputError("this backend was opened without a drafter")
        gamma, (B, n) = self.block_size, features.shape[:2]
        starts = ctx_starts + counts  # [B] each row's block starts at its anchor
        if n < 1 or int(counts.max()) < 1 or int(starts.max()) + gamma > self.max_seq:
            raise InputError(f"draft round: {counts.tolist()} context rows at {ctx_starts.tolist()}, "
                             f"block ends {(starts + gamma).tolist()}, max_seq {self.max_seq}")
        Bp = self._rows(lo, B)
        features = _pad(np.asarray(features, np.float32), Bp)  # [Bp, n, F]
        counts, ctx_starts, floors = _pad(counts, Bp), _pad(ctx_starts, Bp), _pad(floors, Bp)  # [Bp]
        block = _pad(starts, Bp)[:, None] + np.arange(gamma)  # [Bp, γ]
        for c0, c1 in self.buckets.chunks(n):
            past = ctx_starts + np.minimum(counts, c0)  # [Bp] rows fed before this chunk (real ones only)
            ctx = np.minimum(ctx_starts[:, None] + np.arange(c0, c1), self.max_seq - 1)  # [Bp, m]; padding clipped
            ctx[B:] = self.max_seq - 1  # the bucket's padding rows write only there (supports_prefix)
            out = self._drafter(DrafterInputs(
                features=np.ascontiguousarray(features[:, c0:c1]),  # [Bp, m, F]
                positions=np.concatenate([ctx, block], axis=1),  # [Bp, m+γ]
                anchor=_pad(np.asarray(anchors, np.int64), Bp),  # [Bp]
                temperature=_pad(np.asarray(temperatures, np.float32), Bp),  # [Bp]
                uniforms=_pad(np.asarray(uniforms, np.float32), Bp),  # [Bp, γ]
                past_mask=row_mask(past, self.buckets.context(int(past.max())), floors=floors),  # [Bp, P]
                ctx_mask=row_mask(np.clip(counts - c0, 0, None), c1 - c0),  # [Bp, m] real context rows
            )._asdict(), lo, rows=c1 - c0, keep=lo == 0 and self.buckets.graphable(c1 - c0))
        self._draft_out = out
        return out


def _pad(a: np.ndarray, rows: int) -> np.ndarray:
    """`a` [B, ...] with zero rows appended up to `rows` (dummy rows of a batch bucket)."""
    a = np.asarray(a)
    if len(a) == rows:
        return a
    return np.concatenate([a, np.zeros((rows - len(a), *a.shape[1:]), a.dtype)])


class DeviceDraft(Draft):
    """A `Draft` whose distributions stay on the device: `probs` [B, γ, V] copies them to the host
    when read, which is valid until the backend's next draft() call. A loop that verifies on the
    device never reads them."""

    def __init__(self, tokens: np.ndarray, confidence_logits: np.ndarray, device: Device, probs: Any):
        self.tokens, self.confidence_logits = tokens, confidence_logits  # [B, γ] each
        self._device, self._probs = device, probs  # [Bp, γ, V] on the device (Bp: the batch bucket)

    @property
    def probs(self) -> np.ndarray:  # [B, γ, V]
        return self._device.download(self._probs)[:len(self.tokens)].astype(np.float32, copy=False)
