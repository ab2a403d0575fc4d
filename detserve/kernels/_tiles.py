"""The online-softmax step over one tile of paged KV, shared by the fast-path attention kernels
(decode and prefill). The lane has its own step (``lane_attention._lane_tile``), so that
speed work here cannot move the lane's bits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(
    q, m_i, l_i, acc,
    start, limit, pos,
    bt_row, k_cache_ptr, v_cache_ptr, kv_head, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    offs_d, d_mask,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_N: tl.constexpr, CAUSAL: tl.constexpr, MASK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Fold KV positions [start, start + BLOCK_N) into the running (m_i, l_i, acc).

    q: [R, BLOCK_D] rows (scores are scaled by qk_scale and taken base 2); MASK_N drops
    positions >= limit (without it every position must be valid: nothing is masked, not
    even the block-table read); CAUSAL drops, per row r, positions > pos[r]; MASK_D pads
    head_dim up to BLOCK_D. Masked K/V are never read, so stale or NaN cache slots beyond
    the visible range cannot leak in. At least one position of the tile must be visible to
    every row, which keeps m_i finite.
    """
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASK_N:
        n_mask = offs_n < limit
        blk = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
    in_page = offs_n % PAGE
    k_ptrs = k_cache_ptr + (blk * stride_kb + in_page * stride_ks + kv_head * stride_kh)[:, None] \
        + offs_d[None, :]
    v_ptrs = v_cache_ptr + (blk * stride_vb + in_page * stride_vs + kv_head * stride_vh)[:, None] \
        + offs_d[None, :]
    if MASK_N:
        if MASK_D:
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:
            kv_mask = n_mask[:, None]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    else:
        if MASK_D:
            k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)

    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASK_N:
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
    if CAUSAL:
        qk = tl.where(offs_n[None, :] <= pos[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    if MASK_N:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        if MASK_D:
            v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc
