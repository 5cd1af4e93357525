"""PyTorch reference of the target decoder (Llama and Qwen3 families): the one place its
math is written. `TargetModel.forward` takes everything explicitly (positions, the past
K/V with its additive mask, the rows whose logits are wanted) and returns the new K/V rows;
`StaticKV` is the reference's preallocated cache around it. The exported target graph
(graphs.TargetGraph) calls the same forward."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dspark.runtime.config import TargetConfig
from dspark.runtime.graph_io import MASKED

from .layers import MLP, Projections, RMSNorm, attention, group_mask, rope_cos_sin


class TargetLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.self_attn = Projections(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                     cfg.qk_norm, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TargetModel(nn.Module):
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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, past_mask: torch.Tensor,
                past_keys: Sequence[torch.Tensor], past_values: Sequence[torch.Tensor],
                logit_index: torch.Tensor | None = None, feature_layer_ids: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """input_ids, positions [B, S] (the new rows, causal among themselves); past_mask [B, P]
        additive over the committed rows whose K/V are past_keys/past_values (per layer
        [B, Hkv, P, D]); logit_index [B, K]: the rows whose logits are wanted (None: all).

        -> logits [B, K, V], features [B, S, m·d] (the outputs of `feature_layer_ids`, -1 = the
        embedding; zero width without), new keys and values per layer [B, Hkv, S, D]."""
        c = self.cfg
        B, S = input_ids.shape
        P = past_mask.shape[1]
        x = self.embed_tokens(input_ids)  # [B, S, d]
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        idx = torch.arange(S, device=input_ids.device)
        causal = torch.where(idx[None, :] <= idx[:, None], 0.0, MASKED)  # [S, S]
        mask = torch.cat([past_mask[:, None, :].expand(B, S, P), causal.expand(B, S, S)], dim=-1)  # [B, S, P+S]
        mask = group_mask(mask, c.num_heads // c.num_kv_heads, S).to(x.dtype)
        feats = [x] if -1 in feature_layer_ids else []
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = attn(layer.input_layernorm(x), cos, sin)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, S, D]
            x = x + attn.o_proj(attention(q, [past_keys[i], k], [past_values[i], v], mask))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in feature_layer_ids:
                feats.append(x)
            keys.append(k)
            values.append(v)
        features = torch.cat(feats, dim=-1) if feats else x[..., :0]
        if logit_index is not None:
            x = torch.gather(x, 1, logit_index[..., None].expand(-1, -1, x.shape[-1]))  # [B, K, d]
        return self.lm_head(self.norm(x)), features, keys, values


@dataclass
class StaticKV:
    """A preallocated cache of the reference models; rows are written at their absolute positions."""

    k: torch.Tensor  # [L, B, Hkv, S_max, D]
    v: torch.Tensor  # [L, B, Hkv, S_max, D]

    @classmethod
    def empty(cls, layers: int, batch: int, kv_heads: int, max_seq: int, head_dim: int,
              dtype: torch.dtype = torch.float32) -> StaticKV:
        shape = (layers, batch, kv_heads, max_seq, head_dim)
        return cls(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    @property
    def max_seq(self) -> int:
        return self.k.shape[3]

    def past(self, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of the committed rows [0, length): keys and values per layer [B, Hkv, length, D]."""
        return list(self.k[:, :, :, :length]), list(self.v[:, :, :, :length])

    def write(self, start: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """keys, values per layer [B, Hkv, S, D] go to rows start..start+S-1 (cast to the cache's
        dtype: under bf16 autocast the projections come out in bf16)."""
        S = keys[0].shape[2]
        self.k[:, :, :, start:start + S] = torch.stack(list(keys)).to(self.k.dtype)
        self.v[:, :, :, start:start + S] = torch.stack(list(values)).to(self.v.dtype)

    def run(self, model: TargetModel, input_ids: torch.Tensor, start: int,
            feature_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """`model` over input_ids [B, S] at positions start..start+S-1 of every row, reading the
        committed rows [0, start) and writing its new ones -> logits [B, S, V], features [B, S, m·d]."""
        B, S = input_ids.shape
        positions = torch.arange(start, start + S, device=input_ids.device).expand(B, S)
        past_mask = torch.zeros(B, start, device=input_ids.device)
        logits, features, keys, values = model(input_ids, positions, past_mask, *self.past(start),
                                               feature_layer_ids=feature_layer_ids)
        self.write(start, keys, values)
        return logits, features
