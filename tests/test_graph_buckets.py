"""CUDA-graph bucket sizes (pure logic; runs on CPU)."""

from __future__ import annotations

import pytest

from detserve.config import EngineConfig
from detserve.executor.attention import RowSegment
from detserve.executor.gemm_classes import decode_buckets
from detserve.executor.graphs import (
    context_of,
    span_variants,
    spans_for,
    step_layout,
    step_sizes,
)
from detserve.kernels.config import LaneConfig


@pytest.mark.parametrize("max_batch", [1, 3, 8, 64, 100, 256, 1000])
def test_buckets_cover_every_batch_size(max_batch: int) -> None:
    b = decode_buckets(max_batch)
    assert b == sorted(set(b)) and b[0] >= 1 and b[-1] == max_batch
    for n in range(1, max_batch + 1):
        pad = next(x for x in b if x >= n) - n
        assert pad <= max(7, n // 4), (n, pad)  # padding stays below ~25 % of the batch


def test_graph_config_validated() -> None:
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        EngineConfig.create("random:tiny", cuda_graph_max_batch=0)
    with pytest.raises(ValueError, match="cuda_graph_step_rows"):
        EngineConfig.create("random:tiny", cuda_graph_step_rows=-1)
    with pytest.raises(TypeError, match="lane_size_step"):  # deleted (measured slower)
        EngineConfig.create("random:tiny", lane_size_step=32)


@pytest.mark.parametrize("max_rows", [16, 96, 512, 2048, 3000])
def test_step_sizes_cover_every_step(max_rows: int) -> None:
    sizes = step_sizes(max_rows)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_rows and sizes[0] <= 16
    for n in range(1, max_rows + 1):
        pad = next(x for x in sizes if x >= n) - n
        assert pad <= max(15, n // 2), (n, pad)  # a graph never runs more than 1.5x the rows


def test_step_layout_rows_and_padding() -> None:
    """Decode rows attend one row per program, prompt rows several: each row carries its
    position in exactly one of the two position rows; a placeholder's id comes from the
    previous launch; padding rows write no K/V and attend to nothing."""
    segs = [RowSegment((7,), 5, (3,)),                # a decode row at position 5
            RowSegment((-1,), 20, (4, 9)),            # a placeholder, fed from row 2
            RowSegment((11, 12, 13), 14, (6, 8))]     # a prompt chunk at 14..16 (block 16)
    longs, ints = step_layout(segs, {1: 2}, 8, block_size=16)
    ids, pos, slots, src = longs
    seg, one, many = ints
    assert ids == [7, 0, 11, 12, 13, 0, 0, 0]
    assert pos == [5, 20, 14, 15, 16, 0, 0, 0]
    assert slots == [3 * 16 + 5, 9 * 16 + 4, 6 * 16 + 14, 6 * 16 + 15, 8 * 16 + 0, -1, -1, -1]
    assert src == [-1, 2, -1, -1, -1, -1, -1, -1]
    assert seg == [0, 1, 2, 2, 2, 0, 0, 0]
    assert one == [5, 20, -1, -1, -1, -1, -1, -1]
    assert many == [-1, -1, 14, 15, 16, -1, -1, -1]
    with pytest.raises(ValueError, match="do not fit"):
        step_layout(segs, {}, 4, block_size=16)


def test_span_variants_run_short_contexts_on_one_span() -> None:
    """Graphs of the lane kernel: one span where every context fits the first, else the
    most the table needs; never fewer spans than a segment's context needs."""
    cfg = LaneConfig(span=2048)
    assert span_variants(128, 16, cfg) == (1,)          # max_model_len 2,048: one span
    assert span_variants(1024, 16, cfg) == (1, 8)       # 16,384
    variants = span_variants(1024, 16, cfg)

    def spans(segs: list[RowSegment]) -> int:
        return spans_for(variants, context_of(segs), cfg)

    short = [RowSegment((1,), 2046, (1,)), RowSegment((1, 2), 0, (2,))]
    assert spans(short) == 1                            # contexts of 2,047 and 2 tokens
    long = [*short, RowSegment((1,), 2048, (3,))]       # a context of 2,049
    assert spans(long) == 8
    assert spans([RowSegment((1,) * 4, 2045, (1,))]) == 8  # 2,049 too
    assert spans_for(variants, 2048, cfg) == 1 and spans_for(variants, 16384, cfg) == 8
