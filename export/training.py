"""Training a DSpark (or DFlash) drafter against a frozen target (dspark.md §6).

The pieces, in the order a step uses them:

1. `sample_anchors` / `build_blocks`: anchors p drawn from the response (p and p+1 both
   response tokens); block inputs [x_p, mask, …, mask] at positions p..p+γ-1; slot k
   (0-based) targets x[p+1+k]; a slot is supervised only while the response lasts.
2. `draft_block_states`: `Drafter.backbone` for many anchors of a sequence at once. Every
   block's queries see the context rows 0..p-1 of its own anchor and the γ rows of its own
   block (one additive mask), so the weights trained here are exactly the inference model's
   (`DraftSession`, the exported graph).
3. `teacher_forced_heads`: base logits U = lm_head(h), then `Drafter.sequential` with the
   ground-truth previous tokens (the anchor for slot 0; RNN state threaded across slots):
   the corrected logits U + B and the confidence logits.
4. `draft_losses`: per-slot weights w_k = exp(-k/λ) on valid slots; weighted means of
   CE(p_d, x*), ‖p_d − p_t‖₁ and BCE(sigmoid(c), c*) with c* = 1 − ½‖p_d − p_t‖₁ (detached).
   p_t = softmax(lm_head(target's final-normed last hidden state)) at T = 1. DFlash: CE only.
   With `TrainConfig.draft_vocab` = K the drafter scores only the K ids of the export's draft
   vocabulary (`draft_vocab.choose_vocab`), and the terms are the exact ones of a drafter that
   never proposes outside them (`draft_losses`: TV with a tail bucket, CE dropped where x* is
   outside the K ids).
5. `Trainer`: AdamW, linear warmup + cosine decay, gradient clipping, checkpoints that a
   later session resumes (same `TrainConfig` required), tqdm progress with the loss terms
   and the per-slot acceptance estimate (mean c* of each slot).

Data comes from any `SequenceSource` (see `dspark.export.train_data`): per sequence the
tokens, the response mask, the raw target features at the drafter's `target_layer_ids`
[T, m·d] and the target's last hidden state *after* its final norm [T, d] (so that
lm_head of it are the target's logits; the target itself is not needed at train time).
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from dspark.runtime.config import MARKOV_HEAD_TYPES, DrafterConfig, TargetConfig
from dspark.runtime.errors import CheckpointError, ConfigError
from dspark.runtime.graph_io import MASKED

from .checkpoint import SHARED, load_drafter, read_config, save_drafter
from .drafter import SMOLLM2_MASK_TOKEN_ID, Drafter, init_drafter
from .target import TargetModel

MAX_ANCHORS = 512  # DeepSpec's cap per sequence (dspark.md §6)
ANCHOR_MULTIPLE, LENGTH_MULTIPLE = 16, 128  # a batch's A and T are padded to these (few tensor sizes)
TRAINER_STATE = "trainer_state.pt"
CHECKPOINTS = "checkpoints"


# --- Configuration ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the numbers a run computes. A checkpoint records it; resuming
    with a config that differs in any field raises `ConfigError` (see `check_resume_config`).
    Run controls that do not change the maths (output directory, save/log intervals, micro-
    batching, progress bar, time budget) are `Trainer` arguments instead."""

    # The drafter (dspark.md §2-4); its other dimensions are the target's.
    block_size: int = 7  # γ: anchor + γ-1 masks -> γ drafts
    num_layers: int = 2
    target_layer_ids: tuple[int, ...] = (1, 8, 15, 22, 28)
    markov_rank: int = 56  # 0 = no Markov head (DFlash)
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn
    mask_token_id: int = SMOLLM2_MASK_TOKEN_ID
    dflash: bool = False  # CE only, no Markov head, no confidence head
    # Data.
    anchors_per_seq: int = 64  # up to MAX_ANCHORS
    max_seq_len: int = 2048  # longer sequences are cut (the target's features are causal)
    # Loss (dspark.md §6).
    alpha_ce: float = 0.1
    alpha_tv: float = 0.9
    alpha_conf: float = 1.0
    decay: float = 4.0  # λ in w_k = exp(-k/λ), k 0-based
    # Optimisation.
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 200
    steps: int = 6000
    batch: int = 8  # sequences per step
    grad_clip: float = 1.0
    seed: int = 0  # drafter initialisation, data order, anchor sampling
    init_from: str = ""  # a DeepSpec checkpoint whose weights start the run ("" = random init by seed)
    amp: str = "none"  # "bf16": autocast to bfloat16 (fp32 master weights); "none": fp32
    # The drafter proposes from K ids only (0 = the whole vocabulary): the ids `dspark export
    # --draft-vocab K` picks (draft_vocab.choose_vocab: stop tokens, then the most frequent
    # response tokens); the Trainer is given them (`training_vocab`). See `draft_losses`.
    draft_vocab: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        problems = []
        if self.block_size < 1:
            problems.append(f"block_size is {self.block_size}, expected >= 1")
        if self.num_layers < 1:
            problems.append(f"num_layers is {self.num_layers}, expected >= 1")
        if not 1 <= self.anchors_per_seq <= MAX_ANCHORS:
            problems.append(f"anchors_per_seq is {self.anchors_per_seq}, expected 1..{MAX_ANCHORS}")
        if self.markov_rank < 0:
            problems.append(f"markov_rank is {self.markov_rank}, expected >= 0")
        if self.markov_rank and self.markov_head_type not in MARKOV_HEAD_TYPES:
            problems.append(f"markov_head_type is {self.markov_head_type!r}, expected one of {list(MARKOV_HEAD_TYPES)}")
        if self.dflash and self.markov_rank:
            problems.append(f"dflash is true but markov_rank is {self.markov_rank} (a DFlash drafter has no Markov "
                            "head: set markov_rank=0)")
        if not self.dflash and not self.markov_rank:
            problems.append("markov_rank is 0 but dflash is false (DSpark needs a Markov head; use dflash=True)")
        if self.decay <= 0:
            problems.append(f"decay is {self.decay}, expected > 0")
        if self.steps < 1 or self.batch < 1 or self.warmup_steps < 0:
            problems.append(f"steps={self.steps}, batch={self.batch}, warmup_steps={self.warmup_steps}: "
                            "expected steps >= 1, batch >= 1, warmup_steps >= 0")
        if self.amp not in ("none", "bf16"):
            problems.append(f"amp is {self.amp!r}, expected 'none' or 'bf16'")
        if self.draft_vocab < 0:
            problems.append(f"draft_vocab is {self.draft_vocab}, expected >= 0 (0 = the whole vocabulary)")
        if self.max_seq_len < self.block_size + 1:
            problems.append(f"max_seq_len is {self.max_seq_len}, expected > block_size")
        if problems:
            raise ConfigError("train config: " + "; ".join(problems))

    @property
    def confidence_head(self) -> bool:
        return not self.dflash

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"train config: unknown fields {unknown}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        return cls.from_dict(json.loads(text))


def config_differences(saved: TrainConfig, requested: TrainConfig) -> list[str]:
    """'field: checkpoint has A, requested B' for every field that differs."""
    a, b = saved.to_dict(), requested.to_dict()
    return [f"{k}: checkpoint has {a[k]!r}, requested {b[k]!r}" for k in a if a[k] != b[k]]


def check_resume_config(saved: TrainConfig, requested: TrainConfig | None) -> None:
    """Raise `ConfigError` naming every differing field (None = take the checkpoint's)."""
    if requested is None:
        return
    diff = config_differences(saved, requested)
    if diff:
        raise ConfigError("resume: the requested train config differs from the checkpoint's in "
                          f"{len(diff)} field(s): " + "; ".join(diff)
                          + ". Resume with the checkpoint's config (omit the overrides) or start a new run.")


def build_drafter(target: TargetModel, cfg: TrainConfig) -> Drafter:
    """The drafter a run starts from, fp32: `cfg.init_from`'s weights (a warm start, e.g. a
    later session continuing the shipped drafter), or a fresh one as `cfg` describes it
    (`init_drafter`: the target's dimensions, its embedding and LM head copied in)."""
    if cfg.init_from:
        drafter = load_drafter(cfg.init_from, dtype=torch.float32,
                               embeddings=(target.embed_tokens.weight, target.lm_head.weight))
        check_drafter_matches(drafter, cfg)
        return drafter
    return init_drafter(target, num_layers=cfg.num_layers, block_size=cfg.block_size,
                        target_layer_ids=cfg.target_layer_ids, markov_rank=cfg.markov_rank,
                        markov_head_type=cfg.markov_head_type, confidence_head=cfg.confidence_head,
                        mask_token_id=cfg.mask_token_id, seed=cfg.seed).float()


def architecture_of(checkpoint: str | Path) -> dict:
    """The `TrainConfig` architecture fields of a DeepSpec checkpoint (a warm start's defaults)."""
    c = DrafterConfig.from_hf(read_config(Path(checkpoint)))
    arch = {"block_size": c.block_size, "num_layers": c.num_layers, "target_layer_ids": c.target_layer_ids,
            "markov_rank": c.markov_rank, "mask_token_id": c.mask_token_id,
            "dflash": c.markov_rank == 0 and not c.enable_confidence_head}
    if c.markov_head_type:
        arch["markov_head_type"] = c.markov_head_type
    return arch


def check_drafter_matches(drafter: Drafter, cfg: TrainConfig) -> None:
    """The drafter's architecture is the one `cfg` describes."""
    c = drafter.cfg
    pairs = (("block_size", c.block_size, cfg.block_size), ("num_layers", c.num_layers, cfg.num_layers),
             ("target_layer_ids", c.target_layer_ids, cfg.target_layer_ids),
             ("markov_rank", c.markov_rank, cfg.markov_rank),
             ("markov_head_type", c.markov_head_type, cfg.markov_head_type if cfg.markov_rank else None),
             ("mask_token_id", c.mask_token_id, cfg.mask_token_id),
             ("enable_confidence_head", c.enable_confidence_head, cfg.confidence_head))
    bad = [f"{name}: drafter has {a!r}, train config {b!r}" for name, a, b in pairs if a != b]
    if bad:
        raise ConfigError("drafter and train config disagree: " + "; ".join(bad))


def training_vocab(cfg: TrainConfig, vocab_size: int, stop_token_ids, counts=None) -> torch.Tensor | None:
    """The draft vocabulary a run with `cfg.draft_vocab` = K trains over: [K] sorted ids, chosen
    exactly as `dspark export --draft-vocab K` chooses them (`draft_vocab.choose_vocab` with the
    target's stop tokens and the token counts of the training responses, which `train_drafter.py
    export` ships as token_counts.json), so the ids trained on are the ids the exported graph
    proposes. None when `cfg.draft_vocab` is 0 (the whole vocabulary)."""
    if not cfg.draft_vocab:
        return None
    from .draft_vocab import choose_vocab

    return choose_vocab(cfg.draft_vocab, vocab_size, stop_token_ids, counts)


def check_vocab(cfg: TrainConfig, vocab: torch.Tensor | None, vocab_size: int) -> None:
    """`vocab` is what `cfg.draft_vocab` asks for: None for 0, else K sorted distinct ids < V."""
    if not cfg.draft_vocab:
        if vocab is not None:
            raise ConfigError(f"a draft vocabulary of {len(vocab)} ids was given but the train config's "
                              "draft_vocab is 0 (the whole vocabulary)")
        return
    if vocab is None:
        raise ConfigError(f"draft_vocab is {cfg.draft_vocab}: pass the ids (training_vocab)")
    v = vocab.cpu()
    if (v.ndim != 1 or len(v) != cfg.draft_vocab or bool((v[1:] <= v[:-1]).any())
            or int(v.min()) < 0 or int(v.max()) >= vocab_size):
        raise ConfigError(f"draft vocabulary: expected {cfg.draft_vocab} sorted distinct ids in 0..{vocab_size - 1}, "
                          f"got a tensor of shape {tuple(v.shape)}")


def drafter_param_count(target_cfg: TargetConfig, cfg: TrainConfig) -> int:
    """Parameters of the drafter `cfg` describes, without the shared embedding and LM head
    (measured by building it on the meta device: no memory, no weights)."""
    rng = torch.random.get_rng_state()  # init_drafter seeds the global RNG
    try:
        with torch.device("meta"):
            drafter = build_drafter(TargetModel(target_cfg), cfg)
    finally:
        torch.random.set_rng_state(rng)
    return sum(p.numel() for name, p in drafter.state_dict().items() if name not in SHARED)


def max_markov_rank(target_cfg: TargetConfig, cfg: TrainConfig, budget_bytes: int = 30_000_000,
                    bytes_per_param: int = 2, multiple: int = 8) -> int:
    """The largest Markov rank (a multiple of `multiple`) that keeps the drafter without its
    embeddings within `budget_bytes` (bf16 = 2 bytes a parameter). 0 if even rank `multiple` is over."""
    def size(rank: int) -> int:
        c = TrainConfig.from_dict({**cfg.to_dict(), "markov_rank": rank, "dflash": rank == 0})
        return drafter_param_count(target_cfg, c) * bytes_per_param

    m = multiple
    if size(m) > budget_bytes:
        return 0
    slope = (size(2 * m) - size(m)) / m  # bytes per unit of rank: 2·(2·V + 1) with the confidence input
    rank = m + int((budget_bytes - size(m)) // slope) // m * m
    while rank > m and size(rank) > budget_bytes:
        rank -= m
    while size(rank + m) <= budget_bytes:
        rank += m
    return int(rank)


# --- Data -------------------------------------------------------------------------------------------


@dataclass
class TrainSequence:
    """One target-generated sequence and the frozen target's states over it."""

    tokens: torch.Tensor  # [T] int64: prompt + response
    response_mask: torch.Tensor  # [T] bool: True on response tokens
    features: torch.Tensor  # [T, m·d] raw target features at target_layer_ids (fp16/fp32)
    final_hidden: torch.Tensor  # [T, d] target's last hidden state after its final norm


class SequenceSource(Protocol):
    """What the trainer reads: indexable `TrainSequence`s and a fingerprint of the data."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> TrainSequence: ...

    def fingerprint(self) -> str: ...


@dataclass
class Blocks:
    """The blocks of one sequence's anchors (DeepSpec's convention: the anchor is slot 0)."""

    anchors: torch.Tensor  # [A] anchor positions p
    inputs: torch.Tensor  # [A, γ] block input ids: x_p, mask, …, mask
    positions: torch.Tensor  # [A, γ] p + k
    prev: torch.Tensor  # [A, γ] teacher-forced previous token of slot k: x[p+k] (the anchor for k = 0)
    labels: torch.Tensor  # [A, γ] x[p+1+k] (0 where invalid)
    valid: torch.Tensor  # [A, γ] bool: x[p+1..p+1+k] all response tokens


def anchor_candidates(response_mask: torch.Tensor) -> torch.Tensor:
    """response_mask [T] bool -> positions p [C] where p and p+1 are both response tokens."""
    ok = response_mask[:-1] & response_mask[1:]  # [T-1]
    return ok.nonzero()[:, 0]


def sample_anchors(response_mask: torch.Tensor, max_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `max_anchors` candidates, uniformly without replacement, sorted -> [A] int64."""
    cand = anchor_candidates(response_mask)  # [C]
    if len(cand) <= max_anchors:
        return cand
    pick = torch.randperm(len(cand), generator=generator)[:max_anchors]
    return cand[pick].sort().values


def build_blocks(tokens: torch.Tensor, response_mask: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 mask_token_id: int) -> Blocks:
    """tokens, response_mask [T]; anchors [A] -> the blocks, targets and validity of each slot."""
    T = tokens.shape[0]
    k = torch.arange(block_size)  # [γ]
    positions = anchors[:, None] + k  # [A, γ]
    target_pos = positions + 1  # [A, γ] slot k predicts x[p+1+k]
    in_seq = target_pos < T
    is_resp = response_mask[target_pos.clamp(max=T - 1)] & in_seq  # [A, γ]
    valid = is_resp.long().cumprod(dim=1).bool()  # supervision stops at the first position past the response
    inputs = torch.full_like(positions, mask_token_id)
    inputs[:, 0] = tokens[anchors]
    prev = tokens[positions.clamp(max=T - 1)]  # [A, γ]
    labels = torch.where(valid, tokens[target_pos.clamp(max=T - 1)], torch.zeros_like(positions))
    return Blocks(anchors, inputs, positions, prev, labels, valid)


@dataclass
class TrainBatch:
    """Sequences padded to T (right), anchors padded to A (padding anchors: p = 0, all slots invalid)."""

    features: torch.Tensor  # [B, T, m·d]
    final_hidden: torch.Tensor  # [B, T, d]
    anchors: torch.Tensor  # [B, A]
    anchor_ok: torch.Tensor  # [B, A] bool: a real anchor
    inputs: torch.Tensor  # [B, A, γ]
    positions: torch.Tensor  # [B, A, γ]
    prev: torch.Tensor  # [B, A, γ]
    labels: torch.Tensor  # [B, A, γ]
    valid: torch.Tensor  # [B, A, γ] bool

    def to(self, device) -> "TrainBatch":
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def collate(items: list[tuple[TrainSequence, Blocks]], mask_token_id: int, anchor_multiple: int = 1,
            length_multiple: int = 1) -> TrainBatch:
    """Pads A and T up to multiples of `anchor_multiple` and `length_multiple`: the step's
    big tensors ([B·A, γ, V] and [B, T, ·]) then take a few sizes only, and the allocator
    reuses their blocks instead of fragmenting the heap with new sizes every step."""
    B = len(items)
    T = _round_up(max(s.tokens.shape[0] for s, _ in items), length_multiple)
    A = _round_up(max(1, max(b.anchors.shape[0] for _, b in items)), anchor_multiple)
    gamma = items[0][1].inputs.shape[1]
    s0 = items[0][0]
    feats = s0.features.new_zeros(B, T, s0.features.shape[1])
    hid = s0.final_hidden.new_zeros(B, T, s0.final_hidden.shape[1])
    anchors = torch.zeros(B, A, dtype=torch.long)
    ok = torch.zeros(B, A, dtype=torch.bool)
    inputs = torch.full((B, A, gamma), mask_token_id, dtype=torch.long)
    positions = torch.arange(gamma).repeat(B, A, 1)
    prev = torch.zeros(B, A, gamma, dtype=torch.long)
    labels = torch.zeros(B, A, gamma, dtype=torch.long)
    valid = torch.zeros(B, A, gamma, dtype=torch.bool)
    for i, (s, b) in enumerate(items):
        t, a = s.tokens.shape[0], b.anchors.shape[0]
        feats[i, :t], hid[i, :t] = s.features, s.final_hidden
        anchors[i, :a], ok[i, :a] = b.anchors, True
        inputs[i, :a], positions[i, :a], prev[i, :a] = b.inputs, b.positions, b.prev
        labels[i, :a], valid[i, :a] = b.labels, b.valid
    return TrainBatch(feats, hid, anchors, ok, inputs, positions, prev, labels, valid)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def truncate(seq: TrainSequence, max_len: int) -> TrainSequence:
    if seq.tokens.shape[0] <= max_len:
        return seq
    return TrainSequence(seq.tokens[:max_len], seq.response_mask[:max_len], seq.features[:max_len],
                         seq.final_hidden[:max_len])


def _generator(*parts: int) -> torch.Generator:
    digest = hashlib.sha256(",".join(str(p) for p in parts).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


class BatchPlan:
    """Which sequences and anchors step `s` uses: a pure function of (seed, step), so a
    resumed run sees exactly the batches an uninterrupted one would. Epoch e visits the
    sequences in a random permutation drawn from (seed, e)."""

    def __init__(self, n: int, batch: int, seed: int):
        if n == 0:
            raise ConfigError("training data is empty")
        self.n, self.batch, self.seed = n, batch, seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            self._perms = {epoch: torch.randperm(self.n, generator=_generator(self.seed, epoch, 0xE9))}
        return self._perms[epoch]

    def indices(self, step: int) -> list[int]:
        out = []
        for j in range(step * self.batch, (step + 1) * self.batch):
            epoch, i = divmod(j, self.n)
            out.append(int(self._perm(epoch)[i]))
        return out

    def anchor_generator(self, step: int, slot: int) -> torch.Generator:
        return _generator(self.seed, step, slot, 0xA7)


def _batch_of(data: SequenceSource, picks: list[tuple[int, torch.Generator]], cfg: TrainConfig) -> TrainBatch:
    """The batch of sequences `data[i]`, each with anchors drawn by its generator."""
    items = []
    for idx, gen in picks:
        seq = truncate(data[idx], cfg.max_seq_len)  # features may stay on the device (on-the-fly source)
        seq = TrainSequence(seq.tokens.cpu(), seq.response_mask.cpu(), seq.features, seq.final_hidden)
        anchors = sample_anchors(seq.response_mask, cfg.anchors_per_seq, gen)
        blocks = build_blocks(seq.tokens, seq.response_mask, anchors, cfg.block_size, cfg.mask_token_id)
        items.append((seq, blocks))
    return collate(items, cfg.mask_token_id, ANCHOR_MULTIPLE, LENGTH_MULTIPLE)


def make_batch(data: SequenceSource, plan: BatchPlan, step: int, cfg: TrainConfig) -> TrainBatch:
    return _batch_of(data, [(idx, plan.anchor_generator(step, slot)) for slot, idx in enumerate(plan.indices(step))],
                     cfg)


# --- Forward ----------------------------------------------------------------------------------------


def block_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """anchors [B, A] -> additive mask [B, A·γ, T + A·γ] over the keys [context ; blocks]. Query
    (a, k) sees the context rows j < p_a and the γ rows of its own block (bidirectional)."""
    B, A = anchors.shape
    dev = anchors.device
    ctx = torch.arange(context_len, device=dev)[None, None, :] < anchors[:, :, None]  # [B, A, T]
    ctx = ctx[:, :, None, :].expand(B, A, block_size, context_len).reshape(B, A * block_size, context_len)
    owner = torch.arange(A, device=dev).repeat_interleave(block_size)  # [A·γ] block of each row
    own = (owner[:, None] == owner[None, :]).expand(B, -1, -1)  # [B, A·γ, A·γ]
    return torch.where(torch.cat([ctx, own], dim=-1), 0.0, MASKED)


def draft_block_states(drafter: Drafter, features: torch.Tensor, anchors: torch.Tensor, inputs: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
    """`Drafter.backbone` for all anchors of a sequence at once: every position's features are
    context rows, the blocks sit side by side, and `block_attention_mask` keeps each block to
    its own anchor's context and its own rows; nothing is cached.

    features [B, T, m·d] raw target features of every position; anchors [B, A];
    inputs, positions [B, A, γ] -> normed block states h [B, A, γ, d]."""
    B, T = features.shape[:2]
    A, gamma = inputs.shape[1:]
    features = features.to(drafter.fc.weight.dtype)
    ctx_pos = torch.arange(T, device=features.device).expand(B, T)
    mask = block_attention_mask(anchors, T, gamma)  # [B, A·γ, T + A·γ]
    h, _, _ = drafter.backbone(features, inputs.reshape(B, A * gamma),
                               torch.cat([ctx_pos, positions.reshape(B, A * gamma)], dim=1), mask)
    return h.reshape(B, A, gamma, -1)


@dataclass
class HeadOutputs:
    base_logits: torch.Tensor  # [N, γ, V] U
    logits: torch.Tensor  # [N, γ, V] U + B (= U for DFlash)
    confidence_logits: torch.Tensor | None  # [N, γ] (None without a confidence head)


def teacher_forced_heads(drafter: Drafter, h: torch.Tensor, prev: torch.Tensor,
                         vocab: torch.Tensor | None = None) -> HeadOutputs:
    """h [N, γ, d] normed block states; prev [N, γ] ground-truth previous tokens -> logits:
    `Drafter.sequential` teacher-forced (the Markov state threaded across slots). vocab [K]: a
    draft vocabulary: the frozen LM head's rows and the Markov output projection's rows of
    those ids only, as `restrict_vocab` cuts them for the export -> logits [N, γ, K]."""
    if vocab is None:
        base = drafter.lm_head(h)  # [N, γ, V]
    else:
        base = F.linear(h, drafter.lm_head.weight[vocab])  # [N, γ, K]
    out = drafter.sequential(h, base, prev[:, 0], prev=prev, probs=False, rows=vocab)
    conf = out.confidence_logits if drafter.confidence_head is not None else None  # [N, γ]
    return HeadOutputs(base, out.logits, conf)


# --- Losses -----------------------------------------------------------------------------------------


def slot_weights(block_size: int, decay: float) -> torch.Tensor:
    """w_k = exp(-k/λ), k = 0..γ-1 -> [γ]."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / decay)


@dataclass
class LossTerms:
    total: torch.Tensor  # scalar, what is optimised
    ce: torch.Tensor  # scalar, weighted mean of CE(p_d, x*)
    tv: torch.Tensor  # scalar, weighted mean of ‖p_d − p_t‖₁
    conf: torch.Tensor  # scalar, weighted mean of BCE(sigmoid(c), c*) (0 without a confidence head)
    accept_sum: torch.Tensor  # [γ] Σ c* over valid slots (detached)
    slot_count: torch.Tensor  # [γ] number of valid slots
    ce_dropped: torch.Tensor | None = None  # valid slots whose label lies outside the draft vocabulary (CE weight 0)

    @property
    def acceptance(self) -> torch.Tensor:
        """[γ] mean c* of each slot (NaN where no slot was valid): the expected acceptance rate
        of slot k given that slots < k were accepted (teacher-forced, T = 1)."""
        return self.accept_sum / self.slot_count.clamp_min(1) + torch.where(self.slot_count > 0, 0.0, math.nan)


class DistillLoss(torch.autograd.Function):
    """Σ a·CE(p_d, x*) + b·‖p_d − p_t‖₁ over rows, with its gradient, one chunk of rows at a time.

    logits [M, V] draft logits (any float dtype; softmax in fp32), target_logits [M, V] (no
    gradient), labels [M], a, b [M] fp32 coefficients -> (scalar loss, ce [M], l1 [M]); ce and
    l1 are detached. The gradient with respect to the logits, a·(p_d − onehot(x*)) +
    b·p_d ⊙ (s − ⟨p_d, s⟩) with s = sign(p_d − p_t), is formed in the forward pass chunk by
    chunk, so the [M, V] intermediates of the plain autograd graph (log-softmax, probabilities,
    differences, signs and their backward passes) never exist.

    Over a draft vocabulary of K ids (target_lse [M] given): logits [M, K] score the K ids,
    target_logits [M, K] are the target's logits of the same ids and target_lse its
    log-normalizer over the whole vocabulary, so p_t = exp(z_t − lse) over the K ids and the
    tail bucket p_t(tail) = 1 − Σ_K p_t. A drafter that proposes only the K ids has
    ‖p_d − p_t‖₁ = Σ_K |p_d − p_t| + p_t(tail) exactly (= 2·TV); the tail term has no gradient,
    so the gradient keeps the form above over the K columns. labels are indices into the K ids."""

    CHUNK = 16  # rows: a [16, 49152] fp32 temporary is 3 MB

    @staticmethod
    def forward(ctx, logits, target_logits, labels, a, b, target_lse=None):
        M = logits.shape[0]
        grad = torch.empty_like(logits)  # [M, V] d loss / d logits
        ce = logits.new_empty(M, dtype=torch.float32)
        l1 = logits.new_empty(M, dtype=torch.float32)
        with torch.autocast(logits.device.type, enabled=False):
            DistillLoss._rows(logits, target_logits, labels, a, b, grad, ce, l1, target_lse)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(ce, l1)
        return (a * ce).sum() + (b * l1).sum(), ce, l1

    @staticmethod
    def _rows(logits, target_logits, labels, a, b, grad, ce, l1, target_lse=None) -> None:
        with_tv = bool(b.any())  # DFlash only logs ‖p_d − p_t‖₁: no gradient term to form
        for lo in range(0, logits.shape[0], DistillLoss.CHUNK):
            sl = slice(lo, lo + DistillLoss.CHUNK)
            logp = torch.log_softmax(logits[sl].float(), dim=-1)  # [c, V]
            p = logp.exp()
            if target_lse is None:
                s = p - torch.softmax(target_logits[sl].float(), dim=-1)  # p_d − p_t
                l1[sl] = s.abs().sum(-1)
            else:  # [c, K]: p_t of the K ids, and the target's mass outside them (no gradient)
                pt = torch.exp(target_logits[sl].float() - target_lse[sl, None].float())
                tail = (1.0 - pt.sum(-1)).clamp_min(0.0)  # [c]
                s = p - pt
                l1[sl] = s.abs().sum(-1) + tail
            s.sign_()
            y = labels[sl, None]  # [c, 1]
            ce[sl] = -logp.gather(-1, y)[:, 0]
            g = p * a[sl, None]  # a·p
            if with_tv:
                g.add_(s.sub_((p * s).sum(-1, keepdim=True)).mul_(p).mul_(b[sl, None]))  # + b·p ⊙ (s − ⟨p, s⟩)
            g.scatter_add_(-1, y, -a[sl, None])  # − a·onehot(x*)
            grad[sl] = g

    @staticmethod
    def backward(ctx, g_loss, _g_ce, _g_l1):
        (grad,) = ctx.saved_tensors
        return grad * g_loss.to(grad.dtype), None, None, None, None, None


def draft_losses(logits: torch.Tensor, confidence_logits: torch.Tensor | None, target_logits: torch.Tensor,
                 labels: torch.Tensor, valid: torch.Tensor, cfg: TrainConfig,
                 weight_total: torch.Tensor | float | None = None, target_lse: torch.Tensor | None = None,
                 vocab: torch.Tensor | None = None) -> LossTerms:
    """dspark.md §6 on N blocks.

    logits [N, γ, V] corrected draft logits U + B; confidence_logits [N, γ] or None;
    target_logits [N, γ, V] the target's logits for the same tokens; labels [N, γ];
    valid [N, γ] bool. Each term is Σ w·term / Σ w over valid slots; `weight_total`
    overrides the denominator (micro-batches of one step share the step's Σ w).

    A draft vocabulary (vocab [K] sorted ids; `TrainConfig.draft_vocab`): logits [N, γ, K] over
    those ids, target_logits [N, γ, K] the target's logits of the same ids and target_lse
    [N, γ] the target's logsumexp over the whole vocabulary. The drafter then never proposes
    outside the K ids, and the terms are exact for such a drafter:
    - TV = ½ Σ_K |p_d − p_t| + ½ p_t(tail), p_t(tail) = 1 − Σ_K p_t (the L1 term is 2·TV), and
      c* = 1 − TV is still the exact acceptance probability (`DistillLoss`);
    - CE rule: a valid slot whose label x* lies outside the K ids gets CE weight 0 (the drafter
      can never propose x*, so no finite loss on K logits stands for it); its TV term and its
      confidence term stay. `ce` logs Σ w·CE over the other slots divided by the same Σ w, and
      `ce_dropped` counts the slots dropped that way."""
    gamma = logits.shape[1]
    w = slot_weights(gamma, cfg.decay).to(logits.device)[None] * valid  # [N, γ]
    ce_keep = None  # [N, γ] bool: slots whose CE counts (draft vocabulary only)
    if vocab is not None:
        if target_lse is None:
            raise ValueError("draft_losses over a draft vocabulary needs target_lse")
        vocab = vocab.to(labels.device)
        at = torch.searchsorted(vocab, labels).clamp(max=len(vocab) - 1)  # [N, γ] index of x* among the K ids
        ce_keep = vocab[at] == labels
        labels = torch.where(ce_keep, at, torch.zeros_like(at))  # outside K: any index, its CE weight is 0
    denom = w.sum() if weight_total is None else torch.as_tensor(weight_total, device=logits.device)
    denom = denom.clamp_min(1e-12)

    def wmean(t: torch.Tensor) -> torch.Tensor:  # t [N, γ]
        return (w * t).sum() / denom

    w_ce = w if ce_keep is None else w * ce_keep
    a = w_ce * ((1.0 if cfg.dflash else cfg.alpha_ce) / denom)  # [N, γ] each slot's CE coefficient in the total
    b = w * (0.0 if cfg.dflash else cfg.alpha_tv / denom)  # DFlash: ‖p_d − p_t‖₁ logged, not optimised
    V = logits.shape[-1]
    lse = None if target_lse is None else target_lse.reshape(-1)
    head, ce, l1 = DistillLoss.apply(logits.reshape(-1, V), target_logits.reshape(-1, V), labels.reshape(-1),
                                     a.reshape(-1).float(), b.reshape(-1).float(), lse)
    ce, l1 = ce.view_as(w), l1.view_as(w)  # [N, γ]
    if ce_keep is not None:
        ce = torch.where(ce_keep, ce, torch.zeros_like(ce))  # dropped slots: CE 0 (logged so)
    c_star = (1.0 - 0.5 * l1).clamp(0.0, 1.0)  # the exact acceptance probability of each slot
    bce = logits.new_zeros((), dtype=torch.float32)
    if confidence_logits is not None:
        bce = wmean(F.binary_cross_entropy_with_logits(confidence_logits.float(), c_star, reduction="none"))
    total = head if cfg.dflash else head + cfg.alpha_conf * bce
    ce_m, tv_m = wmean(ce), wmean(l1)  # logged
    vf = valid.float()
    dropped = None if ce_keep is None else (valid & ~ce_keep).sum().detach()
    return LossTerms(total, ce_m, tv_m, bce, (c_star * vf).sum(0).detach(), vf.sum(0), dropped)


def teacher_logits(weight: torch.Tensor, hidden: torch.Tensor, bf16: bool = False, exact_top: int = 16) -> torch.Tensor:
    """The target's logits lm_head(hidden): weight [V, d], hidden [N, γ, d] -> [N, γ, V] fp32, for
    the token after each slot. With `bf16` the GEMM runs in bf16 (faster on a CPU with bf16
    instructions) and the `exact_top` largest logits of each row, which carry nearly all of the
    distribution's mass, are recomputed in fp32; the rest keep bf16's rounding (relative 2^-9)."""
    w = weight.float()
    return _teacher_logits(w, w.bfloat16() if bf16 else None, hidden, exact_top)


def _teacher_logits(w: torch.Tensor, w_bf16: torch.Tensor | None, hidden: torch.Tensor, exact_top: int) -> torch.Tensor:
    """`teacher_logits` with the fp32 weight w [V, d] and its bf16 copy (None: fp32 GEMM) given."""
    if w_bf16 is None:
        return hidden.float() @ w.T
    logits = (hidden.bfloat16().flatten(0, -2) @ w_bf16.T).float().view(*hidden.shape[:-1], -1)  # [N, γ, V]
    top = logits.topk(min(exact_top, logits.shape[-1]), dim=-1).indices  # [N, γ, k]
    exact = (w[top] @ hidden.float()[..., None])[..., 0]  # [N, γ, k, d] @ [N, γ, d, 1] -> [N, γ, k]
    return logits.scatter_(-1, top, exact)


TEACHER_CHUNK = 512  # positions per full-vocabulary GEMM of `teacher_vocab_logits` ([512, 49152] fp32: 100 MB)


def teacher_vocab_logits(weight: torch.Tensor, final_hidden: torch.Tensor, positions: torch.Tensor,
                         valid: torch.Tensor, vocab: torch.Tensor, bf16: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's side of a draft-vocabulary loss: its logits of the K ids and its
    log-normalizer over the whole vocabulary, for every slot.

    weight [V, d] the LM head; final_hidden [B, T, d]; positions [B, A, γ] the position p+k whose
    state predicts slot k's token; valid [B, A, γ]; vocab [K] -> (z [N, γ, K], lse [N, γ]) fp32,
    N = B·A. The remaining full-vocabulary cost of a draft-vocabulary step is here: the
    normalizer needs lm_head over all V ids (the [P, d] x [d, V] GEMM and a logsumexp over V).
    It is paid once per distinct (sequence, position) of the valid slots, not once per slot as
    `teacher_logits` is (overlapping blocks share positions), in chunks of TEACHER_CHUNK rows,
    so no [N, γ, V] tensor exists. With `bf16` the GEMM is `teacher_logits`'s. Invalid slots get
    a valid slot's (finite) values; their weight is 0."""
    B, T = final_hidden.shape[:2]
    bidx = torch.arange(B, device=positions.device)[:, None, None]
    flat = (bidx * T + positions.clamp(max=T - 1)).flatten()  # [N·γ] row of final_hidden.flatten(0, 1)
    ok = valid.flatten()
    rows, inv = torch.unique(flat[ok], return_inverse=True)  # distinct positions; slot -> row
    if len(rows) == 0:  # nothing supervised: any row keeps the shapes (weights are 0)
        rows, inv = flat[:1], flat.new_zeros(0)
    slot_row = torch.zeros_like(flat)
    slot_row[ok] = inv
    hidden = final_hidden.flatten(0, 1)[rows]  # [P, d]
    w = weight.float()
    w_bf16 = w.bfloat16() if bf16 else None
    vocab = vocab.to(w.device)
    z = hidden.new_empty(len(rows), len(vocab), dtype=torch.float32)  # [P, K]
    lse = hidden.new_empty(len(rows), dtype=torch.float32)  # [P]
    for lo in range(0, len(rows), TEACHER_CHUNK):
        logits = _teacher_logits(w, w_bf16, hidden[lo:lo + TEACHER_CHUNK], exact_top=16)  # [c, V] the full-V cost
        lse[lo:lo + TEACHER_CHUNK] = torch.logsumexp(logits, dim=-1)
        z[lo:lo + TEACHER_CHUNK] = logits[:, vocab]
    shape = positions.shape  # [B, A, γ]
    return z[slot_row].view(B * shape[1], shape[2], -1), lse[slot_row].view(B * shape[1], shape[2])


def compute_loss(drafter: Drafter, batch: TrainBatch, cfg: TrainConfig,
                 weight_total: torch.Tensor | float | None = None, vocab: torch.Tensor | None = None) -> LossTerms:
    """Backbone -> heads -> losses for one (micro-)batch. Under bf16 autocast the backbone and
    the draft heads' matmuls run in bf16 (fp32 accumulation), and so does the target's LM head
    but for the largest logits of each row (`teacher_logits`); the softmaxes and the losses
    stay in fp32. vocab [K]: the draft vocabulary of `cfg.draft_vocab` (`training_vocab`): the
    draft heads and the loss run over K ids (`teacher_vocab_logits`, `draft_losses`)."""
    check_vocab(cfg, vocab, drafter.cfg.vocab_size)
    h = draft_block_states(drafter, batch.features, batch.anchors, batch.inputs, batch.positions)  # [B, A, γ, d]
    h = h.flatten(0, 1).float()  # [N = B·A, γ, d]; padding anchors' slots are invalid (weight 0)
    if vocab is not None:
        vocab = vocab.to(h.device)
        with torch.autocast(h.device.type, enabled=False), torch.no_grad():
            target_logits, target_lse = teacher_vocab_logits(drafter.lm_head.weight, batch.final_hidden,
                                                             batch.positions, batch.valid, vocab,
                                                             bf16=cfg.amp == "bf16")  # [N, γ, K], [N, γ]
        heads = teacher_forced_heads(drafter, h.to(drafter.lm_head.weight.dtype), batch.prev.flatten(0, 1), vocab)
        return draft_losses(heads.logits, heads.confidence_logits, target_logits, batch.labels.flatten(0, 1),
                            batch.valid.flatten(0, 1), cfg, weight_total, target_lse, vocab)
    B, T = batch.final_hidden.shape[:2]
    bidx = torch.arange(B, device=h.device)[:, None, None].expand_as(batch.positions)
    t_hidden = batch.final_hidden[bidx, batch.positions.clamp(max=T - 1)].flatten(0, 1)  # [N, γ, d] state at p+k
    with torch.autocast(h.device.type, enabled=False), torch.no_grad():
        target_logits = teacher_logits(drafter.lm_head.weight, t_hidden, bf16=cfg.amp == "bf16")  # [N, γ, V]
    heads = teacher_forced_heads(drafter, h.to(drafter.lm_head.weight.dtype), batch.prev.flatten(0, 1))
    return draft_losses(heads.logits, heads.confidence_logits, target_logits, batch.labels.flatten(0, 1),
                        batch.valid.flatten(0, 1), cfg, weight_total)


# --- Optimisation -----------------------------------------------------------------------------------


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine from lr down to lr·min_lr_ratio at `steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def freeze_shared(drafter: Drafter) -> None:
    """The embedding and LM head are the target's and stay frozen."""
    drafter.embed_tokens.weight.requires_grad_(False)
    drafter.lm_head.weight.requires_grad_(False)


def make_optimizer(drafter: Drafter, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; no weight decay on norms and biases. Parameter order is the module order, so a
    saved optimizer state loads back onto a freshly built drafter."""
    decay, no_decay = [], []
    for name, p in drafter.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)


def tau_from_acceptance(acceptance: list[float]) -> float:
    """1 + Σ_k Π_{j≤k} acc_j: the accepted length if every slot were verified (teacher-forced, T = 1)."""
    tau, run = 1.0, 1.0
    for a in acceptance:
        if math.isnan(a):
            break
        run *= a
        tau += run
    return tau


@dataclass
class EvalResult:
    """Teacher-forced metrics of a drafter on a `SequenceSource` (`evaluate`)."""

    sequences: int
    ce: float  # weighted mean over every valid slot, as in the loss
    tv: float
    conf: float  # BCE of the confidence head (0 without one)
    acceptance: list[float]  # [γ] mean c* per slot

    @property
    def tau_estimate(self) -> float:
        return tau_from_acceptance(self.acceptance)


@torch.no_grad()
def evaluate(drafter: Drafter, data: SequenceSource, cfg: TrainConfig, seed: int = 0, batch: int | None = None,
             indices: list[int] | None = None, device: str | torch.device = "cpu",
             progress: bool = True, vocab: torch.Tensor | None = None) -> EvalResult:
    """Loss terms and per-slot acceptance c* of `drafter` over the sequences `indices` of
    `data` (default all), with `cfg.anchors_per_seq` anchors per sequence drawn from (seed,
    sequence index): two drafters evaluated with the same seed see the very same blocks.
    vocab: the draft vocabulary of `cfg.draft_vocab` (None for 0)."""
    from tqdm import tqdm

    check_drafter_matches(drafter, cfg)
    device = torch.device(device)
    was_training = drafter.training
    drafter.eval()
    sums = torch.zeros(4, dtype=torch.float64)  # Σw, Σw·ce, Σw·tv, Σw·bce
    acc = torch.zeros(2, cfg.block_size, dtype=torch.float64)  # Σ c*, count per slot
    batch = batch or cfg.batch
    indices = list(range(len(data))) if indices is None else indices
    bar = tqdm(total=len(indices), desc="evaluate", unit="seq", disable=not progress, dynamic_ncols=True)
    try:
        for lo in range(0, len(indices), batch):
            idx = indices[lo:lo + batch]
            b = _batch_of(data, [(i, _generator(seed, i, 0xE7)) for i in idx], cfg).to(device)
            w = float((slot_weights(cfg.block_size, cfg.decay) * b.valid.float()).sum())
            if w > 0:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
                    t = compute_loss(drafter, b, cfg, weight_total=1.0, vocab=vocab)  # Σ w·term (not yet divided)
                sums += torch.tensor([w, float(t.ce), float(t.tv), float(t.conf)], dtype=torch.float64)
                acc += torch.stack([t.accept_sum, t.slot_count]).double().cpu()
            bar.update(len(idx))
    finally:
        bar.close()
        drafter.train(was_training)
    mean = (sums[1:] / sums[0].clamp_min(1e-12)).tolist()
    acceptance = [float(a / n) if n > 0 else math.nan for a, n in zip(acc[0].tolist(), acc[1].tolist())]
    return EvalResult(len(indices), *mean, acceptance)


@dataclass
class StepStats:
    step: int  # the step this loss was computed at (before its update)
    lr: float
    loss: float
    ce: float
    tv: float
    conf: float
    grad_norm: float
    acceptance: list[float]  # [γ] mean c* per slot
    seconds: float
    ce_dropped: int = 0  # valid slots whose label lay outside the draft vocabulary (their CE weight is 0)

    @property
    def tau_estimate(self) -> float:
        return tau_from_acceptance(self.acceptance)


def _nanmean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def _rng_state() -> dict:
    state = {"torch": torch.random.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.random.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint `run_dir/checkpoints/step-NNNNNNN` (None if there is none)."""
    root = Path(run_dir) / CHECKPOINTS
    done = sorted(p for p in root.glob("step-*") if (p / TRAINER_STATE).exists()) if root.exists() else []
    return done[-1] if done else None


class Trainer:
    """Trains a drafter on a `SequenceSource`; a run lives in `run_dir`:

        run_dir/train_config.json             the TrainConfig (also inside every checkpoint)
        run_dir/log.jsonl                     one line of StepStats every `log_every` steps
        run_dir/checkpoints/step-NNNNNNN/     drafter/ (DeepSpec format, fp32, no embeddings)
                                              trainer_state.pt (optimizer, step, RNG, config, data)

    Use `Trainer.start` for a new run and `Trainer.resume` to continue one. `vocab`: the draft
    vocabulary [K] of `cfg.draft_vocab` (`training_vocab`; None for 0); checkpoints record it."""

    def __init__(self, drafter: Drafter, data: SequenceSource, cfg: TrainConfig, run_dir: str | Path, *,
                 device: str | torch.device = "cpu", save_every: int = 500, log_every: int = 10,
                 keep_checkpoints: int = 2, micro_batch: int | None = None, progress: bool = True,
                 on_checkpoint: Callable[[], None] | None = None, vocab: torch.Tensor | None = None):
        check_drafter_matches(drafter, cfg)
        check_vocab(cfg, vocab, drafter.cfg.vocab_size)
        self.cfg = cfg
        self.device = torch.device(device)
        self.vocab = None if vocab is None else vocab.long().to(self.device)
        self.drafter = drafter.float().to(self.device).train()
        freeze_shared(self.drafter)
        self.data = data
        self.plan = BatchPlan(len(data), cfg.batch, cfg.seed)
        self.optimizer = make_optimizer(self.drafter, cfg)
        self.run_dir = Path(run_dir)
        self.save_every, self.log_every, self.keep = save_every, log_every, keep_checkpoints
        self.micro_batch = micro_batch or cfg.batch
        self.progress = progress
        self.on_checkpoint = on_checkpoint  # called after every checkpoint `train` writes
        self.step_idx = 0
        self.history: list[StepStats] = []

    # -- construction --

    @classmethod
    def start(cls, target: TargetModel, data: SequenceSource, cfg: TrainConfig, run_dir: str | Path,
              **kw) -> "Trainer":
        """A new run: a fresh drafter for `target`. Refuses a run_dir that already has checkpoints."""
        if latest_checkpoint(run_dir) is not None:
            raise ConfigError(f"{run_dir} already holds a run (checkpoint {latest_checkpoint(run_dir).name}); "
                              "resume it or choose another directory")
        trainer = cls(build_drafter(target, cfg), data, cfg, run_dir, **kw)
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        (trainer.run_dir / "train_config.json").write_text(cfg.to_json() + "\n")
        return trainer

    @classmethod
    def resume(cls, run_dir: str | Path, embeddings: tuple[torch.Tensor, torch.Tensor], data: SequenceSource,
               cfg: TrainConfig | None = None, **kw) -> "Trainer":
        """Continue the run in `run_dir` from its newest checkpoint. `embeddings` = the target's
        (embed_tokens.weight, lm_head.weight). `cfg` None takes the checkpoint's config; a
        config that differs raises `ConfigError` before anything is loaded or computed."""
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise CheckpointError(f"{run_dir}: no checkpoint to resume (expected {CHECKPOINTS}/step-*/{TRAINER_STATE})")
        state = torch.load(ckpt / TRAINER_STATE, map_location="cpu", weights_only=True)
        saved = TrainConfig.from_dict(state["config"])
        check_resume_config(saved, cfg)
        saved_vocab = state.get("draft_vocab_ids")  # the run's draft vocabulary (None: the whole vocabulary)
        given = kw.pop("vocab", None)
        if given is not None and (saved_vocab is None or not torch.equal(given.cpu().long(), saved_vocab)):
            raise ConfigError("resume: the given draft vocabulary differs from the checkpoint's; resume without one "
                              "(the checkpoint's is used)")
        fp = data.fingerprint()
        if state.get("data_fingerprint") not in (None, fp):
            raise ConfigError(f"resume: the training data differs from the checkpoint's (fingerprint "
                              f"{state['data_fingerprint']} vs {fp}); resume with the same data")
        drafter = load_drafter(ckpt / "drafter", dtype=torch.float32, embeddings=embeddings)
        trainer = cls(drafter, data, saved, run_dir, vocab=saved_vocab, **kw)
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.step_idx = int(state["step"])
        _set_rng_state(state["rng"])
        return trainer

    # -- one step --

    def batch(self, step: int) -> TrainBatch:
        return make_batch(self.data, self.plan, step, self.cfg)

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.amp == "bf16")

    def step(self) -> StepStats:
        """One optimisation step on the batch of `self.step_idx`; returns the loss before the update."""
        t0 = time.perf_counter()
        cfg = self.cfg
        lr = lr_at(self.step_idx, cfg)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        batch = self.batch(self.step_idx)
        w = slot_weights(cfg.block_size, cfg.decay)
        weight_total = float((w * batch.valid.float()).sum())
        if weight_total == 0:
            raise ConfigError(f"step {self.step_idx}: no supervised slot in the batch (are responses empty?)")
        self.optimizer.zero_grad(set_to_none=True)
        sums, dropped = None, 0
        for lo in range(0, cfg.batch, self.micro_batch):
            part = TrainBatch(**{f.name: getattr(batch, f.name)[lo:lo + self.micro_batch]
                                 for f in fields(batch)}).to(self.device)
            if not bool(part.anchor_ok.any()):
                continue
            with self._autocast():
                terms = compute_loss(self.drafter, part, cfg, weight_total, self.vocab)
            terms.total.backward()
            if terms.ce_dropped is not None:
                dropped += int(terms.ce_dropped)
            vals = torch.stack([terms.total.detach(), terms.ce.detach(), terms.tv.detach(),
                                torch.as_tensor(terms.conf).detach().float()]).float().cpu()
            acc = torch.stack([terms.accept_sum, terms.slot_count]).cpu()
            sums = (vals, acc) if sums is None else (sums[0] + vals, sums[1] + acc)
        trainable = [p for p in self.drafter.parameters() if p.requires_grad]
        gn = float(torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip))
        self.optimizer.step()
        vals, acc = sums
        acceptance = (acc[0] / acc[1].clamp_min(1)).tolist()
        acceptance = [a if n > 0 else math.nan for a, n in zip(acceptance, acc[1].tolist())]
        stats = StepStats(self.step_idx, lr, *(float(v) for v in vals), gn, acceptance, time.perf_counter() - t0,
                          dropped)
        self.step_idx += 1
        return stats

    # -- a run --

    def train(self, max_steps: int | None = None, time_budget_s: float | None = None) -> list[StepStats]:
        """Steps until cfg.steps, or `max_steps` more steps, or the time budget is spent; saves a
        checkpoint every `save_every` steps and when it stops."""
        from tqdm import tqdm

        end = self.cfg.steps if max_steps is None else min(self.cfg.steps, self.step_idx + max_steps)
        t_start = time.perf_counter()
        out: list[StepStats] = []
        bar = tqdm(total=self.cfg.steps, initial=self.step_idx, desc="train", unit="step", disable=not self.progress,
                   dynamic_ncols=True)
        window: list[StepStats] = []
        try:
            while self.step_idx < end:
                s = self.step()
                out.append(s)
                window.append(s)
                bar.update()
                if len(window) >= self.log_every or self.step_idx == end:
                    self._log(window, bar)
                    window = []
                if self.step_idx % self.save_every == 0:
                    self.save()
                    if self.on_checkpoint is not None:
                        self.on_checkpoint()
                if time_budget_s is not None and time.perf_counter() - t_start > time_budget_s:
                    break
        finally:
            bar.close()
        if out and self.step_idx % self.save_every != 0:
            self.save()
        self.history.extend(out)
        return out

    def _log(self, window: list[StepStats], bar) -> None:
        n = len(window)
        mean = {k: sum(getattr(s, k) for s in window) / n for k in ("loss", "ce", "tv", "conf", "grad_norm")}
        acc = [_nanmean([s.acceptance[k] for s in window]) for k in range(self.cfg.block_size)]
        tau = sum(s.tau_estimate for s in window) / n
        bar.set_postfix_str(f"loss {mean['loss']:.3f} ce {mean['ce']:.3f} tv {mean['tv']:.3f} "
                            f"conf {mean['conf']:.3f} acc [{' '.join(f'{a:.2f}' for a in acc)}] τ≈{tau:.2f} "
                            f"lr {window[-1].lr:.2e}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        line = {"step": window[-1].step + 1, **mean, "acceptance": acc, "tau_estimate": tau,
                "lr": window[-1].lr, "sec_per_step": sum(s.seconds for s in window) / n}
        if self.cfg.draft_vocab:  # slots whose label lay outside the draft vocabulary (CE weight 0), per step
            line["ce_dropped"] = sum(s.ce_dropped for s in window) / n
        with open(self.run_dir / "log.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    # -- checkpoints --

    def save(self) -> Path:
        """Write `checkpoints/step-NNNNNNN` atomically (temporary directory, then rename) and
        keep the newest `keep_checkpoints`."""
        root = self.run_dir / CHECKPOINTS
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{self.step_idx:07d}"
        tmp = root / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_drafter(self.drafter, tmp / "drafter", dtype=torch.float32, include_embeddings=False)
        extra = {} if self.vocab is None else {"draft_vocab_ids": self.vocab.cpu()}
        torch.save({"step": self.step_idx, "config": self.cfg.to_dict(), "optimizer": self.optimizer.state_dict(),
                    "rng": _rng_state(), "data_fingerprint": self.data.fingerprint(), **extra}, tmp / TRAINER_STATE)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        old = sorted(p for p in root.glob("step-*") if p.is_dir())[:-self.keep] if self.keep > 0 else []
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
        return final

    def export(self, path: str | Path, dtype: torch.dtype = torch.bfloat16, include_embeddings: bool = False) -> Path:
        """The trained drafter as a shippable DeepSpec checkpoint (bf16; the embedding and LM
        head are the target's and are restored from it at load time unless included)."""
        return export_drafter(self.drafter, path, self.cfg, self.step_idx, dtype, include_embeddings)


def export_drafter(drafter: Drafter, path: str | Path, cfg: TrainConfig, step: int,
                   dtype: torch.dtype = torch.bfloat16, include_embeddings: bool = False) -> Path:
    path = Path(path)
    save_drafter(drafter, path, dtype=dtype, include_embeddings=include_embeddings)
    (path / "training.json").write_text(json.dumps({"train_config": cfg.to_dict(), "step": step}, indent=2) + "\n")
    return path
