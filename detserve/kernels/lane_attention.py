"""Lane attention: the determinism-critical kernel of the fixed-shape lane.

Each of the pass's M rows is one query token: (sequence -> block-table row, absolute
position p). The row reduces over KV tiles aligned to absolute positions, tile t covering
positions [t*TILE, (t+1)*TILE), strictly in increasing t with an online softmax, masking
positions > p; no split-KV. One program per (row, kv head) takes the g query heads of that
kv head together.

Invariant (tested bitwise): a row's output is a function of its q, the cached K/V at
positions 0..p, p and the kernel's compile-time constants (TILE, head sizes, dtype,
num_warps) alone -- not of the other rows, the row's index in the pass, how the sequence
was chunked, or anything cached beyond p. The pass must have written its own K/V to the
cache before this kernel runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from detserve.kernels._tiles import attend_tile
from detserve.kernels._utils import (
    LOG2E,
    default_scale,
    dot_precision,
    expect,
    expect_block_tables,
    expect_int_vector,
    expect_paged_cache,
    gather_kv,
    next_pow2,
)
from detserve.kernels.config import TABLE, LaneConfig


@triton.jit
def _lane_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, row_seq_ptr, row_pos_ptr, out_ptr,
    qk_scale,
    stride_qm, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_om, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    pos = tl.load(row_pos_ptr + row)
    seq = tl.load(row_seq_ptr + row).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    io_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + row * stride_qm + heads[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt
    # Padding rows (pos < 0) see no tile and produce zeros.
    visible = tl.maximum(pos + 1, 0)  # positions 0..pos
    full_end = visible // TILE * TILE
    for s in range(0, full_end, TILE):  # whole tiles, t = 0, 1, ... in order
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, s, visible, offs_g, bt_row, k_cache_ptr, v_cache_ptr, kvh, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            PAGE, TILE, False, False, HEAD_DIM != BLOCK_D, PRECISION)
    for s in range(full_end, visible, TILE):  # the tile holding p, cut at p
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, s, visible, offs_g, bt_row, k_cache_ptr, v_cache_ptr, kvh, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            PAGE, TILE, True, False, HEAD_DIM != BLOCK_D, PRECISION)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + row * stride_om + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


def lane_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    row_seq: Tensor,
    row_pos: Tensor,
    *,
    scale: float | None = None,
    out: Tensor | None = None,
    cfg: LaneConfig = TABLE.lane,
) -> Tensor:
    """Position-aligned, split-free attention for the M rows of a lane pass.

    q: [M, H, D]; row_seq int32 [M]: row of ``block_tables`` of each row's sequence;
    row_pos int32 [M]: absolute position p of each row (p < 0: padding row, output zeros).
    The cache must hold the sequence's K/V for positions 0..p (the row's own included) and
    its block-table row must cover them. Returns ``out`` [M, H, D] in q's dtype. Needs no
    host sync (CUDA-graph safe); does not modify the cache.
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
    group = h // hkv
    _lane_kernel[(m, hkv)](
        q, k_cache, v_cache, block_tables, row_seq, row_pos, out,
        default_scale(d, scale) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, next_pow2(group)),
        HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)),
        PAGE=page, TILE=cfg.tile, PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
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
