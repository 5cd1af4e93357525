"""Preallocated KV buffers. Sized once at load time; a step writes its new rows at their
positions and rejected rows are dropped by moving a length, never by copying."""
from __future__ import annotations

import numpy as np

MASKED = -1e9  # additive attention mask for rows that must not be read


class KVBuffers:
    """Keys and values of every layer: 2·L arrays [B, Hkv, S_max, D], contiguous and
    pointer-stable (engines bind them once)."""

    def __init__(self, layers: int, batch: int, kv_heads: int, max_seq: int, head_dim: int,
                 dtype: np.dtype = np.float32):
        shape = (batch, kv_heads, max_seq, head_dim)
        self.keys = [np.zeros(shape, dtype) for _ in range(layers)]
        self.values = [np.zeros(shape, dtype) for _ in range(layers)]
        self.max_seq = max_seq

    @property
    def arrays(self) -> list[np.ndarray]:
        """Keys of every layer, then values: the order of the graphs' past_* inputs."""
        return self.keys + self.values

    def write(self, new_rows: list[np.ndarray], start: int) -> None:
        """new_rows: keys then values, each [B, Hkv, S, D], for positions start..start+S-1."""
        n = new_rows[0].shape[2]
        for buf, rows in zip(self.arrays, new_rows):
            buf[:, :, start:start + n] = rows

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def past_mask(length: int, batch: int = 1) -> np.ndarray:
    """[B, max(length, 1)] additive mask over the committed rows [0, length).

    Graphs read as many rows as the mask is wide; an empty past is one masked row, so
    no engine ever sees a zero-size axis."""
    mask = np.zeros((batch, max(length, 1)), np.float32)
    if length == 0:
        mask[:, 0] = MASKED
    return mask
