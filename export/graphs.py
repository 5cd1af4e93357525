"""The engine graphs: exportable step functions over static, preallocated KV caches.

Each graph reads a whole cache buffer [B, Hkv, S_max, D] per layer (pointer-stable for
IOBinding and CUDA graphs), looks only at its first P rows, where P is the width of
`past_mask` [B, P] (0 = valid, a large negative number = masked), and returns only the
new K/V rows, which the runtime writes into its buffers. Attention is computed in two
parts, past and new, so the cache is never concatenated with the new rows."""
from __future__ import annotations

import copy

import torch
from torch import nn

from .drafter import Drafter
from .layers import RMSNorm, rope_cos_sin
from .target import TargetModel

MASKED = -1e9  # additive mask value for rows that must not be attended
TARGET_INPUTS = ("input_ids", "positions", "logit_index", "past_mask")  # then past_key_i..., past_value_i...
DRAFTER_INPUTS = ("features", "positions", "anchor", "temperature", "uniforms", "past_mask", "ctx_mask")


def kv_names(prefix: str, layers: int) -> list[str]:
    """Per-layer K/V tensor names: keys of every layer, then values."""
    return [f"{prefix}_key_{i}" for i in range(layers)] + [f"{prefix}_value_{i}" for i in range(layers)]


def target_outputs(layers: int) -> list[str]:
    return ["logits", "features", *kv_names("new", layers)]


def drafter_outputs(layers: int, probs: bool = True) -> list[str]:
    """probs=False: the greedy-only graph, whose one-hot distributions nobody reads (the T = 0
    acceptance rule compares tokens)."""
    return ["draft_tokens", *(["draft_probs"] if probs else []), "confidence_logits", *kv_names("ctx", layers)]


def split_attention(q: torch.Tensor, k_past: torch.Tensor, v_past: torch.Tensor, past_mask: torch.Tensor,
                    k_new: torch.Tensor, v_new: torch.Tensor, new_mask: torch.Tensor | None) -> torch.Tensor:
    """softmax over [past ; new] keys without concatenating K/V.

    q [B, H, S, D]; k_past/v_past [B, Hkv, P, D]; past_mask [B, P]; k_new/v_new [B, Hkv, N, D];
    new_mask [B, N] additive (the same for every query) or None. Returns [B, H, S, D]."""
    B, H, S, D = q.shape
    Hkv = k_new.shape[1]
    rep = H // Hkv
    scale = D ** -0.5
    qg = q.reshape(B, Hkv, rep * S, D)  # query head h = g*rep + r reads kv head g
    s_past = qg @ k_past.transpose(-1, -2) * scale + past_mask[:, None, None, :]  # [B, Hkv, rep*S, P]
    s_new = qg @ k_new.transpose(-1, -2) * scale  # [B, Hkv, rep*S, N]
    if new_mask is not None:
        s_new = s_new + new_mask[:, None, None, :]
    P = k_past.shape[2]
    p = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1)
    out = p[..., :P] @ v_past + p[..., P:] @ v_new  # [B, Hkv, rep*S, D]
    return out.reshape(B, H, S, D)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm written as Pow → ReduceMean → Add → Sqrt → Div → Mul, the pattern ONNX Runtime
    fuses into one SimplifiedLayerNormalization (and TensorRT into its normalization layer)."""
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class FusableRMSNorm(nn.Module):
    """A `layers.RMSNorm` (Hugging Face's x * rsqrt(...), which the exporter writes as Sqrt →
    Reciprocal → Mul and ONNX Runtime does not fuse) computed as `rms_norm`; same weight."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def fuse_norms(module: nn.Module) -> None:
    """Swap every RMSNorm of `module` for a `FusableRMSNorm`, in place."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RMSNorm):
                setattr(parent, name, FusableRMSNorm(child))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [..., D] with cos/sin broadcastable to it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class TargetGraph(nn.Module):
    """Prefill and verification in one graph.

    inputs:  input_ids [B, S] int64, positions [B, S] int64, logit_index [B, K] int64
             (rows whose logits are wanted), past_mask [B, P] f32,
             past_key_i / past_value_i [B, Hkv, S_max, D] for every layer i
    outputs: logits [B, K, V], features [B, S, m*d], new_key_i / new_value_i [B, Hkv, S, D]

    Weights are rearranged for the engine, not changed: q/k/v and gate/up projections are
    concatenated into one matrix each, the attention scale is folded into the queries, and
    RoPE (and Qwen3's q/k norm) runs once over the queries and keys together."""

    def __init__(self, model: TargetModel, feature_layer_ids: tuple[int, ...]):
        super().__init__()
        c = model.cfg
        self.cfg, self.feature_layer_ids = c, tuple(feature_layer_ids)
        self.embed = model.embed_tokens
        self.norm = model.norm
        self.lm_head = model.lm_head
        scale = c.head_dim ** -0.5
        self.qkv, self.gate_up, self.o, self.down, self.norm_in, self.norm_post, self.qk_norm = (
            nn.ParameterList() for _ in range(7))
        with torch.no_grad():
            for layer in model.layers:
                a, mlp = layer.self_attn, layer.mlp
                q_w = a.q_proj.weight if c.qk_norm else a.q_proj.weight * scale
                self.qkv.append(torch.cat([q_w, a.k_proj.weight, a.v_proj.weight]).T.contiguous())  # [d, (H+2Hkv)D]
                self.gate_up.append(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).T.contiguous())
                self.o.append(a.o_proj.weight.T.contiguous())
                self.down.append(mlp.down_proj.weight.T.contiguous())
                self.norm_in.append(layer.input_layernorm.weight.clone())
                self.norm_post.append(layer.post_attention_layernorm.weight.clone())
                if c.qk_norm:  # per-head norms of q (scale folded in) and k, as one [H+Hkv, D] weight
                    self.qk_norm.append(torch.cat([(a.q_norm.weight * scale).expand(c.num_heads, -1),
                                                   a.k_norm.weight.expand(c.num_kv_heads, -1)]).contiguous())

    def forward(self, input_ids, positions, logit_index, past_mask, *past):
        c = self.cfg
        L, H, Hkv, D = c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim
        rep = H // Hkv
        B, S = input_ids.shape
        P = past_mask.shape[1]
        x = self.embed(input_ids)  # [B, S, d]
        cos, sin = rope_cos_sin(positions, D, c.rope_theta)  # [B, 1, S, D]
        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)  # [B, S, 1, D]
        idx = torch.arange(S, device=input_ids.device)
        causal = torch.where(idx[None, :] <= idx[:, None], 0.0, MASKED)  # [S, S]
        mask = torch.cat([past_mask[:, None, :].expand(B, S, P), causal.expand(B, S, S)], dim=-1)  # [B, S, P+S]
        mask = mask[:, None, None].expand(B, Hkv, rep, S, P + S).reshape(B, Hkv, rep * S, P + S)
        feats = [x] if -1 in self.feature_layer_ids else []
        keys, values = [], []
        for i in range(L):
            h = rms_norm(x, self.norm_in[i], c.rms_norm_eps)
            qkv = h @ self.qkv[i]  # [B, S, (H+2Hkv)D]
            qk = qkv[..., :(H + Hkv) * D].reshape(B, S, H + Hkv, D)
            v = qkv[..., (H + Hkv) * D:].reshape(B, S, Hkv, D).transpose(1, 2)  # [B, Hkv, S, D]
            if c.qk_norm:
                qk = rms_norm(qk, self.qk_norm[i], c.rms_norm_eps)
            qk = rotate(qk, cos, sin)
            q = qk[:, :, :H].reshape(B, S, Hkv, rep, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, rep * S, D)
            k = qk[:, :, H:].transpose(1, 2)  # [B, Hkv, S, D]
            k_past, v_past = past[i][:, :, :P], past[L + i][:, :, :P]  # [B, Hkv, P, D]
            scores = torch.cat([q @ k_past.transpose(-1, -2), q @ k.transpose(-1, -2)], dim=-1) + mask
            p = torch.softmax(scores, dim=-1)  # [B, Hkv, rep*S, P+S]
            o = p[..., :P] @ v_past + p[..., P:] @ v  # [B, Hkv, rep*S, D]
            o = o.reshape(B, Hkv, rep, S, D).permute(0, 3, 1, 2, 4).reshape(B, S, H * D)
            x = x + o @ self.o[i]
            gate, up = (rms_norm(x, self.norm_post[i], c.rms_norm_eps) @ self.gate_up[i]).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ self.down[i]
            if i in self.feature_layer_ids:
                feats.append(x)
            keys.append(k)
            values.append(v)
        rows = torch.gather(x, 1, logit_index[..., None].expand(-1, -1, x.shape[-1]))  # [B, K, d]
        logits = self.lm_head(rms_norm(rows, self.norm.weight, c.rms_norm_eps))
        features = torch.cat(feats, dim=-1) if feats else x[..., :0]
        return (logits, features, *keys, *values)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [B, V], u [B] -> first index whose cumulative mass exceeds u (count of cdf <= u)."""
    cdf = torch.cumsum(probs, dim=-1)
    below = (cdf <= (u * cdf[:, -1])[:, None]).to(torch.int64).sum(-1)
    return torch.clamp(below, max=probs.shape[-1] - 1)


BRANCHES = ("cond", "sampled", "greedy")


class SequentialStage(nn.Module):
    """The γ left-to-right steps (dspark.md §3–4), unrolled: Markov bias, sampling by
    inverse CDF from the supplied uniforms (argmax where temperature is 0), confidence.
    A module of its own so that profiles can attribute its nodes.

    branch: "cond" = an `If` takes a branch without the softmax and cumulative sums over the
    vocabulary when every row is greedy (one graph for every temperature); "sampled" = always
    the sampled branch (exact for greedy rows too, no host sync on a condition, so a CUDA
    graph can capture it); "greedy" = the greedy branch alone, for calls whose rows all have
    temperature 0 (the caller's promise: `temperature` and `uniforms` are not read), returning
    no distributions (probs None): at T = 0 acceptance compares tokens, so γ one-hot rows over
    the vocabulary would be built and copied for nothing."""

    def __init__(self, drafter: Drafter, branch: str = "cond", vocab: torch.Tensor | None = None):
        super().__init__()
        if branch not in BRANCHES:
            raise ValueError(f"branch {branch!r} is not one of {BRANCHES}")
        self.drafter = drafter
        self.branch = branch
        self.register_buffer("vocab", vocab)  # [K] draft vocabulary ids, or None: the base logits cover all V

    def forward(self, h, base, anchor, temperature, uniforms):
        """h [B, γ, d], base [B, γ, K] (K = V without a draft vocabulary) -> tokens [B, γ] (vocabulary
        ids), probs [B, γ, V] (zero outside the draft vocabulary), confidence [B, γ]."""
        if self.branch == "sampled":
            return self.sampled(h, base, anchor, temperature, uniforms)
        if self.branch == "greedy":
            return self.steps(h, base, anchor, temperature, uniforms, sample=False, one_hot=False)
        return torch.cond((temperature <= 0).all(), self.greedy, self.sampled, (h, base, anchor, temperature, uniforms))

    def greedy(self, h, base, anchor, temperature, uniforms):
        return self.steps(h, base, anchor, temperature, uniforms, sample=False)

    def sampled(self, h, base, anchor, temperature, uniforms):
        return self.steps(h, base, anchor, temperature, uniforms, sample=True)

    def steps(self, h, base, anchor, temperature, uniforms, sample: bool, one_hot: bool = True):
        d, c = self.drafter, self.drafter.cfg
        B, gamma, K = base.shape
        greedy = temperature[:, None] <= 0  # [B, 1]
        inv_t = 1.0 / torch.where(greedy[:, 0], torch.ones_like(temperature), temperature)
        draft_ids = torch.arange(K, device=anchor.device)  # [K] indices into the base logits
        prev = anchor
        state = h.new_zeros(B, c.markov_rank) if d.markov_head is not None else None
        tokens, probs = [], []
        for k in range(gamma):
            z = base[:, k]  # [B, K]
            if d.markov_head is not None:
                bias, state = d.markov_head.step(h[:, k], prev, state)
                z = z + bias
            top = torch.argmax(z, dim=-1)
            if sample:
                p = torch.softmax(z * inv_t[:, None], dim=-1)
                idx = torch.where(greedy[:, 0], top, inverse_cdf(p, uniforms[:, k]))
                p = torch.where(greedy, (draft_ids[None, :] == top[:, None]).to(z.dtype), p)
            else:
                idx, p = top, (draft_ids[None, :] == top[:, None]).to(z.dtype) if one_hot else None
            tok = idx if self.vocab is None else self.vocab[idx]  # [B] vocabulary ids
            if p is not None and self.vocab is not None:  # [B, K] -> [B, V], zero outside the draft vocabulary
                p = p.new_zeros(B, c.vocab_size).scatter(1, self.vocab[None, :].expand(B, K), p)
            tokens.append(tok)
            probs.append(p)
            prev = tok
        tokens_t = torch.stack(tokens, 1)  # [B, γ]
        conf = d.confidence(h, torch.cat([anchor[:, None], tokens_t[:, :-1]], 1))  # after the loop: one matmul
        return tokens_t, torch.stack(probs, 1) if probs[0] is not None else None, conf


def restrict_vocab(drafter: Drafter, vocab: torch.Tensor) -> None:
    """Cut `drafter`'s LM head and Markov output projection, in place, to score only the ids in
    `vocab` [K] (sorted, distinct): a draft vocabulary (FR-Spec). On a CPU the [γ, d] x [d, V]
    LM head is the largest matmul of a drafter pass; proposals are then drawn from the K ids
    alone, which costs acceptance only where the target's token lies outside them. Acceptance
    corrects any proposal (dspark.md §1), so the output does not change."""
    weight = drafter.lm_head.weight[vocab].detach().clone()  # [K, d]
    drafter.lm_head = nn.Linear(drafter.cfg.hidden_size, len(vocab), bias=False)
    drafter.lm_head.weight = nn.Parameter(weight, requires_grad=False)
    if drafter.markov_head is not None:
        w2 = drafter.markov_head.markov_w2.weight[vocab].detach().clone()  # [K, r]
        drafter.markov_head.markov_w2 = nn.Linear(w2.shape[1], len(vocab), bias=False)
        drafter.markov_head.markov_w2.weight = nn.Parameter(w2, requires_grad=False)


class DrafterGraph(nn.Module):
    """Backbone + the γ-step sequential stage, unrolled, with randomness as an input.

    inputs:  features [B, n, m*d] raw context rows (positions ctx_start..start-1),
             positions [B, n+γ] int64 (context rows, then the block), anchor [B] int64,
             temperature [B] f32 (0 = argmax), uniforms [B, γ] f32, past_mask [B, P] f32,
             ctx_mask [B, n] f32 (additive: rows of requests with fewer than n new context
             rows are padding the block must not read), past_key_i / past_value_i [B, Hkv, S_max, D]
    outputs: draft_tokens [B, γ] int64, draft_probs [B, γ, V] (not with branch "greedy"),
             confidence_logits [B, γ], ctx_key_i / ctx_value_i [B, Hkv, n, D]

    vocab: a draft vocabulary (restrict_vocab); the outputs keep the whole vocabulary's ids and width."""

    def __init__(self, drafter: Drafter, branch: str = "cond", vocab: torch.Tensor | None = None):
        super().__init__()
        drafter = copy.deepcopy(drafter)  # the graph's own: the caller's drafter stays as it is
        if vocab is not None:
            restrict_vocab(drafter, vocab)
        fuse_norms(drafter)  # every RMSNorm one fused op on ONNX Runtime
        self.drafter = drafter
        self.sequential = SequentialStage(drafter, branch, vocab)

    def forward(self, features, positions, anchor, temperature, uniforms, past_mask, ctx_mask, *past):
        d, c = self.drafter, self.drafter.cfg
        L, gamma = c.num_layers, c.block_size
        P = past_mask.shape[1]
        n = features.shape[1]
        B = anchor.shape[0]
        ctx = d.hidden_norm(d.fc(features))  # [B, n, d]
        block = torch.cat([anchor[:, None], torch.full_like(anchor[:, None], c.mask_token_id).expand(B, gamma - 1)], 1)
        x = d.embed_tokens(block)  # [B, γ, d]
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)  # [B, 1, n+γ, D]
        ccos, csin, bcos, bsin = cos[:, :, :n], sin[:, :, :n], cos[:, :, n:], sin[:, :, n:]
        new_mask = torch.cat([ctx_mask, torch.zeros_like(ctx_mask[:, :1]).expand(B, gamma)], 1)  # [B, n+γ]
        ctx_kv = []
        for i, layer in enumerate(d.layers):
            attn = layer.self_attn
            ck, cv = attn.key_value(ctx, ccos, csin)
            h = layer.input_layernorm(x)
            bk, bv = attn.key_value(h, bcos, bsin)
            q = attn.query(h, bcos, bsin)
            o = split_attention(q, past[i][:, :, :P], past[L + i][:, :, :P], past_mask,
                                torch.cat([ck, bk], 2), torch.cat([cv, bv], 2), new_mask)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(B, gamma, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            ctx_kv += [ck, cv]
        h = d.norm(x)  # [B, γ, d]
        tokens, probs, conf = self.sequential(h, d.lm_head(h), anchor, temperature, uniforms)
        return (tokens, *([] if probs is None else [probs]), conf, *ctx_kv[0::2], *ctx_kv[1::2])
