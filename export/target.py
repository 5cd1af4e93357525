"""PyTorch reference of the target decoder (Llama and Qwen3 families).

Written to be read and exported: a static, preallocated KV cache written at explicit
positions, and context features taken from chosen layers (dspark.md §2)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark.runtime.config import TargetConfig

from .layers import MLP, Projections, RMSNorm, rope_cos_sin


@dataclass
class StaticKV:
    """Preallocated cache; rows are written at their absolute positions."""

    k: torch.Tensor  # [L, B, Hkv, S_max, D]
    v: torch.Tensor  # [L, B, Hkv, S_max, D]

    @classmethod
    def empty(cls, layers: int, batch: int, kv_heads: int, max_seq: int, head_dim: int,
              dtype: torch.dtype = torch.float32) -> "StaticKV":
        shape = (layers, batch, kv_heads, max_seq, head_dim)
        return cls(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    @property
    def max_seq(self) -> int:
        return self.k.shape[3]

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, Hkv, S, D] go to rows `positions` [B, S] of `layer` (cast to the cache's
        dtype: under bf16 autocast the projections come out in bf16)."""
        for b in range(k.shape[0]):
            self.k[layer, b].index_copy_(1, positions[b], k[b].to(self.k.dtype))
            self.v[layer, b].index_copy_(1, positions[b], v[b].to(self.v.dtype))


class TargetLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.self_attn = Projections(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                     cfg.qk_norm, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TargetModel(nn.Module):
    """`forward(tokens, positions, cache)` -> logits [B, S, V], features [B, S, m*d]."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TargetLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def new_cache(self, batch: int, max_seq: int) -> StaticKV:
        c = self.cfg
        return StaticKV.empty(c.num_layers, batch, c.num_kv_heads, max_seq, c.head_dim,
                              dtype=self.embed_tokens.weight.dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKV,
                feature_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens, positions [B, S]. Every row below a query's position must already be in
        `cache` (committed); rows at `positions` are written. Stale rows above are masked."""
        c = self.cfg
        x = self.embed_tokens(tokens)  # [B, S, d]
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        span = int(positions.max()) + 1
        key_pos = torch.arange(span, device=tokens.device)
        mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, S, span]
        feats = [x] if -1 in feature_layer_ids else []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            k, v = attn.key_value(h, cos, sin)  # [B, Hkv, S, D]
            cache.write(i, positions, k, v)
            x = x + attn.attend(attn.query(h, cos, sin), cache.k[i, :, :, :span], cache.v[i, :, :, :span], mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in feature_layer_ids:
                feats.append(x)
        logits = self.lm_head(self.norm(x))  # [B, S, V]
        return logits, (torch.cat(feats, dim=-1) if feats else None)
