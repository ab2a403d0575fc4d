"""Lane attention: the determinism-critical kernel of the fixed-shape lane.

Each of the pass's M rows is one query token: (sequence -> block-table row, absolute
position p). The row reduces over KV tiles aligned to absolute positions, tile t covering
positions [t*TILE, (t+1)*TILE), strictly in increasing t with an online softmax, masking
positions > p. Spans of ``cfg.span`` absolute positions ([k*SPAN, (k+1)*SPAN)) run in
programs of their own, each from an empty state; a row whose context reaches past the
first span gets its spans' states merged in increasing k by ``_lane_merge_kernel``. The
spans are fixed by absolute position, not by the batch or the context length, so a long
context runs in parallel with the same bits wherever it runs (the fast path's aligned
decode rows included); a row inside the first span never merges.

A program owns (a block of ``rows_per_program`` consecutive rows, a kv head). Its rows that
share a sequence are processed together, so a verify window or a prompt chunk reads each KV
tile once: the query tile is [ROWS * BLOCK_G, D], one slot per (row, query head of this kv
head), and its height ``cfg.block_m`` never changes, however many slots are filled. A row
keeps its running state unchanged (``tl.where``) in tiles that start past its p, and in its
last tile the positions past p get probability 0, so what the other slots hold cannot reach
its bits: matrix-multiply rows are computed independently of one another.

Invariant (tested bitwise): a row's output is a function of its q, the cached K/V at
positions 0..p, p and the compile-time constants (TILE, SPAN, block_m, head sizes, dtype,
num_warps) alone -- not of the other rows, the row's index in the pass, M,
``rows_per_program``, the number of spans launched, how the sequence was chunked, or
anything cached beyond p. The pass
must have written its own K/V to the cache before this kernel runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from detserve.kernels._utils import (
    LOG2E,
    cdiv,
    default_scale,
    dot_precision,
    expect,
    expect_block_tables,
    expect_int_vector,
    expect_paged_cache,
    gather_kv,
    next_pow2,
    num_sms,
    paged_strides,
)
from detserve.kernels.config import TABLE, LaneConfig


@triton.jit
def _softmax_step(qk, m_i, l_i, dtype: tl.constexpr, TILE: tl.constexpr,
                  PRECISION: tl.constexpr, DOT_SUMS: tl.constexpr):
    """The online softmax's step over one tile's scores (log2 units): the new running max,
    the old state's rescale, the tile's probabilities (in ``dtype``, as they multiply V)
    and the new running sum. ``DOT_SUMS``: a row's sum of probabilities is a matrix product
    with ones, of the probabilities as they multiply V, whose order (the MMA's, along K)
    does not depend on how warps split the tile; else ``tl.sum`` of the fp32
    probabilities, whose order does (LaneConfig.dot_sums)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows seeing nothing: no inf - inf
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    pv = p.to(dtype)
    if DOT_SUMS:  # every column of the product is the row's sum: max picks it exactly
        ones = tl.full([TILE, 16], 1.0, dtype=dtype)
        tile_sum = tl.max(tl.dot(pv, ones, input_precision=PRECISION), 1)
    else:
        tile_sum = tl.sum(p, 1)
    return m_new, alpha, pv, l_i * alpha + tile_sum


@triton.jit
def _lane_tile(
    q, m_i, l_i, acc, start, pos_i, live_i, last,
    bt_row, k_cache_ptr, v_cache_ptr, kv_head, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    offs_d, d_mask,
    PAGE: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, DOT_SUMS: tl.constexpr,
):
    """Fold positions [start, start + TILE) into the state of the slots with live_i set.

    Slot i sees positions <= pos_i[i]; a slot whose p is before ``start`` keeps its state.
    K/V past ``last`` (the largest p of the live slots) are not read.
    """
    offs_n = start + tl.arange(0, TILE)
    n_mask = offs_n <= last
    blk = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
    in_page = offs_n % PAGE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k_off = blk * stride_kb + in_page * stride_ks + kv_head * stride_kh
    k = tl.load(k_cache_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    qk = tl.where(offs_n[None, :] <= pos_i[:, None], qk, float("-inf"))
    m_new, alpha, p, l_new = _softmax_step(qk, m_i, l_i, k.dtype, TILE, PRECISION, DOT_SUMS)
    v_off = blk * stride_vb + in_page * stride_vs + kv_head * stride_vh
    v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    acc_new = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    upd = live_i & (start <= pos_i)
    m_i = tl.where(upd, m_new, m_i)
    l_i = tl.where(upd, l_new, l_i)
    acc = tl.where(upd[:, None], acc_new, acc)
    return m_i, l_i, acc


@triton.jit
def _lane_full_tile(
    q, m_i, l_i, acc, start, live_i,
    bt_row, k_cache_ptr, v_cache_ptr, kv_head, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    offs_d, d_mask,
    PAGE: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, DOT_SUMS: tl.constexpr,
):
    """``_lane_tile`` for a tile that every live slot sees whole (it ends at or before the
    smallest live p): the same operations on the same values, without the position masks
    on the loads and without keeping any live slot's state (each is updated). The slots
    that are not live get -inf scores, as in ``_lane_tile``; their state is never read."""
    offs_n = start + tl.arange(0, TILE)
    blk = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
    in_page = offs_n % PAGE
    kv_mask = d_mask[None, :]
    k_off = blk * stride_kb + in_page * stride_ks + kv_head * stride_kh
    k = tl.load(k_cache_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    qk = tl.where(live_i[:, None], qk, float("-inf"))
    m_new, alpha, p, l_new = _softmax_step(qk, m_i, l_i, k.dtype, TILE, PRECISION, DOT_SUMS)
    v_off = blk * stride_vb + in_page * stride_vs + kv_head * stride_vh
    v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    acc_new = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_new, acc_new


@triton.jit
def _lane_span_tiles(
    q, m_i, l_i, acc, lo, whole_end, hi, pos_i, live_i, last,
    bt_row, k_cache_ptr, v_cache_ptr, kv_head, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    offs_d, d_mask,
    PAGE: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, DOT_SUMS: tl.constexpr,
    FULL_TILES: tl.constexpr,
):
    """A span's tiles [lo, hi), in order: with ``FULL_TILES`` those before ``whole_end``
    (every live slot sees them whole) without the position masks, then the others."""
    masked_lo = lo
    if FULL_TILES:
        masked_lo = whole_end
        for start in range(lo, masked_lo, TILE):
            m_i, l_i, acc = _lane_full_tile(
                q, m_i, l_i, acc, start, live_i,
                bt_row, k_cache_ptr, v_cache_ptr, kv_head, qk_scale,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                offs_d, d_mask, PAGE, TILE, PRECISION, DOT_SUMS)
    for start in range(masked_lo, hi, TILE):
        m_i, l_i, acc = _lane_tile(
            q, m_i, l_i, acc, start, pos_i, live_i, last,
            bt_row, k_cache_ptr, v_cache_ptr, kv_head, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            offs_d, d_mask, PAGE, TILE, PRECISION, DOT_SUMS)
    return m_i, l_i, acc


@triton.jit
def _lane_span_end(o_ptrs, mid_o_ptr, mid_ml_ptr, row_i, head_i, span, num_heads, num_spans,
                   m_i, l_i, acc, live_i, pos_i, offs_d, d_mask,
                   HEAD_DIM: tl.constexpr, SPAN: tl.constexpr):
    """The end of a span for the live slots: a row inside the first span (p < SPAN) has
    its output, stored; a longer row leaves its state (running max, sum and unnormalised
    accumulator) in its span's place for ``_lane_merge_kernel``."""
    short_i = live_i & (pos_i < SPAN)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(o_ptrs, o.to(o_ptrs.dtype.element_ty), mask=short_i[:, None] & d_mask[None, :])
    long_i = live_i & (pos_i >= SPAN)
    at = (row_i.to(tl.int64) * num_heads + head_i) * num_spans + span
    tl.store(mid_o_ptr + at[:, None] * HEAD_DIM + offs_d[None, :], acc,
             mask=long_i[:, None] & d_mask[None, :])
    tl.store(mid_ml_ptr + at * 2, m_i, mask=long_i)
    tl.store(mid_ml_ptr + at * 2 + 1, l_i, mask=long_i)


@triton.jit(do_not_specialize=["M", "rows_per_program", "num_spans"])
def _lane_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, row_seq_ptr, row_pos_ptr, out_ptr,
    mid_o_ptr, mid_ml_ptr,
    qk_scale, M, rows_per_program, num_heads, num_spans,
    stride_qm, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_om, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, TILE: tl.constexpr, SPAN: tl.constexpr, PRECISION: tl.constexpr,
    FULL_TILES: tl.constexpr, DOT_SUMS: tl.constexpr,
):
    kvh = tl.program_id(1)
    span = tl.program_id(2)
    lo = span * SPAN
    row0 = tl.program_id(0) * rows_per_program
    row_end = tl.minimum(row0 + rows_per_program, M)

    # Slot i = (row row0 + i // BLOCK_G, query head kvh * GROUP + i % BLOCK_G).
    offs_i = tl.arange(0, ROWS * BLOCK_G)
    row_i = row0 + offs_i // BLOCK_G
    g_i = offs_i % BLOCK_G
    in_i = (row_i < row_end) & (g_i < GROUP)
    seq_i = tl.load(row_seq_ptr + row_i, mask=in_i, other=-1)
    pos_i = tl.load(row_pos_ptr + row_i, mask=in_i, other=-1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    head_i = kvh * GROUP + g_i
    q_off = row_i.to(tl.int64) * stride_qm + head_i * stride_qh
    o_ptrs = out_ptr + (row_i.to(tl.int64) * stride_om + head_i * stride_oh)[:, None] \
        + offs_d[None, :]
    if span == 0:  # padding rows (p < 0) produce zeros
        pad_i = in_i & (pos_i < 0)
        tl.store(o_ptrs, tl.zeros([ROWS * BLOCK_G, BLOCK_D], dtype=out_ptr.dtype.element_ty),
                 mask=pad_i[:, None] & d_mask[None, :])

    if tl.max(pos_i, 0) >= lo:  # some row of the block reaches into this span
        q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :],
                    mask=in_i[:, None] & d_mask[None, :], other=0.0)
        # One pass per distinct sequence, led by its first row in the block that reaches
        # into the span.
        for row in range(row0, row_end):
            seq = tl.load(row_seq_ptr + row)
            p = tl.load(row_pos_ptr + row)
            first = tl.sum(((row_i < row) & (seq_i == seq) & (pos_i >= lo)).to(tl.int32),
                           0) == 0
            if (p >= lo) & first:
                live_i = in_i & (seq_i == seq) & (pos_i >= lo)
                last = tl.max(tl.where(live_i, pos_i, -1), 0)
                m_i = tl.full([ROWS * BLOCK_G], float("-inf"), dtype=tl.float32)
                l_i = tl.zeros([ROWS * BLOCK_G], dtype=tl.float32)
                acc = tl.zeros([ROWS * BLOCK_G, BLOCK_D], dtype=tl.float32)
                bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
                hi = tl.minimum(last + 1, lo + SPAN)
                # tiles every live slot sees whole: up to the smallest live p's tile
                least = tl.min(tl.where(live_i, pos_i, last), 0)
                m_i, l_i, acc = _lane_span_tiles(
                    q, m_i, l_i, acc, lo, tl.minimum(hi, (least + 1) // TILE * TILE), hi,
                    pos_i, live_i, last, bt_row, k_cache_ptr, v_cache_ptr, kvh, qk_scale,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    offs_d, d_mask, PAGE, TILE, PRECISION, DOT_SUMS, FULL_TILES)
                _lane_span_end(o_ptrs, mid_o_ptr, mid_ml_ptr, row_i, head_i, span, num_heads,
                               num_spans, m_i, l_i, acc, live_i, pos_i, offs_d, d_mask,
                               HEAD_DIM, SPAN)


@triton.jit(do_not_specialize=["num_spans"])
def _lane_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, row_seq_ptr, row_pos_ptr, out_ptr,
    mid_o_ptr, mid_ml_ptr,
    qk_scale, num_heads, num_spans,
    stride_qm, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_om, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, TILE: tl.constexpr, SPAN: tl.constexpr, PRECISION: tl.constexpr,
    FULL_TILES: tl.constexpr,
):
    """``_lane_kernel`` for one row per program (the fast path's decode rows): one program
    per (row, kv head, span), its query tile the row's GROUP heads padded to BLOCK_M slots,
    its tile loop at the top level. The same tile steps with dot sums, whose bits should not
    depend on the query tile; a slot gets the generic kernel's bits where
    ``decode_tile_keeps_bits`` finds it (not at every tile for groups of 8 and 16)."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    span = tl.program_id(2)
    lo = span * SPAN
    p = tl.load(row_pos_ptr + row)
    offs_g = tl.arange(0, BLOCK_M)
    live_i = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    head_i = kvh * GROUP + offs_g
    o_ptrs = out_ptr + (row.to(tl.int64) * stride_om + head_i * stride_oh)[:, None] \
        + offs_d[None, :]
    o_mask = live_i[:, None] & d_mask[None, :]
    if p < 0:  # a padding row: zeros, as the generic kernel gives it
        if span == 0:
            tl.store(o_ptrs, tl.zeros([BLOCK_M, BLOCK_D], dtype=out_ptr.dtype.element_ty),
                     mask=o_mask)
    elif p >= lo:
        seq = tl.load(row_seq_ptr + row)
        q = tl.load(q_ptr + (row.to(tl.int64) * stride_qm + head_i * stride_qh)[:, None]
                    + offs_d[None, :], mask=o_mask, other=0.0)
        pos_i = tl.full([BLOCK_M], 0, dtype=tl.int32) + p
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        hi = tl.minimum(p + 1, lo + SPAN)
        m_i, l_i, acc = _lane_span_tiles(
            q, m_i, l_i, acc, lo, tl.minimum(hi, (p + 1) // TILE * TILE), hi,
            pos_i, live_i, p, bt_row, k_cache_ptr, v_cache_ptr, kvh, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            offs_d, d_mask, PAGE, TILE, PRECISION, True, FULL_TILES)
        row_i = tl.full([BLOCK_M], 0, dtype=tl.int32) + row
        _lane_span_end(o_ptrs, mid_o_ptr, mid_ml_ptr, row_i, head_i, span, num_heads,
                       num_spans, m_i, l_i, acc, live_i, pos_i, offs_d, d_mask,
                       HEAD_DIM, SPAN)


@triton.jit(do_not_specialize=["num_spans"])
def _lane_merge_kernel(
    row_pos_ptr, out_ptr, mid_o_ptr, mid_ml_ptr, num_heads, num_spans,
    stride_om, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPAN: tl.constexpr,
):
    """One (row, head) whose context reaches past the first span: its spans' states merged
    in increasing span order, from the first, whatever the launch (a fixed order: the
    row's bits), then normalised."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.load(row_pos_ptr + row)
    if p >= SPAN:
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        at = (row.to(tl.int64) * num_heads + h) * num_spans
        m = tl.load(mid_ml_ptr + at * 2)
        l_run = tl.load(mid_ml_ptr + at * 2 + 1)
        acc = tl.load(mid_o_ptr + at * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
        for k in range(1, p // SPAN + 1):
            mk = tl.load(mid_ml_ptr + (at + k) * 2)
            lk = tl.load(mid_ml_ptr + (at + k) * 2 + 1)
            ak = tl.load(mid_o_ptr + (at + k) * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
            m_new = tl.maximum(m, mk)
            a = tl.exp2(m - m_new)
            b = tl.exp2(mk - m_new)
            acc = acc * a + ak * b
            l_run = l_run * a + lk * b
            m = m_new
        o = acc / l_run
        tl.store(out_ptr + row.to(tl.int64) * stride_om + h * stride_oh + offs_d,
                 o.to(out_ptr.dtype.element_ty), mask=d_mask)


def lane_rows(group: int, cfg: LaneConfig = TABLE.lane) -> int:
    """Row slots of one program for g query heads per kv head: block_m // next_pow2(g)."""
    return max(1, cfg.block_m // next_pow2(group))


def default_rows_per_program(m: int, num_kv_heads: int, rows: int, sms: int) -> int:
    """Largest power of two <= rows that still gives every SM a program (from M alone)."""
    rpp = rows
    while rpp > 1 and cdiv(m, rpp) * num_kv_heads < sms:
        rpp //= 2
    return rpp


def lane_spans(positions: int, cfg: LaneConfig = TABLE.lane) -> int:
    """Spans that hold ``positions`` positions (at least one)."""
    return max(1, cdiv(positions, cfg.span))


def lane_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    row_seq: Tensor,
    row_pos: Tensor,
    *,
    scale: float | None = None,
    rows_per_program: int | None = None,
    max_spans: int | None = None,
    out: Tensor | None = None,
    cfg: LaneConfig = TABLE.lane,
) -> Tensor:
    """Position-aligned attention for the M rows of a lane pass, in fixed spans.

    q: [M, H, D]; row_seq int32 [M]: row of ``block_tables`` of each row's sequence;
    row_pos int32 [M]: absolute position p of each row (p < 0: padding row, output zeros).
    The cache must hold the sequence's K/V for positions 0..p (the row's own included) and
    its block-table row must cover them. ``rows_per_program`` (1..block_m // next_pow2(g))
    only moves speed, never bits: rows of one sequence that fall in one program share
    its KV reads, so put a window's or a chunk's rows next to each other. By default it is
    chosen from M and the SM count. ``max_spans``: spans launched, enough for every p
    (p < max_spans * cfg.span); by default the block table's width's (every position a
    table can hold). Launching more only costs idle programs, never bits. Returns ``out``
    [M, H, D] in q's dtype. Needs no host sync (CUDA-graph safe); does not modify the cache.
    """
    _, page, hkv, d = expect_paged_cache(k_cache, v_cache)
    expect(q.dim() == 3 and q.shape[2] == d, f"q must be [M, H, {d}], got {tuple(q.shape)}")
    expect(q.dtype == k_cache.dtype, f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    expect(q.stride(2) == 1, "q needs contiguous head_dim")
    m, h, _ = q.shape
    expect(h % hkv == 0, f"{h} query heads not a multiple of {hkv} kv heads")
    expect_block_tables(block_tables, q.device)
    for t, name in ((row_seq, "row_seq"), (row_pos, "row_pos")):
        expect_int_vector(t, name, m)
        expect(t.dtype == torch.int32 and t.device == q.device, f"{name} must be int32 on q's device")
    expect(page % cfg.tile == 0 or cfg.tile % page == 0,
           f"lane tile {cfg.tile} and block_size {page} must divide one another")
    if out is None:
        out = torch.empty_like(q)
    expect(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "bad out")
    if m == 0:
        return out
    if max_spans is None:
        max_spans = lane_spans(block_tables.shape[1] * page, cfg)
    expect(max_spans >= 1, "max_spans must be >= 1")
    group = h // hkv
    rows = lane_rows(group, cfg)
    if rows_per_program is None:
        rows_per_program = default_rows_per_program(m, hkv, rows, num_sms(q.device))
    expect(1 <= rows_per_program <= rows, f"rows_per_program must be in 1..{rows}")
    # the states of rows past the first span, one place per (row, head, span)
    places = (m, h, max_spans) if max_spans > 1 else (0, 0, 0)
    mid_o = torch.empty((*places, d), dtype=torch.float32, device=q.device)
    mid_ml = torch.empty((*places, 2), dtype=torch.float32, device=q.device)
    common = dict(HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), PAGE=page, TILE=cfg.tile,
                  SPAN=cfg.span, PRECISION=dot_precision(q.dtype), FULL_TILES=cfg.full_tiles,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args = (q, k_cache, v_cache, block_tables, row_seq, row_pos, out, mid_o, mid_ml,
            default_scale(d, scale) * LOG2E)
    strides = paged_strides(q, k_cache, v_cache, block_tables, out)
    if rows_per_program == 1 and cfg.dot_sums:
        # decode rows: the one-row kernel (the same bits only where no sum depends on the
        # query tile, hence dot sums only)
        _lane_decode_kernel[(m, hkv, max_spans)](
            *args, h, max_spans, *strides,
            GROUP=group, BLOCK_M=max(cfg.block_m, next_pow2(group)), **common)
    else:
        _lane_kernel[(cdiv(m, rows_per_program), hkv, max_spans)](
            *args, m, rows_per_program, h, max_spans, *strides,
            GROUP=group, BLOCK_G=next_pow2(group), ROWS=rows, DOT_SUMS=cfg.dot_sums,
            **common)
    if max_spans > 1:
        _lane_merge_kernel[(m, h)](
            row_pos, out, mid_o, mid_ml, h, max_spans, out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), SPAN=cfg.span)
    return out


def lane_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                       row_seq: Tensor, row_pos: Tensor, *, scale: float | None = None) -> Tensor:
    """Plain-torch reference (fp32 math): row r attends positions 0..row_pos[r]."""
    h, d = q.shape[1], q.shape[2]
    g = h // k_cache.shape[2]
    s = default_scale(d, scale)
    out = torch.zeros_like(q)
    for r in range(q.shape[0]):
        p = int(row_pos[r])
        if p < 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[int(row_seq[r])], p + 1)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[r].float(), k) * s
        out[r] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


def decode_tile_keeps_bits(lane: LaneConfig, decode: LaneConfig, num_heads: int,
                           num_kv_heads: int, head_dim: int, page: int, dtype: torch.dtype,
                           device: str | torch.device, seed: int = 0) -> bool:
    """Whether decode rows (one per program, ``decode``'s query tile and launch) get the
    bits the lane gives them (``lane``, rows several per program), on a random probe at
    this head geometry: windows' rows and strided positions of sequences that end inside
    a tile, on a tile boundary and past the first span.

    With dot sums the tile should not matter, and at GQA groups of 4 or 6 it does not; at
    groups of 8 and 16 query tiles under 64 slots gave other bits on an H200 (docs/
    benchmarks/gpu/2026-11-28-i-h200), so the one-row tile is probed, not assumed."""
    lens = [3 * lane.tile + 5, 40, 2 * lane.tile, lane.span + lane.tile + 3]
    gen = torch.Generator().manual_seed(seed)
    blocks = [cdiv(n, page) for n in lens]
    width = max(blocks)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    start = 1  # block 0 stays unused, as the engine's scratch block
    for s, nb in enumerate(blocks):
        tables[s, :nb] = torch.arange(start, start + nb, dtype=torch.int32)
        start += nb
    shape = (start, page, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    rows = [(s, p) for s, n in enumerate(lens) for p in range(max(0, n - 9), n)]
    rows += [(s, p) for s, n in enumerate(lens) for p in range(0, n, 23)]
    seq = torch.tensor([r[0] for r in rows], dtype=torch.int32, device=device)
    pos = torch.tensor([r[1] for r in rows], dtype=torch.int32, device=device)
    q = torch.randn(len(rows), num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    tables = tables.to(device)
    ref = lane_attention(q, k_cache, v_cache, tables, seq, pos, cfg=lane)
    one_row = lane_attention(q, k_cache, v_cache, tables, seq, pos, cfg=decode,
                             rows_per_program=1)
    return torch.equal(ref.view(torch.uint8), one_row.view(torch.uint8))  # bits, -0.0 too
