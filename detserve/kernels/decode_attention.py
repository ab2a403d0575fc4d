"""Paged decode attention for the fast path: one query token per sequence, split-KV.

Flash-decoding: each sequence's context is cut into ``num_splits`` equal chunks (rounded up
to whole ``block_n`` steps); one program per (sequence, kv head, split) attends the ``g``
query heads of its kv head over its chunk, and a second kernel merges the partial results
by their log-sum-exp. With one split the first kernel writes the output directly.

Not batch-invariant by design (the split size follows the context length and the batch):
committed results come from ``lane_attention`` instead.
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
    num_sms,
    paged_strides,
)
from detserve.kernels.config import TABLE, DecodeConfig


@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, mid_o_ptr, mid_lse_ptr,
    qk_scale, num_splits,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ob, stride_oh,
    stride_mb, stride_mh, stride_ms,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    ctx = tl.load(context_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for s in range(start, full_end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, s, end, offs_g, bt_row, k_cache_ptr, v_cache_ptr, kvh, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            PAGE, BLOCK_N, False, False, HEAD_DIM != BLOCK_D, PRECISION)
    for s in range(full_end, end, BLOCK_N):  # the ragged last tile, if any
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, s, end, offs_g, bt_row, k_cache_ptr, v_cache_ptr, kvh, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            PAGE, BLOCK_N, True, False, HEAD_DIM != BLOCK_D, PRECISION)

    # Empty splits (and ctx == 0 padding rows) keep l_i == 0: store zeros, lse = -inf.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if DIRECT:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        mid = b.to(tl.int64) * stride_mb + heads[:, None] * stride_mh + split * stride_ms
        tl.store(mid_o_ptr + mid + offs_d[None, :], o, mask=g_mask[:, None] & d_mask[None, :])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(mid_lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse,
                 mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, num_splits,
    stride_mb, stride_mh, stride_ms,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))
    lse_max = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - lse_max), 0.0)
    o = tl.load(mid_o_ptr + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms
                + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    den = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, sms: int,
                      cfg: DecodeConfig = TABLE.decode) -> int:
    """Fewest splits that fill the GPU, never below ``min_tokens_per_split`` tokens a split."""
    by_length = max(1, cdiv(max_context_len, cfg.min_tokens_per_split))
    by_occupancy = max(1, cdiv(cfg.programs_per_sm * sms, max(1, batch * num_kv_heads)))
    return max(1, min(cfg.max_splits, by_length, by_occupancy))


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    *,
    scale: float | None = None,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    out: Tensor | None = None,
    cfg: DecodeConfig = TABLE.decode,
) -> Tensor:
    """Attention of one new token per sequence over its paged KV (the token's own K/V included).

    q: [B, H, D]; caches [num_blocks, block_size, Hkv, D] of q's dtype; block_tables int32
    [>=B, max_blocks]; context_lens int32 [B] (0 allowed: padding row, output zeros).
    ``num_splits`` fixes the split count (e.g. per CUDA graph); else it is chosen from
    ``max_context_len``, which is read from ``context_lens`` (a device sync) when not given.
    Returns ``out`` [B, H, D] in q's dtype. Does not modify the cache.
    """
    _, page, hkv, d = expect_paged_cache(k_cache, v_cache)
    expect(q.dim() == 3 and q.shape[2] == d, f"q must be [B, H, {d}], got {tuple(q.shape)}")
    expect(q.dtype == k_cache.dtype, f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    expect(q.stride(2) == 1, "q needs contiguous head_dim")
    bsz, h, _ = q.shape
    expect(h % hkv == 0, f"{h} query heads not a multiple of {hkv} kv heads")
    expect_block_tables(block_tables, q.device)
    expect(block_tables.shape[0] >= bsz, "block_tables has fewer rows than q")
    expect_int_vector(context_lens, "context_lens", bsz)
    expect(context_lens.dtype == torch.int32, "context_lens must be int32")
    if out is None:
        out = torch.empty_like(q)
    expect(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "bad out")
    if bsz == 0:
        return out
    if num_splits is None:
        if max_context_len is None:
            max_context_len = int(context_lens.max().item())
        num_splits = choose_num_splits(bsz, hkv, max_context_len, num_sms(q.device), cfg)
    expect(num_splits >= 1, "num_splits must be >= 1")

    group = h // hkv
    block_d = max(16, next_pow2(d))
    qk_scale = default_scale(d, scale) * LOG2E
    direct = num_splits == 1
    # Partial results (unused with one split: the first kernel then writes ``out``).
    shape = (bsz, h, num_splits) if not direct else (0, 0, 0)
    mid_o = torch.empty((*shape, d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
    mid_strides = (h * num_splits * d, num_splits * d, d)
    lse_strides = (h * num_splits, num_splits)
    _decode_split_kernel[(bsz, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        out, mid_o, mid_lse,
        qk_scale, num_splits,
        *paged_strides(q, k_cache, v_cache, block_tables, out),
        *mid_strides, *lse_strides,
        GROUP=group, BLOCK_G=max(16, next_pow2(group)),
        HEAD_DIM=d, BLOCK_D=block_d, PAGE=page, BLOCK_N=cfg.block_n,
        DIRECT=direct, PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not direct:
        _decode_reduce_kernel[(bsz, h)](
            mid_o, mid_lse, out, num_splits,
            *mid_strides, *lse_strides,
            out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=next_pow2(num_splits),
            num_warps=cfg.reduce_num_warps,
        )
    return out


def decode_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                         context_lens: Tensor, *, scale: float | None = None) -> Tensor:
    """Plain-torch reference (fp32 math): each sequence attends all its cached tokens."""
    bsz, h, d = q.shape
    hkv = k_cache.shape[2]
    s = default_scale(d, scale)
    out = torch.zeros_like(q)
    for b in range(bsz):
        n = int(context_lens[b])
        if n == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], n)  # [n, Hkv, D] fp32
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * s
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
