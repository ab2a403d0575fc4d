"""lane_attention: matches the reference, and a row's bits depend on the row alone.

CPU: the non-GPU tests run in a TRITON_INTERPRET=1 subprocess (test_interpreter_suite).
GPU: bf16 at model sizes (marked gpu).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

import kernel_helpers as kt  # noqa: E402
from kernel_suite import interp, interpreter_suite, needs_cuda  # noqa: E402

from detserve.kernels.config import LaneConfig, lane_variant  # noqa: E402
from detserve.kernels.lane_attention import (  # noqa: E402
    decode_tile_keeps_bits,
    default_rows_per_program,
    lane_attention,
    lane_attention_ref,
    lane_rows,
    lane_spans,
)

CPU = ("cpu", torch.float32)
GPU = ("cuda", torch.bfloat16)


test_interpreter_suite = interpreter_suite(__file__)


def _i32(xs: list[int], device: str) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32, device=device)


def check_matches_reference(device: str, dtype: torch.dtype, h: int, hkv: int, d: int,
                            page: int, lens: list[int], cfg: LaneConfig, atol: float) -> None:
    kv = kt.make_paged_kv(lens, hkv, d, page, dtype=dtype, device=device, seed=1)
    g = torch.Generator().manual_seed(2)
    rows = [(s, int(torch.randint(0, n, (1,), generator=g))) for s, n in enumerate(lens)]
    rows += [(s, n - 1) for s, n in enumerate(lens)] + [(0, 0), (0, -1)]  # ends, first, padding
    seq, pos = _i32([r[0] for r in rows], device), _i32([r[1] for r in rows], device)
    q = kt.randn(len(rows), h, d, dtype=dtype, device=device, seed=3)
    out = lane_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq, pos, cfg=cfg)
    ref = lane_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, seq, pos)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)
    assert torch.all(out[-1] == 0)  # the padding row


def check_row_invariance(device: str, dtype: torch.dtype, h: int, hkv: int, d: int, page: int,
                         lens: list[int], m: int, cfg: LaneConfig) -> None:
    """Same (q, seq, p) -> same bits: in any pass, at any index, however long the seq is."""
    g = torch.Generator().manual_seed(5)
    dense = kt.random_kv(lens, hkv, d, seed=6)
    kv = kt.paged_from_dense(dense, page, dtype=dtype, device=device, seed=7)
    q_all = kt.randn(3 * m, h, d, dtype=dtype, device=device, seed=8)
    # windows of consecutive positions of one sequence, as a lane pass packs them
    seq_l: list[int] = []
    pos_l: list[int] = []
    while len(seq_l) < 3 * m:
        s = int(torch.randint(0, len(lens), (1,), generator=g))
        w = int(torch.randint(1, 20, (1,), generator=g))
        p0 = int(torch.randint(0, lens[s], (1,), generator=g))
        for p in range(p0, min(p0 + w, lens[s])):
            seq_l.append(s)
            pos_l.append(p)
    seq_all = torch.tensor(seq_l[: 3 * m], dtype=torch.int32, device=device)
    pos_all = torch.tensor(pos_l[: 3 * m], dtype=torch.int32, device=device)
    rows = lane_rows(h // hkv, cfg)

    def run(idx: torch.Tensor, cache: kt.PagedKV = kv, rpp: int | None = None,
            spans: int | None = None) -> torch.Tensor:
        idx = idx.to(device)
        return lane_attention(q_all[idx], cache.k_cache, cache.v_cache, cache.block_tables,
                              seq_all[idx], pos_all[idx], cfg=cfg, rows_per_program=rpp,
                              max_spans=spans)

    base_idx = torch.arange(m)
    base = run(base_idx, rpp=rows)
    # 0. however many rows a program takes (the default follows M), however many spans run
    for rpp in sorted({1, 2, max(1, rows // 2), rows}):
        assert kt.bitwise_equal(run(base_idx, rpp=rpp), base), f"rows_per_program={rpp}"
    need = lane_spans(max(lens), cfg)
    for spans in sorted({need, need + 1, 2 * need + 3}):
        assert kt.bitwise_equal(run(base_idx, spans=spans), base), f"max_spans={spans}"
    # 1. the same rows permuted, among different neighbours, in passes of other sizes
    perm = torch.randperm(m, generator=g)
    assert kt.bitwise_equal(run(base_idx[perm]), base[perm.to(device)])
    mixed = torch.cat([torch.arange(m, 3 * m), base_idx])[torch.randperm(3 * m, generator=g)]
    out_mixed = run(mixed)
    where = {int(r): i for i, r in enumerate(mixed)}
    take = torch.tensor([where[r] for r in range(m)], device=device)
    assert kt.bitwise_equal(out_mixed[take], base)
    shifted = torch.cat([torch.arange(2 * m, 2 * m + 5), base_idx])  # every row moves by 5
    assert kt.bitwise_equal(run(shifted, rpp=rows)[5:], base)
    for r in (0, m // 2, m - 1):  # alone, M = 1
        assert kt.bitwise_equal(run(torch.tensor([r])), base[r : r + 1])
    # 2. everything past each row's p changed: other values, another block layout, NaNs
    for r in range(min(m, 6)):
        s, p = int(seq_all[r]), int(pos_all[r])
        longer = [(torch.cat([k[: p + 1], torch.randn(7 + s, hkv, d)]),
                   torch.cat([v[: p + 1], torch.randn(7 + s, hkv, d)])) for k, v in dense]
        shorter = [(k[: p + 1], v[: p + 1]) for k, v in dense]
        for variant, seed in ((longer, 11), (shorter, 12)):
            kv2 = kt.paged_from_dense(variant, page, dtype=dtype, device=device, seed=seed,
                                      max_blocks=kv.block_tables.shape[1] + 3)
            got = run(torch.tensor([r]), kv2)[0]
            assert kt.bitwise_equal(got, base[r]), f"row {r} changed with the cache past p={p}"


def test_default_rows_per_program() -> None:
    assert default_rows_per_program(1024, 8, 16, 132) == 16  # a prompt chunk: share KV
    assert default_rows_per_program(32, 8, 16, 132) == 1  # decode-like: parallelism first
    assert default_rows_per_program(128, 8, 16, 132) == 4
    assert lane_rows(4, LaneConfig(block_m=64)) == 16 and lane_rows(3, LaneConfig()) == 16


@interp
@pytest.mark.parametrize("h,hkv,d,page,tile", [
    (6, 2, 32, 4, 32), (4, 4, 24, 16, 16), (9, 3, 64, 64, 32), (8, 1, 16, 8, 16),
])
def test_matches_reference_interp(h: int, hkv: int, d: int, page: int, tile: int) -> None:
    check_matches_reference(*CPU, h, hkv, d, page, [1, 37, 70, 16],
                            LaneConfig(tile=tile, block_m=16), 1e-5)


@interp
@pytest.mark.parametrize("page,tile,block_m", [(8, 16, 16), (32, 16, 32)])
def test_row_invariance_interp(page: int, tile: int, block_m: int) -> None:
    check_row_invariance(*CPU, 6, 2, 32, page, [40, 9, 73], 12,
                         LaneConfig(tile=tile, block_m=block_m))


def check_spans(device: str, dtype: torch.dtype, h: int, hkv: int, d: int, page: int,
                cfg: LaneConfig, atol: float) -> None:
    """``LaneConfig.span``: contexts past the first span reduce span by span and merge in
    order. Such rows match the reference; windows that straddle a span's end get the
    same bits from the one-row kernel and the windowed one; rows inside the first span keep
    the bits of a lane without spans; and the long rows' bits are other than those of a
    lane without spans (so the span is part of the numerics: the control)."""
    s = cfg.span
    lens = [3 * s + 5, s, s + 1, s // 2, 2 * s + cfg.tile]
    kv = kt.make_paged_kv(lens, hkv, d, page, dtype=dtype, device=device, seed=51)
    rows = [(i, p) for i, n in enumerate(lens) for p in range(max(0, n - 9), n)]  # windows
    rows += [(0, p) for p in range(s - 4, s + 4)] + [(0, 0), (0, -1)]  # across a span's end
    seq, pos = _i32([r[0] for r in rows], device), _i32([r[1] for r in rows], device)
    q = kt.randn(len(rows), h, d, dtype=dtype, device=device, seed=52)

    def call(c: LaneConfig, rpp: int | None = None) -> torch.Tensor:
        return lane_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq, pos, cfg=c,
                              rows_per_program=rpp)

    out = call(cfg)
    torch.testing.assert_close(out.float(), lane_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_tables, seq, pos).float(), atol=atol, rtol=atol)
    assert torch.all(out[-1] == 0)  # the padding row
    if cfg.dot_sums:
        assert kt.bitwise_equal(call(cfg, 1), out)  # the one-row kernel, span by span
    whole = call(dataclasses.replace(cfg, span=4 * cfg.span * 4))  # one span holds all
    short = pos < s
    assert kt.bitwise_equal(out[short], whole[short])
    assert not kt.bitwise_equal(out[~short], whole[~short])


@interp
def test_spans_interp() -> None:
    for dot_sums in (True, False):
        cfg = LaneConfig(tile=16, block_m=16, span=32, dot_sums=dot_sums)
        check_spans(*CPU, 6, 2, 32, 8, cfg, 1e-5)
        check_row_invariance(*CPU, 6, 2, 32, 8, [40, 9, 73, 100], 12, cfg)


@pytest.mark.gpu
@needs_cuda
def test_spans_gpu() -> None:
    check_spans(*GPU, 32, 8, 128, 16, LaneConfig(), 2e-2)
    check_spans(*GPU, 32, 8, 128, 16, LaneConfig(span=256), 2e-2)


def check_full_tiles_keep_the_bits(device: str, dtype: torch.dtype, h: int, hkv: int, d: int,
                                   page: int, cfg: LaneConfig) -> None:
    """``LaneConfig.full_tiles``: the tiles every live slot sees whole run unmasked; the
    output is bit for bit the masked kernel's, for windows (several rows of a sequence in a
    program, whose smallest p decides which tiles are whole) and decode-like rows alike."""
    lens = [3 * cfg.tile + 5, cfg.tile // 2, 2 * cfg.tile, cfg.tile]
    kv = kt.make_paged_kv(lens, hkv, d, page, dtype=dtype, device=device, seed=21)
    rows = [(s, p) for s, n in enumerate(lens) for p in range(max(0, n - 9), n)]  # windows
    rows += [(s, p) for s, n in enumerate(lens) for p in range(0, n, 7)] + [(0, -1)]
    seq, pos = _i32([r[0] for r in rows], device), _i32([r[1] for r in rows], device)
    q = kt.randn(len(rows), h, d, dtype=dtype, device=device, seed=22)
    full = dataclasses.replace(cfg, full_tiles=True)
    masked = dataclasses.replace(cfg, full_tiles=False)
    for rpp in (1, lane_rows(h // hkv, cfg)):
        def call(c: LaneConfig, rpp: int = rpp) -> torch.Tensor:
            return lane_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq, pos,
                                  cfg=c, rows_per_program=rpp)
        assert kt.bitwise_equal(call(full), call(masked)), f"rows_per_program={rpp}"


@interp
def test_full_tiles_keep_the_bits_interp() -> None:
    cfg = LaneConfig(tile=16, block_m=16)
    check_full_tiles_keep_the_bits(*CPU, 6, 2, 32, 8, cfg)
    check_row_invariance(*CPU, 6, 2, 32, 8, [40, 9, 73], 12,
                         dataclasses.replace(cfg, full_tiles=True))
    check_matches_reference(*CPU, 6, 2, 32, 8, [1, 37, 70, 16],
                            dataclasses.replace(cfg, full_tiles=True), 1e-5)


@interp
def test_rejects_bad_arguments() -> None:
    kv = kt.make_paged_kv([8], 2, 16, 8, dtype=torch.float32, device="cpu")
    q = torch.zeros(2, 4, 16)
    seq, pos = _i32([0, 0], "cpu"), _i32([1, 2], "cpu")
    with pytest.raises(ValueError, match="dtype"):
        lane_attention(q.double(), kv.k_cache, kv.v_cache, kv.block_tables, seq, pos)
    with pytest.raises(ValueError, match="row_pos"):
        lane_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq, pos.long())
    with pytest.raises(ValueError, match="divide"):
        kv24 = kt.make_paged_kv([8], 2, 16, 24, dtype=torch.float32, device="cpu")
        lane_attention(q, kv24.k_cache, kv24.v_cache, kv24.block_tables, seq, pos)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("h,hkv,d", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("page", [16, 64])
def test_matches_reference_gpu(h: int, hkv: int, d: int, page: int) -> None:
    check_matches_reference(*GPU, h, hkv, d, page, [1, 300, 2048, 4099], LaneConfig(), 2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("h,hkv,d", [(32, 8, 128), (9, 3, 64)])
def test_row_invariance_gpu(h: int, hkv: int, d: int) -> None:
    check_row_invariance(*GPU, h, hkv, d, 16, [2000, 77, 4096, 513], 200, LaneConfig())


@pytest.mark.gpu
@needs_cuda
def test_full_tiles_keep_the_bits_gpu() -> None:
    """On the GPU, where the compiler decides: the unmasked tiles give the masked bits."""
    cfg = LaneConfig()
    check_full_tiles_keep_the_bits(*GPU, 32, 8, 128, 16, cfg)
    check_row_invariance(*GPU, 32, 8, 128, 16, [2000, 77, 4096, 513], 200,
                         dataclasses.replace(cfg, full_tiles=True))


def check_dot_sums_tile_free(device: str, dtype: torch.dtype, h: int, hkv: int, d: int,
                             page: int, tiles: list[tuple[int, int]], tile: int) -> None:
    """``LaneConfig.dot_sums``: a row's bits do not depend on the query tile and warps
    (``tiles``: (block_m, num_warps) pairs), whether a program holds one row (a decode row:
    the one-row kernel, ``_lane_decode_kernel``) or a window's rows; and they are other bits
    than the plain sums' (so the flag is part of the numerics)."""
    lens = [3 * tile + 5, 40, 2 * tile, 2 * tile + 2]
    kv = kt.make_paged_kv(lens, hkv, d, page, dtype=dtype, device=device, seed=41)
    pairs = [(s, p) for s, n in enumerate(lens) for p in range(max(0, n - 9), n)]  # windows
    pairs += [(s, p) for s, n in enumerate(lens) for p in range(0, n, 11)] + [(0, -1)]
    seq, pos = _i32([x[0] for x in pairs], device), _i32([x[1] for x in pairs], device)
    q = kt.randn(len(pairs), h, d, dtype=dtype, device=device, seed=42)

    def call(cfg: LaneConfig, rpp: int | None) -> torch.Tensor:
        return lane_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq, pos, cfg=cfg,
                              rows_per_program=rpp)

    base = LaneConfig(tile=tile, dot_sums=True)
    ref = call(base, None)
    assert torch.all(ref[-1] == 0)  # the padding row
    for block_m, warps in tiles:
        cfg = dataclasses.replace(base, block_m=block_m, num_warps=warps, num_stages=2)
        for rpp in (1, None):
            assert kt.bitwise_equal(call(cfg, rpp), ref), (block_m, warps, rpp)
    assert not kt.bitwise_equal(call(dataclasses.replace(base, dot_sums=False), None), ref)
    torch.testing.assert_close(ref.float(), lane_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_tables, seq, pos).float(), atol=2e-2, rtol=2e-2)


@interp
def test_dot_sums_keep_row_invariance_interp() -> None:
    check_dot_sums_tile_free(*CPU, 6, 2, 32, 8, [(32, 4), (64, 4)], 16)
    cfg = LaneConfig(tile=16, block_m=16, dot_sums=True)
    check_row_invariance(*CPU, 6, 2, 32, 8, [40, 9, 73], 12, cfg)
    check_matches_reference(*CPU, 6, 2, 32, 8, [1, 37, 70, 16], cfg, 1e-5)


@pytest.mark.gpu
@needs_cuda
def test_dot_sums_give_every_query_tile_the_same_bits_gpu() -> None:
    check_dot_sums_tile_free(*GPU, 32, 8, 128, 16,
                             [(16, 4), (32, 4), (16, 1), (32, 2), (16, 2), (128, 8)], 64)
    check_row_invariance(*GPU, 32, 8, 128, 16, [2000, 77, 4096, 513], 200,
                         LaneConfig(dot_sums=True))


@interp
def test_decode_tile_probe_answers_both_ways_interp() -> None:
    """The start-up probe of the decode rows' tile: a tile with dot sums keeps the lane's
    bits here; the control, plain sums (other bits, as the test above shows), is caught."""
    lane = LaneConfig(tile=16, span=64, block_m=32, dot_sums=True)
    tile16 = dataclasses.replace(lane, block_m=16, num_warps=2)
    assert decode_tile_keeps_bits(lane, tile16, 6, 2, 32, 8, torch.float32, "cpu")
    plain = dataclasses.replace(tile16, dot_sums=False)
    assert not decode_tile_keeps_bits(lane, plain, 6, 2, 32, 8, torch.float32, "cpu")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("h,hkv", [(32, 8), (48, 8), (64, 8), (16, 2), (128, 8)])
def test_decode_tile_probe_gpu(h: int, hkv: int) -> None:
    """At the 8B (group 4) and 70B (group 8, TP 1 and 4) head geometries and at group 16:
    the engine's resolved decode tile (the auto tile where the probe passes it, else the
    lane's own) gives decode rows the lane's bits on an input other than the probe's. On
    an H200 the auto tile kept them at groups 4 and 6 and missed them at 8 and 16."""
    lane = LaneConfig(dot_sums=True)
    auto = lane_variant(lane, "auto")
    keeps = decode_tile_keeps_bits(lane, auto, h, hkv, 128, 16, torch.bfloat16, "cuda")
    chosen = auto if keeps else lane
    tile = lane.tile
    lens = [5 * tile + 9, 77, lane.span + 3 * tile + 1]
    kv = kt.make_paged_kv(lens, hkv, 128, 16, dtype=torch.bfloat16, device="cuda", seed=61)
    pairs = [(s, p) for s, n in enumerate(lens) for p in range(0, n, 7)]
    seq = _i32([x[0] for x in pairs], "cuda")
    pos = _i32([x[1] for x in pairs], "cuda")
    q = kt.randn(len(pairs), h, 128, dtype=torch.bfloat16, device="cuda", seed=62)

    def call(cfg: LaneConfig, rpp: int | None) -> torch.Tensor:
        return lane_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq, pos, cfg=cfg,
                              rows_per_program=rpp)

    ref = call(lane, None)
    assert kt.bitwise_equal(call(chosen, 1), ref)
    # the probe's verdict holds on this input too (a probe that passed a tile missing the
    # lane's bits, or failed one keeping them, shows here)
    assert kt.bitwise_equal(call(auto, 1), ref) == keeps
