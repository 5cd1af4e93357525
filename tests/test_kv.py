"""Preallocated KV slots: per-row writes at per-row positions, padding past the end dropped."""
import numpy as np

from dspark.runtime.graph_io import MASKED
from dspark.runtime.kv import KVBuffers, row_mask


def test_rows_go_to_their_slots_and_positions():
    kv = KVBuffers(layers=2, slots=3, kv_heads=2, max_seq=10, head_dim=4)
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=(2, 2, 3, 4)).astype(np.float32) for _ in range(4)]  # keys, values of 2 rows, S = 3
    kv.write(rows, np.array([2, 8]), first_slot=1)  # slot 1 at 2..4; slot 2 at 8..10, the last one past the end
    for buf, new in zip(kv.arrays, rows):
        np.testing.assert_array_equal(buf[1, :, 2:5], new[0])
        np.testing.assert_array_equal(buf[2, :, 8:9], new[1, :, :1])  # position 9 may hold padding: never read
        assert not buf[0].any() and not buf[1, :, :2].any() and not buf[1, :, 5:].any()
    one = KVBuffers(layers=2, slots=3, kv_heads=2, max_seq=10, head_dim=4)  # the batch-1 path agrees
    one.write([r[:1] for r in rows], np.array([2]), first_slot=1)
    one.write([r[1:] for r in rows], np.array([8]), first_slot=2)
    for a, b in zip(one.arrays, kv.arrays):
        np.testing.assert_array_equal(a[:, :, :9], b[:, :, :9])


def test_row_mask():
    m = row_mask(np.array([0, 2, 3]))
    assert m.shape == (3, 3) and m.dtype == np.float32
    assert (m == np.array([[MASKED] * 3, [0, 0, MASKED], [0, 0, 0]], np.float32)).all()
    assert row_mask(np.array([0])).shape == (1, 1)  # never a zero-size axis
    assert row_mask(np.array([1, 2]), 4).shape == (2, 4)


def test_row_mask_with_floors():
    m = row_mask(np.array([3, 4]), 5, floors=np.array([0, 2]))  # row 1 reads columns 2..3 only
    assert (m == np.array([[0, 0, 0, MASKED, MASKED], [MASKED, MASKED, 0, 0, MASKED]], np.float32)).all()
