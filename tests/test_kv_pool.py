"""The KV pool's slot arithmetic and row copies (what K/V transfers read and write)."""

from __future__ import annotations

import torch

from detserve.executor.kv_pool import KVPool


def _pool() -> KVPool:
    return KVPool(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=3,
                  dtype=torch.float32, device="cpu")


def test_slots_of_spans_follow_each_block_table_in_order() -> None:
    pool = _pool()
    spans = [((5, 2, 7), 2, 9), ((3,), 1, 1), ((6, 1), 0, 3)]  # the middle span is empty
    got = pool.slots_of(spans).tolist()
    want = [5 * 4 + 2, 5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 7 * 4 + 0,
            6 * 4 + 0, 6 * 4 + 1, 6 * 4 + 2]
    assert got == want
    assert pool.slots_of([]).tolist() == [] and pool.slots_of([]).dtype == torch.long


def test_rows_written_at_slots_read_back_and_touch_nothing_else() -> None:
    pool = _pool()
    slots = pool.slots_of([((3, 6), 2, 6)])
    rows = torch.randn(pool.read_rows(slots).shape)
    before = pool.data.clone()
    pool.write_rows(slots, rows)
    assert torch.equal(pool.read_rows(slots), rows)
    mask = torch.ones(pool.data.flatten(2, 3).shape[2], dtype=torch.bool)
    mask[slots] = False
    assert torch.equal(pool.data.flatten(2, 3)[:, :, mask], before.flatten(2, 3)[:, :, mask])
