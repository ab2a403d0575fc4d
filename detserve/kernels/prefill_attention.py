"""Paged prefill/extend attention for ordinary chunked prefill (fast path).

A varlen batch of query chunks: sequence b owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
and row i sits at absolute position ``context_lens[b] - q_len + i``. Its K/V (new tokens
included) are already in the paged cache; attention is causal over the cache. One program per
(query head, block of ``block_m`` rows, sequence).

Speed only: the tiles a row sees depend on where its chunk starts, so committed results come
from ``lane_attention`` instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from detserve.kernels._tiles import attend_tile
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
    paged_strides,
)
from detserve.kernels.config import TABLE, PrefillConfig


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, out_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    h = tl.program_id(0)
    mblk = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    if mblk * BLOCK_M >= q_len:
        return
    ctx = tl.load(context_lens_ptr + b)
    kvh = h // GROUP

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    pos = ctx - q_len + offs_m
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    first = ctx - q_len + mblk * BLOCK_M  # position of the block's first row
    last = tl.minimum(first + BLOCK_M - 1, ctx - 1)  # of its last valid row
    # Tiles wholly at or before `first` are visible to every row: no causal mask needed.
    full_end = (first + 1) // BLOCK_N * BLOCK_N
    for s in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, s, last + 1, pos, bt_row, k_cache_ptr, v_cache_ptr, kvh, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            PAGE, BLOCK_N, False, False, HEAD_DIM != BLOCK_D, PRECISION)
    for s in range(full_end, last + 1, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, s, last + 1, pos, bt_row, k_cache_ptr, v_cache_ptr, kvh, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            PAGE, BLOCK_N, True, True, HEAD_DIM != BLOCK_D, PRECISION)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    cu_seqlens_q: Tensor,
    context_lens: Tensor,
    *,
    max_q_len: int | None = None,
    scale: float | None = None,
    out: Tensor | None = None,
    cfg: PrefillConfig = TABLE.prefill,
) -> Tensor:
    """Causal attention of varlen query chunks over their paged KV.

    q: [T, H, D] (T = cu_seqlens_q[-1]); cu_seqlens_q int32 [B+1] starting at 0; context_lens
    int32 [B] = cached tokens of each sequence *including* this chunk (so q_len <= context_len);
    block_tables int32 [>=B, max_blocks]. ``max_q_len`` sizes the grid; read from
    cu_seqlens_q (a device sync) when not given. Returns ``out`` [T, H, D] in q's dtype.
    Does not modify the cache.
    """
    _, page, hkv, d = expect_paged_cache(k_cache, v_cache)
    expect(q.dim() == 3 and q.shape[2] == d, f"q must be [T, H, {d}], got {tuple(q.shape)}")
    expect(q.dtype == k_cache.dtype, f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    expect(q.stride(2) == 1, "q needs contiguous head_dim")
    h = q.shape[1]
    expect(h % hkv == 0, f"{h} query heads not a multiple of {hkv} kv heads")
    expect_int_vector(cu_seqlens_q, "cu_seqlens_q")
    expect(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must be int32")
    bsz = cu_seqlens_q.shape[0] - 1
    expect(bsz >= 0, "cu_seqlens_q needs at least one entry")
    expect_int_vector(context_lens, "context_lens", bsz)
    expect(context_lens.dtype == torch.int32, "context_lens must be int32")
    expect_block_tables(block_tables, q.device)
    expect(block_tables.shape[0] >= bsz, "block_tables has fewer rows than sequences")
    if out is None:
        out = torch.empty_like(q)
    expect(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "bad out")
    if bsz == 0 or q.shape[0] == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    if max_q_len == 0:
        return out
    grid = (h, cdiv(max_q_len, cfg.block_m), bsz)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        default_scale(d, scale) * LOG2E,
        *paged_strides(q, k_cache, v_cache, block_tables, out),
        GROUP=h // hkv, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), PAGE=page,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def prefill_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                          cu_seqlens_q: Tensor, context_lens: Tensor, *,
                          scale: float | None = None) -> Tensor:
    """Plain-torch reference (fp32 math)."""
    h, d = q.shape[1], q.shape[2]
    g = h // k_cache.shape[2]
    s = default_scale(d, scale)
    out = torch.zeros_like(q)
    for b in range(cu_seqlens_q.shape[0] - 1):
        lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ctx = int(context_lens[b])
        if hi == lo:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], ctx)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        pos = torch.arange(ctx - (hi - lo), ctx, device=q.device)
        scores = torch.einsum("qhd,nhd->hqn", q[lo:hi].float(), k) * s
        visible = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[lo:hi] = torch.einsum("hqn,nhd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out
