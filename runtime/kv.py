"""Preallocated KV buffers. Sized once at load time, one slot per concurrent request; a
step writes its new rows at their positions and rejected rows are dropped by moving a
length, never by copying."""
from __future__ import annotations

import numpy as np

from .graph_io import MASKED


class KVBuffers:
    """Keys and values of every layer: 2·L arrays [R, Hkv, S_max, D], contiguous and
    pointer-stable (engines bind them, or slices of them along R, once)."""

    def __init__(self, layers: int, slots: int, kv_heads: int, max_seq: int, head_dim: int,
                 dtype: np.dtype = np.float32):
        shape = (slots, kv_heads, max_seq, head_dim)
        self.keys = [np.zeros(shape, dtype) for _ in range(layers)]
        self.values = [np.zeros(shape, dtype) for _ in range(layers)]
        self.max_seq = max_seq

    @property
    def arrays(self) -> list[np.ndarray]:
        """Keys of every layer, then values: the order of the graphs' past_* inputs."""
        return self.keys + self.values

    def write(self, new_rows: list[np.ndarray], starts: np.ndarray, first_slot: int = 0) -> None:
        """new_rows: keys then values, each [B, Hkv, S, D]; row b goes to slot first_slot+b at
        positions starts[b]..starts[b]+S-1 (padding past max_seq is dropped: it is never read)."""
        B, _, S, _ = new_rows[0].shape
        if B == 1:
            end = min(int(starts[0]) + S, self.max_seq)
            for buf, rows in zip(self.arrays, new_rows):
                buf[first_slot, :, int(starts[0]):end] = rows[0, :, :end - int(starts[0])]
            return
        pos = np.minimum(starts[:, None] + np.arange(S), self.max_seq - 1)  # [B, S]
        slot = np.arange(first_slot, first_slot + B)[:, None]  # [B, 1]
        for buf, rows in zip(self.arrays, new_rows):
            buf[slot, :, pos] = rows.transpose(0, 2, 1, 3)  # indexed view is [B, S, Hkv, D]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def row_mask(lengths: np.ndarray, width: int | None = None, floors: np.ndarray | None = None) -> np.ndarray:
    """[B, W] additive mask: row b may read columns [floors[b], lengths[b]) (floors default 0).
    W = max(lengths) unless given, and at least 1, so that no engine ever sees a zero-size axis."""
    width = max(int(lengths.max()) if width is None else width, 1)
    cols = np.arange(width)
    visible = cols < lengths[:, None]  # [B, W]
    if floors is not None:
        visible &= cols >= floors[:, None]
    return np.where(visible, 0.0, MASKED).astype(np.float32)
