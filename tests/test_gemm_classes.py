"""Row-count classes of matrix products and the lane's GEMM chunk (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from detserve.executor.gemm_classes import choose_lane_gemm_rows, row_classes


def test_row_classes_partition_the_sizes() -> None:
    w = torch.randn(96, 80)
    sizes = [2, 4, 8, 16, 32, 64]
    classes = row_classes(w, sizes)
    assert sorted(m for c in classes for m in c) == sizes
    # members of one class really give identical first rows
    x = torch.randn(64, 80, generator=torch.Generator().manual_seed(0))
    for c in classes:
        ref = torch.nn.functional.linear(x[:c[0]], w)[:2]
        for m in c[1:]:
            assert torch.equal(torch.nn.functional.linear(x[:m], w)[:2], ref)


def test_row_classes_separate_different_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """A product whose bits change above 64 rows (as when cuBLAS switches algorithm) splits
    the sizes there, and the lane chunk stays in the reference's class."""
    import detserve.executor.gemm_classes as gc

    real = gc.F.linear

    def fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = real(x, w)
        return out + 1e-3 if x.shape[0] > 64 else out  # "another algorithm" above 64 rows

    monkeypatch.setattr(gc.F, "linear", fake)
    w = torch.randn(32, 16)
    assert row_classes(w, [16, 32, 64, 128, 256]) == [[16, 32, 64], [128, 256]]
    # most buckets are <= 64: the chunk covers 512 lane rows in the fewest calls of that class
    assert choose_lane_gemm_rows([w], [1, 2, 4, 8, 16, 32, 64, 128], 512) == 64
    assert choose_lane_gemm_rows([w], [1, 2, 4, 8, 16, 32, 64, 128], 512, [256, 512]) == 64
    # most buckets above 64: a 512-row chunk (one call) from the extra sizes
    assert choose_lane_gemm_rows([w], [32, 96, 128, 160], 512, [512]) == 512


def test_lane_chunk_from_joint_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two weights with different switch points: only sizes in one class for both count."""
    import detserve.executor.gemm_classes as gc

    real = gc.F.linear

    def fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        limit = 16 if w.shape[0] == 8 else 48
        out = real(x, w)
        return out + 1e-3 if x.shape[0] > limit else out

    monkeypatch.setattr(gc.F, "linear", fake)
    a, b = torch.randn(8, 4), torch.randn(12, 4)
    # joint classes: {8, 16}, {24, 32, 40, 48}, {56, 64}; the middle one holds most buckets,
    # and 48 covers 96 lane rows in 2 calls
    assert choose_lane_gemm_rows([a, b], [8, 16, 24, 32, 40, 48, 56, 64], 96) == 48


def test_row_classes_rejects_tiny_sizes() -> None:
    with pytest.raises(ValueError):
        row_classes(torch.randn(4, 4), [0, 2])


def test_lane_gemm_rows_travels_in_the_verifier_geometry() -> None:
    """A remote verifier must run the decoder's lane chunk: the geometry carries it."""
    from detserve.registry import LaneGeometry
    from services.verifier import codec, verifier_pb2

    g = LaneGeometry(512, 64, 32, 16, lane_gemm_rows=224)
    pb = verifier_pb2.LaneGeometry(lane_rows=g.lane_rows, window=g.window,
                                   batch_invariant_rows=g.batch_invariant_rows,
                                   block_size=g.block_size, lane_gemm_rows=g.lane_gemm_rows)
    assert codec.decode_geometry(pb) == g
    assert codec.decode_geometry(verifier_pb2.LaneGeometry(
        lane_rows=512, window=64, batch_invariant_rows=32, block_size=16)).lane_gemm_rows == 0
    with pytest.raises(ValueError):
        LaneGeometry(512, 64, 32, 16, lane_gemm_rows=-1)


def test_auto_chunk_follows_the_graph_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA graphs the fast path decodes at the captured sizes, eagerly at any size;
    both pick the chunk from the class that holds most of those sizes."""
    import detserve.executor.gemm_classes as gc

    def fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = x[:, :1] * w[:, 0]  # elementwise: exact at every M (CPU BLAS is not, at M=2)
        return out + 1e-3 if x.shape[0] > 8 else out  # "another algorithm" above 8 rows

    monkeypatch.setattr(gc.F, "linear", fake)
    w = torch.randn(16, 8)
    # graphs: buckets 1, 2, 4, 8, 16, 24, 32 -> the class above 8 holds 3 of 7, the one up
    # to 8 holds 4: chunk 8 (8 calls for 64 rows)
    assert gc.auto_lane_gemm_rows([w], 32, 64, cuda_graphs=True) == 8
    # eager: sizes 1..32 -> above 8 holds 24 of them: a 64-row chunk (one call, extra size)
    assert gc.auto_lane_gemm_rows([w], 32, 64, cuda_graphs=False) == 64
