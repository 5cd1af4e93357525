"""The PyTorch reference models as a `dspark.runtime.backends.Backend`: the yardstick
the exported engines are compared with, driven by the same decoding loop. Each slot has
its own batch-1 cache and draft session and rows run one after the other, so a row's
result cannot depend on the others by construction."""
from __future__ import annotations

import time

import numpy as np
import torch

from dspark.runtime.backends import Draft, RunEvent, RunHook, StepBatch, Verdict
from dspark.runtime.backends.base import verify_on_host

from .drafter import Drafter, DraftSession
from .target import TargetModel


class TorchBackend:
    accepts_on_device = False
    drafter_graph = "fp32"

    def __init__(self, target: TargetModel, drafter: Drafter | None, max_seq: int = 2048, slots: int = 1):
        if drafter is not None:
            drafter.cfg.check_against(target.cfg)
        self.model = target.eval()
        self.caches = [target.new_cache(1, max_seq) for _ in range(slots)]
        self.sessions = [DraftSession(drafter, max_seq) for _ in range(slots)] if drafter is not None else []
        self.feature_ids = drafter.cfg.target_layer_ids if drafter is not None else ()
        self.block_size = drafter.cfg.block_size if drafter is not None else 0
        self.vocab_size = target.cfg.vocab_size
        self.max_seq = max_seq
        self.slots = slots
        self.on_run: RunHook | None = None

    def _timed(self, kind: str, graph: str, t0: float, inputs: dict[str, np.ndarray]) -> None:
        if self.on_run is not None:
            self.on_run(RunEvent(kind, graph, time.perf_counter() - t0, inputs))

    @torch.inference_mode()
    def _row(self, slot: int, tokens: np.ndarray, start: int, kind: str = "target") -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64))[None]  # [1, S]
        logits, feats = self.caches[slot].run(self.model, ids, start, self.feature_ids)
        self._timed(kind, "target", t0, {"input_ids": ids.numpy()})
        return logits[0].float().numpy(), feats[0].float().numpy()  # [S, V], [S, F]

    def prefill(self, slot: int, tokens: np.ndarray, ingest: bool) -> tuple[np.ndarray, np.ndarray]:
        logits, feats = self._row(slot, tokens, 0, "prefill")
        n = len(tokens)
        if not ingest:
            return logits[-1], feats
        self.sessions[slot].cache_len = 0
        if n > 1:  # context rows 0..n-2; the block drafted here is discarded
            self.sessions[slot].draft(feats[:n - 1], 0, n - 1, 0.0)
        return logits[-1], feats[n - 1:]

    def target(self, tokens: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = [self._row(r, tokens[r], int(starts[r])) for r in range(len(tokens))]
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])

    def verify(self, batch: StepBatch, draft: Draft) -> Verdict:
        return verify_on_host(self, batch, draft)

    def draft(self, batch: StepBatch) -> Draft:
        t0 = time.perf_counter()
        out = []
        for r in range(len(batch.anchors)):
            session = self.sessions[r]
            start, n = int(batch.starts[r]), int(batch.counts[r])
            session.cache_len = start - n  # drop anything drafted past the committed context
            out.append(session.draft(batch.features[r, :n], int(batch.anchors[r]), start,
                                     float(batch.temperatures[r]), uniforms=batch.draft_uniforms[r],
                                     floor=int(batch.floors[r])))
        self._timed("drafter", "drafter", t0, {"features": batch.features})
        return Draft(np.stack([d.tokens for d in out]), np.stack([d.probs for d in out]),
                     np.stack([d.confidence_logits for d in out]))
