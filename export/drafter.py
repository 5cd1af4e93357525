"""PyTorch reference of the DSpark drafter (dspark.md §2–4).

Parallel backbone with KV injection and a draft-side context cache; vanilla, gated
and RNN sequential heads; the confidence head. `DraftSession` is the public entry
point that runs drafting rounds of a checkpoint and keeps the cache between them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dspark.runtime.config import DrafterConfig
from dspark.runtime.errors import InputError

from .layers import MLP, Projections, RMSNorm, rope_cos_sin
from .target import StaticKV


class DrafterLayer(nn.Module):
    """Qwen3-style layer whose keys/values are [proj(context) ; proj(block)]."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = Projections(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                     True, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MarkovHead(nn.Module):
    """The sequential stage's bias B(prev, ·) (dspark.md §3)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d, r, V = cfg.hidden_size, cfg.markov_rank, cfg.vocab_size
        self.kind = cfg.markov_head_type
        self.rank = r
        self.markov_w1 = nn.Embedding(V, r)
        self.markov_w2 = nn.Linear(r, V, bias=False)  # weight [V, r]
        if self.kind == "gated":
            self.gate_proj = nn.Linear(d + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + d, 3 * r)

    def step(self, h: torch.Tensor, prev: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, d], prev [B], state [B, r] (RNN only) -> bias [B, V], new state."""
        e = self.markov_w1(prev)  # [B, r]
        if self.kind == "vanilla":
            return self.markov_w2(e), state
        if self.kind == "gated":
            g = torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1)))
            return self.markov_w2(g * e), state
        gate, cand, out = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        s = torch.sigmoid(gate)
        state = s * state + (1 - s) * torch.tanh(cand)
        return self.markov_w2(torch.tanh(out)), state


class ConfidenceHead(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        extra = cfg.markov_rank if cfg.confidence_head_with_markov else 0
        self.proj = nn.Linear(cfg.hidden_size + extra, 1)


@dataclass
class SequentialOut:
    tokens: torch.Tensor  # [B, γ] int64
    logits: torch.Tensor  # [B, γ, V] U + B
    probs: torch.Tensor  # [B, γ, V] the draft distributions p_d (one-hot at T = 0)
    confidence_logits: torch.Tensor  # [B, γ]


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [B, V], u [B] in [0, 1) -> the first index whose cumulative mass exceeds u."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None].to(cdf.dtype), right=True)[:, 0]
    return idx.clamp(max=probs.shape[-1] - 1)


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.fc = nn.Linear(cfg.feature_dim, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg) if cfg.markov_rank else None
        self.confidence_head = ConfidenceHead(cfg) if cfg.enable_confidence_head else None

    def new_cache(self, batch: int, max_seq: int) -> StaticKV:
        c = self.cfg
        return StaticKV.empty(c.num_layers, batch, c.num_kv_heads, max_seq, c.head_dim,
                              dtype=self.fc.weight.dtype)

    def backbone(self, features: torch.Tensor, anchor: torch.Tensor, ctx_start: int, start: int,
                 cache: StaticKV, floor: int = 0) -> torch.Tensor:
        """One parallel pass. features [B, n, m*d] are the raw context rows for positions
        ctx_start..start-1 (n = start - ctx_start); cache holds context K/V for [floor, ctx_start),
        and positions below `floor` are not attended to. Writes the new context K/V, returns the
        normed block states h [B, γ, d]."""
        c = self.cfg
        B, n = features.shape[0], features.shape[1]
        gamma = c.block_size
        ctx = self.hidden_norm(self.fc(features))  # [B, n, d]
        block = torch.full((B, gamma), c.mask_token_id, dtype=torch.long, device=anchor.device)
        block[:, 0] = anchor
        x = self.embed_tokens(block)  # [B, γ, d]
        ctx_pos = torch.arange(ctx_start, start, device=anchor.device).expand(B, n)
        blk_pos = torch.arange(start, start + gamma, device=anchor.device).expand(B, gamma)
        ccos, csin = rope_cos_sin(ctx_pos, c.head_dim, c.rope_theta)
        bcos, bsin = rope_cos_sin(blk_pos, c.head_dim, c.rope_theta)
        mask = None if floor == 0 else (torch.arange(start + gamma, device=anchor.device) >= floor)[None, None, None]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            ck, cv = attn.key_value(ctx, ccos, csin)  # context rows skip input_layernorm
            cache.write(i, ctx_pos, ck, cv)
            h = layer.input_layernorm(x)
            bk, bv = attn.key_value(h, bcos, bsin)
            k = torch.cat([cache.k[i, :, :, :start], bk], dim=2)  # [B, Hkv, start+γ, D]
            v = torch.cat([cache.v[i, :, :, :start], bv], dim=2)
            x = x + attn.attend(attn.query(h, bcos, bsin), k, v, mask)  # bidirectional, all context from the floor
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def sequential(self, h: torch.Tensor, base_logits: torch.Tensor, anchor: torch.Tensor, temperature: float,
                   uniforms: torch.Tensor | None, forced: torch.Tensor | None) -> SequentialOut:
        """Left-to-right stage over h [B, γ, d] and U [B, γ, V]: bias, sample, confidence.
        uniforms [B, γ] drive inverse-CDF sampling (T > 0); forced [B, γ] replaces the samples."""
        B, gamma, V = base_logits.shape
        prev = anchor
        state = h.new_zeros(B, self.markov_head.rank) if self.markov_head is not None else None
        tokens, logits, probs = [], [], []
        for k in range(gamma):
            z = base_logits[:, k]
            if self.markov_head is not None:
                bias, state = self.markov_head.step(h[:, k], prev, state)
                z = z + bias
            if temperature > 0:
                p = torch.softmax(z.float() / temperature, dim=-1)
                tok = sample_inverse_cdf(p, uniforms[:, k]) if forced is None else forced[:, k]
            else:
                tok = z.argmax(-1) if forced is None else forced[:, k]
                p = nn.functional.one_hot(z.argmax(-1), V).float()
            tokens.append(tok)
            logits.append(z)
            probs.append(p)
            prev = tok
        tokens_t = torch.stack(tokens, 1)  # [B, γ]
        conf = self.confidence(h, torch.cat([anchor[:, None], tokens_t[:, :-1]], 1))
        return SequentialOut(tokens_t, torch.stack(logits, 1), torch.stack(probs, 1), conf)

    def confidence(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """h [B, γ, d], prev [B, γ] (the token before each slot: the anchor, then the drafts) ->
        confidence logits [B, γ] (zeros without a confidence head). One pass over the block: a
        slot's confidence reads only its own state and the token before it."""
        if self.confidence_head is None:
            return h.new_zeros(h.shape[:2])
        inp = h
        if self.cfg.confidence_head_with_markov:
            inp = torch.cat([h, self.markov_head.markov_w1(prev)], dim=-1)  # [B, γ, d + r]
        return self.confidence_head.proj(inp)[..., 0]


@dataclass
class DraftResult:
    """One drafting round, as numpy arrays (fp32)."""

    tokens: np.ndarray  # [γ] int64
    base_logits: np.ndarray  # [γ, V] U
    logits: np.ndarray  # [γ, V] U + B
    probs: np.ndarray  # [γ, V] p_d
    confidence_logits: np.ndarray  # [γ] (zeros without a confidence head)


class DraftSession:
    """Drafting rounds of one sequence, keeping the draft-side context cache between them.

    Round semantics (dspark.md §2): `features` are the raw target features
    [n, len(target_layer_ids)*d] of positions `cache_len .. start-1`; the block is the
    anchor at `start` plus γ-1 mask tokens. Afterwards the cache keeps context K/V for
    [0, start) and drops the block's own K/V.
    """

    def __init__(self, drafter: Drafter, max_len: int = 4096):
        self.drafter = drafter.eval()
        self.cache = drafter.new_cache(1, max_len)
        self.cache_len = 0

    @classmethod
    def from_checkpoint(cls, path: str, max_len: int = 4096, dtype: torch.dtype = torch.float32,
                        embeddings: tuple[torch.Tensor, torch.Tensor] | None = None) -> "DraftSession":
        from .checkpoint import load_drafter

        return cls(load_drafter(path, dtype=dtype, embeddings=embeddings), max_len)

    def reset(self) -> None:
        self.cache_len = 0

    @torch.inference_mode()
    def draft(self, features, anchor: int, start: int, temperature: float = 0.0,
              forced_tokens=None, uniforms=None, floor: int = 0) -> DraftResult:
        """`floor`: positions below it are not attended to (the context restarts there)."""
        d = self.drafter
        gamma = d.cfg.block_size
        dtype = d.fc.weight.dtype
        feats = torch.as_tensor(np.asarray(features), dtype=dtype).reshape(1, -1, d.cfg.feature_dim)
        if feats.shape[1] != start - self.cache_len:
            raise InputError(f"draft round: got {feats.shape[1]} context rows, expected start - cache_len = "
                             f"{start} - {self.cache_len} = {start - self.cache_len}")
        if not 0 <= floor <= self.cache_len:
            raise InputError(f"draft round: floor {floor} outside 0..cache_len {self.cache_len}")
        if start + gamma > self.cache.max_seq:
            raise InputError(f"draft round: block end {start + gamma} exceeds max_len {self.cache.max_seq}")
        if temperature < 0:
            raise InputError(f"temperature is {temperature}, expected >= 0")
        anchor_t = torch.tensor([anchor])
        forced = None if forced_tokens is None else torch.as_tensor(np.asarray(forced_tokens)).long().reshape(1, gamma)
        if temperature > 0 and forced is None and uniforms is None:
            raise InputError("draft round: temperature > 0 needs `uniforms` [γ] or `forced_tokens`")
        u = None if uniforms is None else torch.as_tensor(np.asarray(uniforms), dtype=torch.float64).reshape(1, gamma)
        h = d.backbone(feats, anchor_t, self.cache_len, start, self.cache, floor)
        base = d.lm_head(h)  # [1, γ, V]
        out = d.sequential(h, base, anchor_t, temperature, u, forced)
        self.cache_len = start

        def np32(t: torch.Tensor) -> np.ndarray:
            return t[0].float().numpy()

        return DraftResult(out.tokens[0].numpy(), np32(base), np32(out.logits), np32(out.probs),
                           np32(out.confidence_logits))


# SmolLM2 has no mask token; its `<empty_output>` special token (id 16) never occurs in
# chat text, so the default drafter uses it as the mask.
SMOLLM2_MASK_TOKEN_ID = 16


def init_drafter(target, *, num_layers: int = 1, block_size: int = 7, target_layer_ids: tuple[int, ...] | None = None,
                 markov_rank: int = 64, markov_head_type: str = "vanilla", confidence_head: bool = True,
                 mask_token_id: int = SMOLLM2_MASK_TOKEN_ID, seed: int = 0) -> Drafter:
    """A new (untrained) drafter for `target` (a TargetModel): the target's dimensions,
    its frozen embedding and LM head copied in, other weights randomly initialised."""
    from dspark.runtime.config import DrafterConfig

    t = target.cfg
    if target_layer_ids is None:  # spread over the target, skipping the last layer
        n = min(5, t.num_layers - 1)
        target_layer_ids = tuple(sorted({round(1 + i * (t.num_layers - 3) / max(1, n - 1)) for i in range(n)}))
    hf = {
        "model_type": "qwen3", "architectures": ["Qwen3DSparkModel" if markov_rank else "Qwen3DFlashModel"],
        "vocab_size": t.vocab_size, "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads,
        "head_dim": t.head_dim, "rms_norm_eps": t.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta},
        "max_position_embeddings": t.max_position_embeddings, "num_target_layers": t.num_layers,
        "block_size": block_size, "target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id,
        "num_anchors": 512, "markov_rank": markov_rank, "enable_confidence_head": confidence_head,
        "tie_word_embeddings": False, "layer_types": ["full_attention"] * num_layers,
    }
    if markov_rank:
        hf["markov_head_type"] = markov_head_type
    if confidence_head:
        hf["confidence_head_with_markov"] = bool(markov_rank)
    cfg = DrafterConfig.from_hf(hf)
    torch.manual_seed(seed)
    drafter = Drafter(cfg)
    for module in drafter.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.embed_tokens.weight)
        drafter.lm_head.weight.copy_(target.lm_head.weight)
    return drafter.to(target.embed_tokens.weight.dtype).eval()
