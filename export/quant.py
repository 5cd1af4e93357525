"""Block-quantized weights: the one definition of their layout and of the numbers they stand for.

A `BlockWeight` holds a MatMul weight W [K, N] (y = x·W) in ONNX Runtime's `MatMulNBits` layout,
symmetric (no zero points: issue #29853 makes the zero-point kernel wrong on AVX2):

    W[k, n] = scales[n, k // block] · (q[n, k] − 2^(bits−1)) + offsets[k // block, n]

`q` is unsigned (`bits` = 4 or 8), packed along K per block: 4-bit element 2i in the low nibble
of byte i, 2i + 1 in the high one. `offsets` [K / block, N] (None: zero) is the per-block
minimum of an asymmetric format kept exactly: GGUF's Q4_1 `w = d·q + m` is
`d·(q − 8) + (m + 8d)`, so the graph adds x's per-block sums times `offsets` (a small MatMul)
to the symmetric kernel's output. Every consumer (the ONNX graphs, the torch reference through
`dequantize`) reads these arrays, so the reference and the engines compute with the same numbers."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BlockWeight:
    q: np.ndarray  # [N, K / block, block·bits/8] uint8, packed
    scales: np.ndarray  # [N, K / block] float32
    bits: int
    block: int
    k: int  # K; the last block is zero-padded when `block` does not divide it
    offsets: np.ndarray | None = None  # [K / block, N] float32

    @property
    def shape(self) -> tuple[int, int]:
        """(K, N) of the MatMul weight it stands for."""
        return self.k, self.q.shape[0]

    def codes(self) -> np.ndarray:
        """The unpacked unsigned codes [N, K / block, block]."""
        if self.bits == 8:
            return self.q
        lo, hi = self.q & 0x0F, self.q >> 4
        return np.stack([lo, hi], axis=-1).reshape(*self.q.shape[:2], self.block)

    def signed_codes(self) -> np.ndarray:
        """The codes centred to signed integers, as W's layout [K, N] int8 (the padding of the last
        block dropped): with scales.T, what `DequantizeLinear` (axis 0, block_size `block`, no
        zero point) reads."""
        centred = self.codes().astype(np.int16) - (1 << (self.bits - 1))  # [N, blocks, block]
        return np.ascontiguousarray(centred.reshape(centred.shape[0], -1)[:, :self.k].T.astype(np.int8))

    def dequantize(self) -> np.ndarray:
        """W [K, N] float32, in the order of operations every graph form computes."""
        centred = self.codes().astype(np.float32) - float(1 << (self.bits - 1))  # [N, blocks, block]
        w = centred * self.scales[:, :, None]
        if self.offsets is not None:
            w = w + self.offsets.T[:, :, None]
        K, N = self.shape
        return np.ascontiguousarray(w.reshape(N, -1)[:, :K].T)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes [N, blocks, block] -> MatMulNBits bytes [N, blocks, block·bits/8]."""
    codes = codes.astype(np.uint8)
    if bits == 8:
        return codes
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize_rtn(w: np.ndarray, bits: int, block: int) -> BlockWeight:
    """Symmetric round-to-nearest of W [K, N] per block of `block` rows of K (per column): each
    block's largest magnitude maps to 2^(bits−1) − 1."""
    K, N = w.shape
    qmax = (1 << (bits - 1)) - 1
    padded = np.zeros((-(-K // block) * block, N), np.float32)
    padded[:K] = w
    blocks = padded.T.reshape(N, -1, block)  # [N, blocks, block]
    scales = np.abs(blocks).max(-1) / qmax  # [N, blocks]
    safe = np.where(scales == 0, 1.0, scales)[..., None]
    codes = np.clip(np.rint(blocks / safe), -qmax - 1, qmax) + (qmax + 1)
    return BlockWeight(pack(codes, bits), scales.astype(np.float32), bits, block, K)


def concat_n(parts: list[BlockWeight]) -> BlockWeight:
    """Weights side by side along N (the fused q/k/v and gate/up projections)."""
    first = parts[0]
    if any((p.bits, p.block, p.k, p.offsets is None) != (first.bits, first.block, first.k, first.offsets is None)
           for p in parts):
        raise ValueError("cannot fuse weights of different formats")
    offsets = None if first.offsets is None else np.concatenate([p.offsets for p in parts], axis=1)
    return BlockWeight(np.concatenate([p.q for p in parts]), np.concatenate([p.scales for p in parts]),
                       first.bits, first.block, first.k, offsets)


def split_blocks(w: BlockWeight, block: int) -> BlockWeight:
    """The same W in blocks of `block` (a divisor of w.block): each block's scale and offset serve
    each of its parts, so every weight keeps its value exactly. Codes are packed along K within a
    block, so a part's bytes are a contiguous slice of its block's."""
    if w.block % block or block % 2:
        raise ValueError(f"cannot split blocks of {w.block} into blocks of {block}")
    parts = w.block // block
    N, nb = w.scales.shape
    q = w.q.reshape(N, nb * parts, -1)  # [N, K/block, block·bits/8]
    offsets = None if w.offsets is None else np.repeat(w.offsets, parts, axis=0)  # [K/block, N]
    return BlockWeight(np.ascontiguousarray(q), np.repeat(w.scales, parts, axis=1), w.bits, block, w.k, offsets)


def take_n(w: BlockWeight, index: np.ndarray) -> BlockWeight:
    """The columns `index` of W (a permutation of output features)."""
    return BlockWeight(w.q[index], w.scales[index], w.bits, w.block, w.k,
                       None if w.offsets is None else w.offsets[:, index])


def take_k(w: BlockWeight, index: np.ndarray) -> BlockWeight:
    """The rows `index` of W (a permutation of input features) that moves whole blocks: each run of
    `block` indices is one block's, in order (else ValueError)."""
    runs = np.asarray(index).reshape(-1, w.block)
    if len(index) != w.k or w.k % w.block or (runs != runs[:, :1] + np.arange(w.block)).any() or (runs[:, 0] % w.block).any():
        raise ValueError(f"the permutation does not move whole blocks of {w.block}")
    b = runs[:, 0] // w.block
    return BlockWeight(w.q[:, b], w.scales[:, b], w.bits, w.block, w.k, None if w.offsets is None else w.offsets[b])


GGUF_BLOCK = 32  # Q4_1 and Q8_0


def from_q4_1(raw: np.ndarray, k: int) -> BlockWeight:
    """A GGUF Q4_1 tensor [N, K] (raw bytes [N, K/32 · 20]: per block f16 d, f16 m, 16 bytes of
    codes; element j in the low nibble of byte j, j + 16 in the high one; w = d·q + m) -> W [K, N],
    exactly: d·(q − 8) + (m + 8d)."""
    blocks = raw.reshape(raw.shape[0], k // GGUF_BLOCK, 20)  # [N, blocks, 20]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, blocks]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [N, blocks, 32]: elements 0..15, 16..31
    return BlockWeight(pack(codes, 4), d, 4, GGUF_BLOCK, k, np.ascontiguousarray((m + 8 * d).T))


def from_q8_0(raw: np.ndarray, k: int) -> BlockWeight:
    """A GGUF Q8_0 tensor [N, K] (raw bytes [N, K/32 · 34]: per block f16 d, 32 int8 codes;
    w = d·q) -> W [K, N], exactly."""
    blocks = raw.reshape(raw.shape[0], k // GGUF_BLOCK, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
    return BlockWeight(codes.astype(np.uint8), d, 8, GGUF_BLOCK, k)
