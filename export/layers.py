"""The building blocks of the target and the drafter, each written once (PyTorch, exportable):
RMSNorm, RoPE, attention over several key/value segments, the q/k/v projections and the
SwiGLU MLP, and `fuse_projections`, the in-place weight fusion the exported graphs use.

Projections and MLP compute through one accessor per fused weight: the q/k/v projections as
one [d, (H + 2·Hkv)·D] matrix (k/v alone for rows that are only attended to), gate and up as
one [d, 2·I] matrix. Built from the checkpoint's separate weights on every call (reference,
training), or stored once by `fuse_projections` (the engine graphs, where each is then one
MatMul with a constant weight)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm over the last axis: normalised in fp32, cast back, then scaled by
    `weight` (broadcast). Written as x / sqrt(mean(x²) + eps): exported, Pow → ReduceMean → Add →
    Sqrt → Div → Mul, which ONNX Runtime fuses into one SimplifiedLayerNormalization where
    `weight` is one vector (TensorRT into its normalization layer)."""
    dtype = x.dtype
    x = x.float()
    x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for absolute `positions` [B, S] -> [B, S, 1, head_dim] each (fp32; both halves equal)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [B, S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None]  # [B, S, 1, D]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face convention) on x [B, S, heads, D], in fp32."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def group_mask(mask: torch.Tensor, rep: int, queries: int) -> torch.Tensor:
    """An additive mask [B, 1 or S, T] (the same for every query, or one row per query) ->
    [B, 1, rep·S, T], the layout of `attention`'s grouped score rows (S = `queries`). Built
    once per forward and shared by the layers."""
    B, _, T = mask.shape
    return mask[:, None].expand(B, rep, queries, T).reshape(B, 1, rep * queries, T)


def attention(q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
              mask: torch.Tensor) -> torch.Tensor:
    """softmax(q·kᵀ + mask)·v over key/value segments read where they lie, as if concatenated
    along the sequence (a cache buffer is never copied to join the new rows).

    q [B, S, H, D] (scaled); keys/values: segments [B, Hkv, T_i, D]; mask [B, 1, rep·S, ΣT_i]
    additive (`group_mask`), in the activations' dtype. GQA without repeating K/V: the rep =
    H / Hkv query heads that share a K/V head are stacked as rows of one matrix (row r·S + s:
    head g·rep + r, query s). Returns [B, S, H·D]."""
    B, S, H, D = q.shape
    Hkv = keys[0].shape[1]
    rep = H // Hkv
    qg = q.reshape(B, S, Hkv, rep, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, rep * S, D)
    parts = [qg @ k.transpose(-1, -2) for k in keys]
    scores = (torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]) + mask  # [B, Hkv, rep·S, ΣT]
    p = torch.softmax(scores, dim=-1)
    out, lo = None, 0
    for i, v in enumerate(values):
        hi = lo + v.shape[2]
        part = (p[..., lo:hi] if i + 1 < len(values) else p[..., lo:]) @ v  # [B, Hkv, rep·S, D]
        out = part if out is None else out + part
        lo = hi
    return out.reshape(B, Hkv, rep, S, D).permute(0, 3, 1, 2, 4).reshape(B, S, H * D)


class MLP(nn.Module):
    """SwiGLU feed-forward (Llama, Qwen3)."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.register_parameter("gate_up", None)  # [d, 2I] once fused

    def gate_up_weight(self) -> torch.Tensor:
        """gate and up as one [d, 2I] matrix, applied as x @ W."""
        if self.gate_up is not None:
            return self.gate_up
        return torch.cat([self.gate_proj.weight, self.up_proj.weight]).T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.gate_up_weight()).chunk(2, dim=-1)  # [B, S, I] each
        return self.down_proj(F.silu(gate) * up)

    def fuse(self) -> None:
        self.gate_up = nn.Parameter(self.gate_up_weight().detach().contiguous(), requires_grad=False)


class Projections(nn.Module):
    """q/k/v/o projections with optional per-head q/k RMSNorm (Qwen3). `forward` gives the
    attention inputs of rows that query, `key_value` those of rows that are only attended to;
    `o_proj` maps `attention`'s output back to the residual stream."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, qk_norm: bool, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.scale = head_dim ** -0.5  # the attention scale, folded into the query weights
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        self.qk_norm = qk_norm
        self.register_parameter("qkv", None)  # [d, (H + 2Hkv)·D] once fused
        self.register_parameter("kv", None)  # [d, 2Hkv·D] once fused
        self.register_parameter("qk_norm_weight", None)  # [H + Hkv, D] once the q/k norms are joined

    def weight(self, queries: bool = True) -> torch.Tensor:
        """The projections as one matrix, applied as x @ W: q, k and v [d, (H + 2Hkv)·D], or k and
        v alone [d, 2Hkv·D]. Without a q norm the attention scale is folded into the query
        columns (with one, into the q norm's weight)."""
        fused = self.qkv if queries else self.kv
        if fused is not None:
            return fused
        q = [self.q_proj.weight if self.qk_norm else self.q_proj.weight * self.scale] if queries else []
        return torch.cat([*q, self.k_proj.weight, self.v_proj.weight]).T

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, S, d] -> q [B, S, H, D] (normed, rotated, scaled), k [B, S, Hkv, D] (normed,
        rotated), v [B, S, Hkv, D]. One MatMul; RoPE once over queries and keys together."""
        B, S, _ = x.shape
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        qk, v = (x @ self.weight()).reshape(B, S, H + 2 * Hkv, D).split([H + Hkv, Hkv], dim=2)
        if self.qk_norm_weight is not None:
            qk = rms_norm(qk, self.qk_norm_weight, self.eps)
        elif self.qk_norm:  # two norms with a [D] weight each: ONNX Runtime fuses both
            q, k = qk.split([H, Hkv], dim=2)
            qk = torch.cat([rms_norm(q, self.q_norm.weight * self.scale, self.eps),
                            rms_norm(k, self.k_norm.weight, self.eps)], dim=2)
        q, k = apply_rope(qk, cos, sin).split([H, Hkv], dim=2)
        return q, k, v

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows whose queries are not needed: x [B, S, d] -> k [B, S, Hkv, D] (normed, rotated),
        v [B, S, Hkv, D]. One MatMul."""
        B, S, _ = x.shape
        k, v = (x @ self.weight(queries=False)).reshape(B, S, 2 * self.kv_heads, self.head_dim).chunk(2, dim=2)
        if self.qk_norm:
            k = rms_norm(k, self.k_norm.weight, self.eps)
        return apply_rope(k, cos, sin), v

    def fuse(self, join_qk_norm: bool) -> None:
        self.qkv = nn.Parameter(self.weight().detach().contiguous(), requires_grad=False)
        self.kv = nn.Parameter(self.weight(queries=False).detach().contiguous(), requires_grad=False)
        if self.qk_norm and join_qk_norm:  # the q norm's weight for each query head, then the k norm's for each key head
            joined = torch.cat([(self.q_norm.weight * self.scale).expand(self.heads, -1),
                                self.k_norm.weight.expand(self.kv_heads, -1)])
            self.qk_norm_weight = nn.Parameter(joined.detach().contiguous(), requires_grad=False)


def fuse_projections(module: nn.Module, join_qk_norm: bool = True) -> None:
    """In place: every Projections and MLP of `module` keeps its fused weights (q/k/v, k/v,
    gate/up) as parameters of their own, which the computation then reads (a graph exports
    only those it uses). `join_qk_norm`: Qwen3's q and k norms become one norm over queries and
    keys together (a [H + Hkv, D] weight, which ONNX Runtime does not fuse into one op; False
    keeps two norms with a [D] weight each)."""
    for m in list(module.modules()):
        if isinstance(m, Projections):
            m.fuse(join_qk_norm)
        elif isinstance(m, MLP):
            m.fuse()
