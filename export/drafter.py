"""PyTorch reference of the DSpark drafter (dspark.md §2–4): the one place its math is written.

`Drafter.backbone` is the parallel pass with KV injection (past context K/V, mask and
positions given); `Drafter.sequential` the left-to-right Markov stage, serving drawing
(argmax or inverse-CDF from given uniforms), teacher forcing and the draft vocabulary;
`Drafter.confidence` the confidence head. `DraftSession` runs drafting rounds of a
checkpoint and keeps the draft-side context cache between them; the exported drafter graph
(graphs.DrafterGraph) and the trainer (training.py) call the same methods."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dspark.runtime.config import DrafterConfig
from dspark.runtime.errors import InputError
from dspark.runtime.graph_io import MASKED
from dspark.runtime.sampling import inverse_cdf

from .layers import MLP, Projections, RMSNorm, attention, group_mask, rope_cos_sin
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

    def step(self, h: torch.Tensor, prev: torch.Tensor, state: torch.Tensor,
             w2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, d], prev [B], state [B, r] (RNN only) -> bias [B, V], new state. w2 [K, r]: the
        output projection's rows to use instead of markov_w2 (training over a draft vocabulary
        with gradients to those rows) -> bias [B, K]."""
        out_proj = self.markov_w2 if w2 is None else (lambda x: nn.functional.linear(x, w2))
        e = self.markov_w1(prev)  # [B, r]
        if self.kind == "vanilla":
            return out_proj(e), state
        if self.kind == "gated":
            g = torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1)))
            return out_proj(g * e), state
        gate, cand, out = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        s = torch.sigmoid(gate)
        state = s * state + (1 - s) * torch.tanh(cand)
        return out_proj(torch.tanh(out)), state


class ConfidenceHead(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        extra = cfg.markov_rank if cfg.confidence_head_with_markov else 0
        self.proj = nn.Linear(cfg.hidden_size + extra, 1)


@dataclass
class SequentialOut:
    tokens: torch.Tensor | None  # [B, γ] int64 vocabulary ids drawn (None under teacher forcing)
    logits: torch.Tensor  # [B, γ, K] U + B (K = V without a draft vocabulary)
    probs: torch.Tensor | None  # [B, γ, V] the draft distributions p_d (one-hot where greedy)
    confidence_logits: torch.Tensor  # [B, γ] (zeros without a confidence head)


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
        self.register_buffer("vocab", None, persistent=False)  # [K] the draft vocabulary's ids (restrict_vocab)

    def new_cache(self, batch: int, max_seq: int) -> StaticKV:
        c = self.cfg
        return StaticKV.empty(c.num_layers, batch, c.num_kv_heads, max_seq, c.head_dim,
                              dtype=self.fc.weight.dtype)

    def block(self, anchor: torch.Tensor) -> torch.Tensor:
        """anchor [B] -> the block's input ids [B, γ]: the anchor, then γ-1 mask tokens."""
        masks = torch.full_like(anchor[:, None], self.cfg.mask_token_id).expand(-1, self.cfg.block_size - 1)
        return torch.cat([anchor[:, None], masks], dim=1)

    def backbone(self, features: torch.Tensor, block_ids: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor, past_keys: Sequence[torch.Tensor] = (), past_values: Sequence[torch.Tensor] = ()
                 ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """One parallel pass (dspark.md §2).

        features [B, n, m·d] raw target features of the new context rows; block_ids [B, S] (one
        block, or several side by side); positions [B, n + S]: the context rows', then the block
        rows'; mask [B, 1 or S, P + n + S] additive over the keys [past ; context ; block];
        past_keys/past_values per layer [B, Hkv, P, D]: the cached context K/V (none: P = 0).

        -> h [B, S, d] the normed block states, and the new context rows' keys and values per
        layer [B, Hkv, n, D] (what a cache keeps; the block's own K/V are dropped)."""
        c = self.cfg
        n, S = features.shape[1], block_ids.shape[1]
        ctx = self.hidden_norm(self.fc(features))  # [B, n, d]
        x = self.embed_tokens(block_ids)  # [B, S, d]
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)  # [B, n + S, 1, D]
        ccos, csin, bcos, bsin = cos[:, :n], sin[:, :n], cos[:, n:], sin[:, n:]
        mask = group_mask(mask, c.num_heads // c.num_kv_heads, S).to(x.dtype)
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            ck, cv = attn.key_value(ctx, ccos, csin)  # context rows: no input_layernorm, no queries
            q, bk, bv = attn(layer.input_layernorm(x), bcos, bsin)
            k = torch.cat([ck, bk], dim=1).transpose(1, 2)  # [B, Hkv, n + S, D]
            v = torch.cat([cv, bv], dim=1).transpose(1, 2)
            x = x + attn.o_proj(attention(q, [*past_keys[i:i + 1], k], [*past_values[i:i + 1], v], mask))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            keys.append(k[:, :, :n])
            values.append(v[:, :, :n])
        return self.norm(x), keys, values

    def sequential(self, h: torch.Tensor, base: torch.Tensor, anchor: torch.Tensor,
                   temperature: torch.Tensor | None = None, uniforms: torch.Tensor | None = None,
                   prev: torch.Tensor | None = None, probs: bool = True,
                   rows: torch.Tensor | None = None) -> SequentialOut:
        """The γ left-to-right steps (dspark.md §3–4) over h [B, γ, d] and the base logits
        base [B, γ, K] = lm_head(h): slot k's logits are z_k = U_k + B(prev_k, ·).

        Drawing (prev None): prev_1 is the anchor [B], prev_{k+1} the token drawn at slot k: the
        argmax where temperature [B] is 0 (every row when it is None), else the inverse-CDF draw
        of softmax(z_k / T) at uniforms [B, γ]. Teacher forcing: prev [B, γ] given (the anchor,
        then the ground truth), nothing drawn. With a draft vocabulary (`restrict_vocab`) indices
        into the K logits are mapped to vocabulary ids. probs: also the draft distributions p_d
        [B, γ, V] (one-hot where greedy; zero outside the draft vocabulary).

        rows [K]: a draft vocabulary (sorted ids) for a drafter that was not cut down
        (training with `TrainConfig.draft_vocab`): base holds the K ids' logits, the Markov bias
        uses those rows of markov_w2 (gradients flow to them), and indices map to these ids, as
        `restrict_vocab` makes the exported graph do."""
        B, gamma, K = base.shape
        vocab = self.vocab if rows is None else rows
        w2 = None if rows is None or self.markov_head is None else self.markov_head.markov_w2.weight[rows]  # [K, r]
        if temperature is not None:
            greedy = temperature <= 0  # [B]
            inv_t = 1.0 / torch.where(greedy, torch.ones_like(temperature), temperature)
        slots = torch.arange(K, device=base.device)  # [K] indices into the base logits
        state = h.new_zeros(B, self.markov_head.rank) if self.markov_head is not None else None
        before = anchor
        biases, tokens, dists = [], [], []
        for k in range(gamma):
            if prev is not None:
                before = prev[:, k]
            if self.markov_head is not None:
                bias, state = self.markov_head.step(h[:, k], before, state, w2)  # [B, K]
                biases.append(bias)
            if prev is not None and not probs:
                continue  # teacher forcing for a loss: the logits are all it needs
            z = base[:, k] + biases[k] if biases else base[:, k]  # [B, K]
            top = torch.argmax(z, dim=-1)  # [B]
            idx, p = top, (slots[None, :] == top[:, None]).to(z.dtype)  # argmax, one-hot
            if temperature is not None:
                soft = torch.softmax(z.float() * inv_t[:, None], dim=-1)
                if prev is None:
                    idx = torch.where(greedy, top, inverse_cdf(soft, uniforms[:, k]))
                p = torch.where(greedy[:, None], p, soft)
            if prev is None:
                before = idx if vocab is None else vocab[idx]  # [B] vocabulary ids
                tokens.append(before)
            if probs:  # [B, K] -> [B, V], zero outside the draft vocabulary
                dists.append(p if vocab is None else
                             p.new_zeros(B, self.cfg.vocab_size).scatter(1, vocab[None, :].expand(B, K), p))
        logits = base + torch.stack(biases, 1) if biases else base  # [B, γ, K]
        drawn = torch.stack(tokens, 1) if prev is None else None  # [B, γ]
        if prev is None:
            prev = torch.cat([anchor[:, None], drawn[:, :-1]], 1)
        conf = self.confidence(h, prev)  # after the loop: one matmul over the block
        return SequentialOut(drawn, logits, torch.stack(dists, 1) if probs else None, conf)

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
        positions = torch.arange(self.cache_len, start + gamma)[None]  # [1, n + γ]
        mask = torch.zeros(1, 1, start + gamma, dtype=dtype)  # keys [past ; context ; block]
        mask[..., :floor] = MASKED
        h, keys, values = d.backbone(feats, d.block(anchor_t), positions, mask, *self.cache.past(self.cache_len))
        self.cache.write(self.cache_len, keys, values)
        self.cache_len = start
        base = d.lm_head(h)  # [1, γ, V]
        temp = None if temperature == 0 else torch.tensor([temperature], dtype=torch.float32)
        prev = None if forced is None else torch.cat([anchor_t[:, None], forced[:, :-1]], 1)
        out = d.sequential(h, base, anchor_t, temp, u, prev)
        tokens = out.tokens if forced is None else forced

        def np32(t: torch.Tensor) -> np.ndarray:
            return t[0].float().numpy()

        return DraftResult(tokens[0].numpy(), np32(base), np32(out.logits), np32(out.probs),
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
