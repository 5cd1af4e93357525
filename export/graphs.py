"""The engine graphs: exportable step functions over static, preallocated KV caches.

Each graph reads a whole cache buffer [B, Hkv, S_max, D] per layer (pointer-stable for
IOBinding and CUDA graphs), looks only at its first P rows, where P is the width of
`past_mask` [B, P] (0 = valid, a large negative number = masked), and returns only the
new K/V rows, which the runtime writes into its buffers. Attention is computed in two
parts, past and new, so the cache is never concatenated with the new rows."""
from __future__ import annotations

import torch
from torch import nn

from .drafter import Drafter
from .layers import rope_cos_sin
from .target import TargetModel

MASKED = -1e9  # additive mask value for rows that must not be attended


def split_attention(q: torch.Tensor, k_past: torch.Tensor, v_past: torch.Tensor, past_mask: torch.Tensor,
                    k_new: torch.Tensor, v_new: torch.Tensor, new_mask: torch.Tensor | None) -> torch.Tensor:
    """softmax over [past ; new] keys without concatenating K/V.

    q [B, H, S, D]; k_past/v_past [B, Hkv, P, D]; past_mask [B, P]; k_new/v_new [B, Hkv, N, D];
    new_mask [S, N] additive or None. Returns [B, H, S, D]."""
    B, H, S, D = q.shape
    Hkv = k_new.shape[1]
    rep = H // Hkv
    scale = D ** -0.5
    qg = q.reshape(B, Hkv, rep * S, D)  # query head h = g*rep + r reads kv head g
    s_past = qg @ k_past.transpose(-1, -2) * scale + past_mask[:, None, None, :]  # [B, Hkv, rep*S, P]
    s_new = qg @ k_new.transpose(-1, -2) * scale  # [B, Hkv, rep*S, N]
    if new_mask is not None:
        s_new = s_new + new_mask.repeat(rep, 1)  # [rep*S, N]
    P = k_past.shape[2]
    p = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1)
    out = p[..., :P] @ v_past + p[..., P:] @ v_new  # [B, Hkv, rep*S, D]
    return out.reshape(B, H, S, D)


class TargetGraph(nn.Module):
    """Prefill and verification in one graph.

    inputs:  input_ids [B, S] int64, positions [B, S] int64, logit_index [B, K] int64
             (rows whose logits are wanted), past_mask [B, P] f32,
             past_key_i / past_value_i [B, Hkv, S_max, D] for every layer i
    outputs: logits [B, K, V], features [B, S, m*d], new_key_i / new_value_i [B, Hkv, S, D]"""

    def __init__(self, model: TargetModel, feature_layer_ids: tuple[int, ...]):
        super().__init__()
        self.model = model
        self.feature_layer_ids = tuple(feature_layer_ids)

    def forward(self, input_ids, positions, logit_index, past_mask, *past):
        m, c = self.model, self.model.cfg
        L = c.num_layers
        P = past_mask.shape[1]
        S = input_ids.shape[1]
        x = m.embed_tokens(input_ids)  # [B, S, d]
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        idx = torch.arange(S, device=input_ids.device)
        causal = torch.where(idx[None, :] <= idx[:, None], 0.0, MASKED)  # [S, S]
        feats = [x] if -1 in self.feature_layer_ids else []
        new_kv = []
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            k, v = attn.key_value(h, cos, sin)  # [B, Hkv, S, D]
            q = attn.query(h, cos, sin)  # [B, H, S, D]
            o = split_attention(q, past[i][:, :, :P], past[L + i][:, :, :P], past_mask, k, v, causal)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(x.shape[0], S, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in self.feature_layer_ids:
                feats.append(x)
            new_kv += [k, v]
        rows = torch.gather(x, 1, logit_index[..., None].expand(-1, -1, x.shape[-1]))  # [B, K, d]
        logits = m.lm_head(m.norm(rows))
        features = torch.cat(feats, dim=-1) if feats else x[..., :0]
        keys, values = new_kv[0::2], new_kv[1::2]
        return (logits, features, *keys, *values)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [B, V], u [B] -> first index whose cumulative mass exceeds u (count of cdf <= u)."""
    cdf = torch.cumsum(probs, dim=-1)
    below = (cdf <= (u * cdf[:, -1])[:, None]).to(torch.int64).sum(-1)
    return torch.clamp(below, max=probs.shape[-1] - 1)


class DrafterGraph(nn.Module):
    """Backbone + the γ-step sequential stage, unrolled, with randomness as an input.

    inputs:  features [B, n, m*d] raw context rows (positions ctx_start..start-1),
             positions [B, n+γ] int64 (context rows, then the block), anchor [B] int64,
             temperature [B] f32 (0 = argmax), uniforms [B, γ] f32, past_mask [B, P] f32,
             past_key_i / past_value_i [B, Hkv, S_max, D]
    outputs: draft_tokens [B, γ] int64, draft_probs [B, γ, V], confidence_logits [B, γ],
             ctx_key_i / ctx_value_i [B, Hkv, n, D]"""

    def __init__(self, drafter: Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, features, positions, anchor, temperature, uniforms, past_mask, *past):
        d, c = self.drafter, self.drafter.cfg
        L, gamma, V = c.num_layers, c.block_size, c.vocab_size
        P = past_mask.shape[1]
        n = features.shape[1]
        B = anchor.shape[0]
        ctx = d.hidden_norm(d.fc(features))  # [B, n, d]
        block = torch.cat([anchor[:, None], torch.full_like(anchor[:, None], c.mask_token_id).expand(B, gamma - 1)], 1)
        x = d.embed_tokens(block)  # [B, γ, d]
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)  # [B, 1, n+γ, D]
        ccos, csin, bcos, bsin = cos[:, :, :n], sin[:, :, :n], cos[:, :, n:], sin[:, :, n:]
        ctx_kv = []
        for i, layer in enumerate(d.layers):
            attn = layer.self_attn
            ck, cv = attn.key_value(ctx, ccos, csin)
            h = layer.input_layernorm(x)
            bk, bv = attn.key_value(h, bcos, bsin)
            q = attn.query(h, bcos, bsin)
            o = split_attention(q, past[i][:, :, :P], past[L + i][:, :, :P], past_mask,
                                torch.cat([ck, bk], 2), torch.cat([cv, bv], 2), None)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(B, gamma, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            ctx_kv += [ck, cv]
        h = d.norm(x)  # [B, γ, d]
        base = d.lm_head(h)  # [B, γ, V]
        greedy = temperature[:, None] <= 0  # [B, 1]
        inv_t = 1.0 / torch.where(greedy[:, 0], torch.ones_like(temperature), temperature)
        vocab = torch.arange(V, device=anchor.device)
        prev = anchor
        state = h.new_zeros(B, c.markov_rank) if d.markov_head is not None else None
        tokens, probs, conf = [], [], []
        for k in range(gamma):
            z = base[:, k]
            if d.markov_head is not None:
                bias, state = d.markov_head.step(h[:, k], prev, state)
                z = z + bias
            p = torch.softmax(z * inv_t[:, None], dim=-1)
            top = torch.argmax(z, dim=-1)
            tok = torch.where(greedy[:, 0], top, inverse_cdf(p, uniforms[:, k]))
            p = torch.where(greedy, (vocab[None, :] == top[:, None]).to(p.dtype), p)
            if d.confidence_head is not None:
                inp = h[:, k]
                if c.confidence_head_with_markov:
                    inp = torch.cat([inp, d.markov_head.markov_w1(prev)], dim=-1)
                conf.append(d.confidence_head.proj(inp)[:, 0])
            else:
                conf.append(torch.zeros_like(temperature))
            tokens.append(tok)
            probs.append(p)
            prev = tok
        return (torch.stack(tokens, 1), torch.stack(probs, 1), torch.stack(conf, 1),
                *ctx_kv[0::2], *ctx_kv[1::2])

