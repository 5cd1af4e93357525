"""The PyTorch reference models as a `dspark.runtime.backend.Backend`: the yardstick
the exported engines are compared with, driven by the same decoding loop."""
from __future__ import annotations

import numpy as np
import torch

from dspark.runtime.backend import Draft

from .drafter import Drafter, DraftSession
from .target import TargetModel


class TorchBackend:
    def __init__(self, target: TargetModel, drafter: Drafter | None, max_seq: int = 2048):
        if drafter is not None:
            drafter.cfg.check_against(target.cfg)
        self.model = target.eval()
        self.cache = target.new_cache(1, max_seq)
        self.session = DraftSession(drafter, max_seq) if drafter is not None else None
        self.feature_ids = drafter.cfg.target_layer_ids if drafter is not None else ()
        self.block_size = drafter.cfg.block_size if drafter is not None else 0
        self.vocab_size = target.cfg.vocab_size
        self.max_seq = max_seq

    @torch.inference_mode()
    def target(self, tokens: np.ndarray, start: int, logit_rows: int) -> tuple[np.ndarray, np.ndarray]:
        ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64))[None]  # [1, S]
        pos = torch.arange(start, start + ids.shape[1])[None]  # [1, S]
        logits, feats = self.model(ids, pos, self.cache, self.feature_ids)
        feats_np = feats[0].float().numpy() if feats is not None else np.zeros((ids.shape[1], 0), np.float32)
        return logits[0, -logit_rows:].float().numpy(), feats_np

    def draft(self, features: np.ndarray, ctx_start: int, anchor: int, start: int,
              temperature: float, uniforms: np.ndarray) -> Draft:
        self.session.cache_len = ctx_start  # drop anything drafted past the committed context
        r = self.session.draft(features, anchor, start, temperature, uniforms=uniforms)
        return Draft(r.tokens, r.probs, r.confidence_logits)
