"""Building blocks shared by the target and drafter references (PyTorch, exportable)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Hugging Face's RMSNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward (Llama, Qwen3)."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for absolute `positions` [B, S] -> [B, 1, S, head_dim] each (fp32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [B, S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [B, S, D]
    return emb.cos()[:, None], emb.sin()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face convention) on x [B, H, S, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * n_rep, S, D]; query head h reads kv head h // n_rep."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class Projections(nn.Module):
    """q/k/v/o projections with optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, qk_norm: bool, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        self.qk_norm = qk_norm

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S, d] -> q [B, H, S, D], normed and rotated."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim)
        if self.qk_norm:  # per head, before the transpose: exported, the norm stays one fusable pattern
            q = self.q_norm(q)
        return apply_rope(q.transpose(1, 2), cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, d] -> k, v [B, Hkv, S, D]; k normed and rotated, v as projected."""
        b, s, _ = x.shape
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k.transpose(1, 2), cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, H, S, D], k/v [B, Hkv, T, D], mask [B, 1, S, T] bool (True = attend) -> [B, S, d]."""
        n_rep = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask)
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))
