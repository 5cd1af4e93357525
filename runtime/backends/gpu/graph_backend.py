"""A `Backend` (backends/base.py) over two engine steps on one device, for any engine:
the KV caches and static inputs live here, each call is rounded to a shape bucket, and calls
of up to γ+1 rows are captured once per bucket as a CUDA graph and replayed after that.
Lengths reach the graphs as device data (positions, past_mask, logit_index), never as
shapes or host scalars, so one graph serves every call of its bucket.

Batch 1: one request slot (slots=1). Concurrent requests (slots > 1, the loop's batched rows)
are not ported to this layer yet: asking for them raises a BackendError."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ...config import DrafterConfig, TargetConfig
from ...errors import BackendError, InputError
from ...graph_io import CTX, NEW, DrafterInputs, TargetInputs, kv_names
from ...sampling import accept
from ..base import Draft, RunEvent, RunHook, StepBatch, Verdict, verify_on_host
from .buckets import Buckets, past_mask
from .device import Device, Outputs


class Step(Protocol):
    """One engine graph (target or drafter), as the exported ONNX graphs define it."""

    def prepare(self, inputs: dict[str, Any], kv: list[Any], graphed: bool) -> Callable[[], Outputs]:
        """Bind static inputs (device arrays by input name) and the KV caches (keys of every
        layer, then values) for one shape. Returns launch(): enqueue the step, return its
        outputs by name. `graphed`: launch() will be captured in a CUDA graph."""
        ...


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager: int = 0
    capture_failures: list[str] = field(default_factory=list)


@dataclass
class _Entry:
    inputs: dict[str, Any]  # static input buffers
    run: Callable[[], Outputs]  # replay (returns the static outputs) or the eager body


class StepRunner:
    """Static buffers and graphs of one step, keyed by the shapes of its inputs."""

    def __init__(self, device: Device, step: Step, kv: list[Any], prefix: str, layers: int, graphs: bool):
        self.device, self.step, self.kv, self.prefix, self.layers, self.graphs = device, step, kv, prefix, layers, graphs
        self.entries: dict[tuple, _Entry] = {}
        self.stats = GraphStats()

    def __call__(self, host: dict[str, np.ndarray], rows: int, keep: bool) -> Outputs:
        """Run the step on host inputs; its first `rows` positions get their new K/V rows written.
        keep: cache this bucket's buffers (and its graph when graphs are on)."""
        key = tuple((name, a.shape) for name, a in host.items())
        entry = self.entries.get(key)
        if entry is None:
            entry = self._new(host, rows, graphed=keep and self.graphs)
            if keep:
                self.entries[key] = entry
        else:
            for name, a in host.items():
                self.device.upload(entry.inputs[name], a)
        return entry.run()

    def _new(self, host: dict[str, np.ndarray], rows: int, graphed: bool) -> _Entry:
        d = self.device
        inputs = {name: d.zeros(a.shape, a.dtype) for name, a in host.items()}
        for name, a in host.items():  # before any launch: the warm-up writes real KV rows
            d.upload(inputs[name], a)
        launch = self.step.prepare(inputs, self.kv, graphed)
        positions = inputs["positions"]
        names = kv_names(self.prefix, self.layers)

        def body() -> Outputs:
            out = launch()
            for cache, name in zip(self.kv, names):
                d.write_rows(cache, out[name], positions)
            return out

        if graphed:
            try:
                replay, outputs = d.capture(body)
            except Exception as e:  # noqa: BLE001 — a step that cannot be captured still runs, eagerly
                self.stats.capture_failures.append(f"{key_text(host)}: {type(e).__name__}: {e}")
            else:
                self.stats.captures += 1

                def run() -> Outputs:
                    replay()
                    self.stats.replays += 1
                    return outputs

                return _Entry(inputs, run)

        def eager() -> Outputs:
            self.stats.eager += 1
            return body()

        return _Entry(inputs, eager)


def key_text(host: dict[str, np.ndarray]) -> str:
    return ", ".join(f"{name}{list(a.shape)}" for name, a in host.items())


class GraphBackend:
    """`Backend` over a target step and an optional drafter step (None: the target alone), for
    one request slot."""

    drafter_graph = "fp32"  # the exported drafter graph, the same for every row

    def __init__(self, device: Device, target_cfg: TargetConfig, drafter_cfg: DrafterConfig | None,
                 target_step: Step, drafter_step: Step | None, buckets: Buckets, graphs: bool = True,
                 kv_dtype: np.dtype = np.dtype(np.float32), device_acceptance: bool = True, slots: int = 1):
        """device_acceptance: verify() runs the acceptance rule next to the logits (sampling.accept
        over the device's array module) and drafts keep their distributions on the device."""
        check_slots(slots)
        t = target_cfg
        self.device, self.buckets = device, buckets
        self.accepts_on_device = device_acceptance
        self.on_run: RunHook | None = None
        self._draft_out: Outputs | None = None  # the last drafting round's outputs, on the device
        self.vocab_size, self.max_seq, self.slots = t.vocab_size, buckets.max_seq, slots
        self.block_size = drafter_cfg.block_size if drafter_step is not None else 0
        if drafter_step is not None and buckets.max_query < self.block_size + 1:
            raise InputError(f"buckets.max_query is {buckets.max_query}, the drafter needs γ+1 = {self.block_size + 1}")
        kv_t = [device.zeros((1, t.num_kv_heads, buckets.max_seq, t.head_dim), kv_dtype) for _ in range(2 * t.num_layers)]
        self._target = StepRunner(device, target_step, kv_t, NEW, t.num_layers, graphs)
        self._drafter = None
        if drafter_step is not None:
            c = drafter_cfg
            kv_d = [device.zeros((1, c.num_kv_heads, buckets.max_seq, c.head_dim), kv_dtype) for _ in range(2 * c.num_layers)]
            self._drafter = StepRunner(device, drafter_step, kv_d, CTX, c.num_layers, graphs)

    @property
    def stats(self) -> dict[str, GraphStats]:
        out = {"target": self._target.stats}
        if self._drafter is not None:
            out["drafter"] = self._drafter.stats
        return out

    def _timed(self, kind: str, graph: str, t0: float, inputs: dict[str, np.ndarray]) -> None:
        """The hook's event for a call that began at t0 and has read its outputs back (so the device is done)."""
        if self.on_run is not None:
            self.on_run(RunEvent(kind, graph, time.perf_counter() - t0, inputs))

    def prefill(self, slot: int, tokens: np.ndarray, ingest: bool) -> tuple[np.ndarray, np.ndarray]:
        _check_rows(slot + 1)
        tokens = np.asarray(tokens, np.int64)
        n = len(tokens)
        t0 = time.perf_counter()
        logits, feats = self._target_rows(tokens, 0, 1)  # [1, V], [n, F]
        self._timed("prefill", "target", t0, {"input_ids": tokens[None]})
        if not ingest:
            return logits[0], feats
        if n > 1:  # context rows 0..n-2; the block drafted here is discarded
            t0 = time.perf_counter()
            self.device.download(self._draft_rows(feats[:n - 1], 0, 0, 0, 0.0, np.zeros(self.block_size))["draft_tokens"])
            self._timed("prefill", "drafter", t0, {"features": feats[None, :n - 1]})
        return logits[0], feats[n - 1:]

    def target(self, tokens: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        _check_rows(len(tokens))
        t0 = time.perf_counter()
        logits, feats = self._target_rows(np.asarray(tokens[0], np.int64), int(starts[0]), tokens.shape[1])
        self._timed("target", "target", t0, {"input_ids": tokens})
        return logits[None], feats[None]  # [1, S, V], [1, S, F]

    def _target_rows(self, tokens: np.ndarray, start: int, logit_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """tokens [S] at start.. -> logits of the last `logit_rows` rows [K, V], features [S, F]."""
        n = len(tokens)
        if not 1 <= logit_rows <= n or start + n > self.max_seq:
            raise InputError(f"target call: {n} tokens at {start}, {logit_rows} logit rows, max_seq {self.max_seq}")
        logits, feats = [], []
        for lo, hi in self.buckets.chunks(n):
            out, wanted = self._target_chunk(tokens, start, lo, hi, n - logit_rows)
            if wanted:
                logits.append(self.device.download(out["logits"])[0].astype(np.float32, copy=False))
            feats.append(self.device.download(out["features"])[0].astype(np.float32, copy=False))
        return np.concatenate(logits), np.concatenate(feats)

    def _target_chunk(self, tokens: np.ndarray, start: int, lo: int, hi: int, first: int) -> tuple[Outputs, bool]:
        """Rows lo..hi-1 of a call at `start`, with logits for the rows from `first` on; returns the
        outputs (on the device) and whether this chunk has any of those rows."""
        rows = np.arange(max(lo, first), hi, dtype=np.int64) - lo
        index = rows if len(rows) else np.array([hi - lo - 1], np.int64)  # one row is always computed
        out = self._target(TargetInputs(
            input_ids=tokens[None, lo:hi],  # [1, S]
            positions=np.arange(start + lo, start + hi, dtype=np.int64)[None],  # [1, S]
            logit_index=index[None],  # [1, K]
            past_mask=past_mask(start + lo, self.buckets.context(start + lo)),  # [1, P]
        )._asdict(), rows=hi - lo, keep=self.buckets.graphable(hi - lo))
        return out, len(rows) > 0

    def verify(self, batch: StepBatch, draft: Draft) -> Verdict:
        """The target over [anchor, d_1..d_ℓ] (tokens [1, S], ℓ = lengths[0] <= S-1), then the acceptance
        rule against the last drafting round: on the device with `accepts_on_device` (only (a, token)
        and the features come back), else on the host."""
        if not self.accepts_on_device:
            return verify_on_host(self, batch, draft)
        _check_rows(len(batch.tokens))
        row, start = np.asarray(batch.tokens[0], np.int64), int(batch.starts[0])
        S = len(row)
        if self._draft_out is None or not S <= self.buckets.max_query or start + S > self.max_seq:
            raise InputError(f"verify: {S} tokens at {start} (needs a drafting round first, at most "
                             f"{self.buckets.max_query} tokens, max_seq {self.max_seq})")
        t0 = time.perf_counter()
        out, _ = self._target_chunk(row, start, 0, S, 0)
        a, token = self.device.compute(
            lambda xp, drafts, p_d, logits, lengths, temps, u: xp.stack(accept(xp, drafts, lengths, p_d, logits, temps, u)),
            batch.tokens[:, 1:], self._draft_out["draft_probs"], out["logits"], batch.lengths[:1],
            batch.temperatures[:1], batch.accept_uniforms[:1])
        feats = self.device.download(out["features"]).astype(np.float32, copy=False)  # [1, S, F]
        self._timed("target", "target", t0, {"input_ids": batch.tokens})
        return Verdict(np.asarray(a, np.int64), np.asarray(token, np.int64), feats)

    def draft(self, batch: StepBatch) -> Draft:
        _check_rows(len(batch.counts))
        t0 = time.perf_counter()
        out = self._draft_rows(batch.features[0, :int(batch.counts[0])], int(batch.ctx_starts[0]),
                               int(batch.floors[0]), int(batch.anchors[0]), float(batch.temperatures[0]),
                               batch.draft_uniforms[0])
        d = self.device
        tokens = d.download(out["draft_tokens"]).astype(np.int64, copy=False)  # [1, γ]
        confidence = d.download(out["confidence_logits"]).astype(np.float32, copy=False)  # [1, γ]
        self._timed("drafter", "drafter", t0, {"features": batch.features})
        if self.accepts_on_device:
            return DeviceDraft(tokens, confidence, d, out["draft_probs"])
        return Draft(tokens, d.download(out["draft_probs"]).astype(np.float32, copy=False), confidence)

    def _draft_rows(self, features: np.ndarray, ctx_start: int, floor: int, anchor: int, temperature: float,
                    uniforms: np.ndarray) -> Outputs:
        """Context rows features [n, F] at ctx_start.. in chunks, the block after them: a chunk's K/V
        depend only on its features and positions, so every chunk but the last drafts a block whose
        outputs are dropped. Cached rows below `floor` are masked. Returns the last chunk's outputs
        (on the device)."""
        gamma, n = self.block_size, len(features)
        start = ctx_start + n
        if self._drafter is None:
            raise InputError("this backend was opened without a drafter")
        if n < 1 or start + gamma > self.max_seq:
            raise InputError(f"draft round: {n} context rows for positions {ctx_start}..{start - 1}, "
                             f"block end {start + gamma}, max_seq {self.max_seq}")
        features = np.ascontiguousarray(features, np.float32)
        block = np.arange(start, start + gamma, dtype=np.int64)
        for lo, hi in self.buckets.chunks(n):
            out = self._drafter(DrafterInputs(
                features=features[None, lo:hi],  # [1, m, F]
                positions=np.concatenate([np.arange(ctx_start + lo, ctx_start + hi, dtype=np.int64), block])[None],
                anchor=np.array([anchor], np.int64),
                temperature=np.array([temperature], np.float32),
                uniforms=np.asarray(uniforms, np.float32)[None],  # [1, γ]
                past_mask=past_mask(ctx_start + lo, self.buckets.context(ctx_start + lo), floor=floor),
                ctx_mask=np.zeros((1, hi - lo), np.float32),  # [1, m] every row is real at batch 1
            )._asdict(), rows=hi - lo, keep=self.buckets.graphable(hi - lo))
        self._draft_out = out
        return out


def check_slots(slots: int) -> None:
    if slots != 1:
        raise BackendError(f"the GPU backends serve one request at a time: slots={slots} (concurrent requests) "
                           f"is not ported to the shared GPU layer yet; use the onnxruntime backend for that")


def _check_rows(batch: int) -> None:
    if batch != 1:
        raise BackendError(f"a GPU backend call for {batch} request rows: the shared GPU layer serves one request "
                           f"(slots=1); batched rows are not ported yet")


class DeviceDraft(Draft):
    """A `Draft` whose distributions stay on the device: `probs` [1, γ, V] copies them to the host
    when read, which is valid until the backend's next draft() call. A loop that verifies on the
    device never reads them."""

    def __init__(self, tokens: np.ndarray, confidence_logits: np.ndarray, device: Device, probs: Any):
        self.tokens, self.confidence_logits = tokens, confidence_logits
        self._device, self._probs = device, probs

    @property
    def probs(self) -> np.ndarray:  # [1, γ, V]
        return self._device.download(self._probs).astype(np.float32, copy=False)
