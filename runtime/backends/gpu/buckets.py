"""Shape buckets. A captured CUDA graph replays one fixed set of shapes and addresses, so
every call is rounded up to a bucket: the rows of a batched call B to a batch bucket (the rows
past the real ones are dummy rows of free slots), and the past width P (committed rows the
graphs read, `past_mask` [B, P]) to a context bucket, masking the rows past each row's real
length. Pure logic."""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import InputError


@dataclass(frozen=True)
class Buckets:
    max_seq: int  # KV rows preallocated: the largest context
    max_query: int  # γ + 1: the longest verification; longer calls (prefill) run eagerly, in chunks
    prefill_chunk: int = 512  # rows per prefill call (and per first drafting round)
    min_context: int = 128  # the smallest context bucket; then doubling, the last one max_seq
    max_batch: int = 1  # request slots: the largest batch; batch buckets double up to it

    def __post_init__(self) -> None:
        if (self.max_seq < 2 or self.max_query < 1 or self.prefill_chunk < self.max_query or self.min_context < 1
                or self.max_batch < 1):
            raise InputError(f"bad buckets {self}: need max_seq >= 2, max_query >= 1, "
                             f"prefill_chunk >= max_query, min_context >= 1, max_batch >= 1")

    @property
    def batches(self) -> tuple[int, ...]:
        """Every batch bucket, ascending: 1, 2, 4, ... below max_batch, then max_batch."""
        return _doubling(1, self.max_batch)

    def batch(self, rows: int) -> int:
        """The batch a call over slots 0..rows-1 runs at."""
        if not 1 <= rows <= self.max_batch:
            raise InputError(f"a call over {rows} request rows; this backend has {self.max_batch} slots")
        return next(b for b in self.batches if b >= rows)

    @property
    def contexts(self) -> tuple[int, ...]:
        """Every context bucket, ascending; the last is max_seq."""
        return _doubling(min(self.min_context, self.max_seq), self.max_seq)

    def context(self, length: int) -> int:
        """The past width a call with `length` committed rows runs at (>= 1: no empty axis)."""
        if not 0 <= length <= self.max_seq:
            raise InputError(f"context of {length} rows is outside 0..{self.max_seq}")
        return next(c for c in self.contexts if c >= max(length, 1))

    def graphable(self, query: int) -> bool:
        """Calls of up to γ+1 rows are captured as graphs; longer ones (prefill) run eagerly."""
        return query <= self.max_query

    def chunks(self, n: int) -> list[tuple[int, int]]:
        """[lo, hi) row ranges of at most prefill_chunk rows covering 0..n."""
        return [(lo, min(lo + self.prefill_chunk, n)) for lo in range(0, n, self.prefill_chunk)]


def _doubling(first: int, last: int) -> tuple[int, ...]:
    """first, 2·first, 4·first, ... below last, then last."""
    sizes = []
    while first < last:
        sizes.append(first)
        first *= 2
    return (*sizes, last)
