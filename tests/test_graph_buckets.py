"""CUDA-graph bucket sizes (pure logic; runs on CPU)."""

from __future__ import annotations

import pytest

from detserve.config import EngineConfig
from detserve.executor.graphs import decode_buckets


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
