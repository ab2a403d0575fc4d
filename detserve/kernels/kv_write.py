"""Fused RoPE + paged K/V write.

One program per token: rotates q and k (rotate-half, Hugging Face layout; fp32 cos/sin
tables indexed by absolute position, math in fp32, one rounding to the output dtype) and
writes k and v to the paged cache at ``slot = block_id * block_size + offset``. Slots < 0
are skipped (padding rows). Floating-point contraction is disabled, so the rotation is
bitwise equal to ``detserve.model.llama.apply_rope`` in eager torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from detserve.kernels._utils import expect, expect_int_vector, expect_paged_cache, next_pow2
from detserve.kernels.config import TABLE, KvWriteConfig
from detserve.model.llama import apply_rope


@triton.jit
def _rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    stride_qt, stride_qh, stride_qot, stride_qoh,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cos, stride_sin,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PAGE: tl.constexpr, ROPE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_HALF)
    c_mask = offs_c < HALF
    hk = tl.arange(0, BLOCK_HK)
    k_mask = (hk < NUM_KV_HEADS)[:, None] & c_mask[None, :]

    k_src = k_ptr + t * stride_kt + hk[:, None] * stride_kh + offs_c[None, :]
    v_src = v_ptr + t * stride_vt + hk[:, None] * stride_vh + offs_c[None, :]
    k1 = tl.load(k_src, mask=k_mask, other=0.0)
    k2 = tl.load(k_src + HALF, mask=k_mask, other=0.0)
    if ROPE:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        c = tl.load(cos_ptr + pos * stride_cos + offs_c, mask=c_mask, other=0.0)[None, :]
        s = tl.load(sin_ptr + pos * stride_sin + offs_c, mask=c_mask, other=0.0)[None, :]
        hq = tl.arange(0, BLOCK_HQ)
        q_mask = (hq < NUM_HEADS)[:, None] & c_mask[None, :]
        q_src = q_ptr + t * stride_qt + hq[:, None] * stride_qh + offs_c[None, :]
        q1 = tl.load(q_src, mask=q_mask, other=0.0).to(tl.float32)
        q2 = tl.load(q_src + HALF, mask=q_mask, other=0.0).to(tl.float32)
        out_ty = q_out_ptr.dtype.element_ty
        r1 = (q1 * c - q2 * s).to(out_ty)
        r2 = (q2 * c + q1 * s).to(out_ty)
        # q_out may be q: every thread (replicas included) must have read q before any writes.
        tl.debug_barrier()
        q_dst = q_out_ptr + t * stride_qot + hq[:, None] * stride_qoh + offs_c[None, :]
        tl.store(q_dst, r1, mask=q_mask)
        tl.store(q_dst + HALF, r2, mask=q_mask)
        k1f = k1.to(tl.float32)
        k2f = k2.to(tl.float32)
        # Round to k's dtype first, as the unfused model does, then to the cache's.
        k1 = (k1f * c - k2f * s).to(k_ptr.dtype.element_ty)
        k2 = (k2f * c + k1f * s).to(k_ptr.dtype.element_ty)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    w_mask = k_mask & (slot >= 0)
    blk = slot // PAGE
    in_page = slot % PAGE
    cache_ty = k_cache_ptr.dtype.element_ty
    k_dst = k_cache_ptr + blk * stride_kcb + in_page * stride_kcs + hk[:, None] * stride_kch \
        + offs_c[None, :]
    v_dst = v_cache_ptr + blk * stride_vcb + in_page * stride_vcs + hk[:, None] * stride_vch \
        + offs_c[None, :]
    tl.store(k_dst, k1.to(cache_ty), mask=w_mask)
    tl.store(k_dst + HALF, k2.to(cache_ty), mask=w_mask)
    v1 = tl.load(v_src, mask=k_mask, other=0.0)
    v2 = tl.load(v_src + HALF, mask=k_mask, other=0.0)
    tl.store(v_dst, v1.to(cache_ty), mask=w_mask)
    tl.store(v_dst + HALF, v2.to(cache_ty), mask=w_mask)


def _check(q: Tensor | None, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
           slot_mapping: Tensor) -> tuple[int, int]:
    _, page, hkv, d = expect_paged_cache(k_cache, v_cache)
    n = k.shape[0]
    expect(d % 2 == 0, f"head_dim {d} must be even")
    for t, name in ((k, "k"), (v, "v")):
        expect(t.shape == (n, hkv, d), f"{name} must be [N, {hkv}, {d}], got {tuple(t.shape)}")
        expect(t.stride(2) == 1 and t.device == k_cache.device, f"{name}: contiguous head_dim, cache's device")
    if q is not None:
        expect(q.dim() == 3 and q.shape[0] == n and q.shape[2] == d, f"q must be [N, H, {d}]")
        expect(q.stride(2) == 1, "q needs contiguous head_dim")
    expect_int_vector(slot_mapping, "slot_mapping", n)
    expect(slot_mapping.device == k_cache.device, "slot_mapping must be on the cache's device")
    return page, d


def rope_kv_write(
    q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
    k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, *,
    inplace: bool = True, cfg: KvWriteConfig = TABLE.kv_write,
) -> Tensor:
    """Rotate q and k by RoPE at ``positions`` and write rotated k and v into the cache.

    q: [N, H, D]; k, v: [N, Hkv, D]; positions int32/int64 [N]; cos, sin: fp32
    [max_positions, D/2]; slot_mapping int32/int64 [N] (< 0: skip). Returns rotated q
    (q itself when ``inplace``, else a new tensor). k and v are not modified; the cache
    slots named by ``slot_mapping`` are overwritten.
    """
    page, d = _check(q, k, v, k_cache, v_cache, slot_mapping)
    n = q.shape[0]
    expect_int_vector(positions, "positions", n)
    for t, name in ((cos, "cos"), (sin, "sin")):
        expect(t.dim() == 2 and t.shape[1] == d // 2 and t.stride(1) == 1, f"{name} must be [P, {d // 2}]")
        expect(t.dtype == torch.float32 and t.device == q.device, f"{name} must be fp32 on q's device")
    q_out = q if inplace else torch.empty_like(q)
    if n > 0:
        _launch(q, k, v, q_out, positions, cos, sin, slot_mapping, k_cache, v_cache, page, d,
                True, cfg)
    return q_out


def kv_write(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, *,
             cfg: KvWriteConfig = TABLE.kv_write) -> None:
    """Write already-rotated k and v ([N, Hkv, D]) into the cache slots (< 0: skip)."""
    page, d = _check(None, k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] > 0:
        _launch(k, k, v, k, slot_mapping, k_cache, k_cache, slot_mapping, k_cache, v_cache,
                page, d, False, cfg)


def _launch(q: Tensor, k: Tensor, v: Tensor, q_out: Tensor, positions: Tensor, cos: Tensor,
            sin: Tensor, slot_mapping: Tensor, k_cache: Tensor, v_cache: Tensor, page: int, d: int,
            rope: bool, cfg: KvWriteConfig) -> None:
    h, hkv = q.shape[1], k.shape[1]
    _rope_kv_write_kernel[(k.shape[0],)](
        q, k, v, q_out, positions, cos, sin, slot_mapping, k_cache, v_cache,
        q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=h, NUM_KV_HEADS=hkv, HALF=d // 2,
        BLOCK_HQ=max(2, next_pow2(h)), BLOCK_HK=max(2, next_pow2(hkv)),
        BLOCK_HALF=max(2, next_pow2(d // 2)),
        PAGE=page, ROPE=rope, num_warps=cfg.num_warps, enable_fp_fusion=False,
    )


# The reference is the model's own RoPE: the kernel must match it bit for bit.
apply_rope_ref = apply_rope


def rope_kv_write_ref(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos: Tensor,
                      sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                      slot_mapping: Tensor) -> Tensor:
    """Reference: returns rotated q (new tensor) and writes the caches in place."""
    c, s = cos[positions.long()], sin[positions.long()]
    q_rot, k_rot = apply_rope_ref(q, c, s), apply_rope_ref(k, c, s)
    kv_write_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot


def kv_write_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                 slot_mapping: Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page = k_cache.shape[1]
    k_cache[slots // page, slots % page] = k[keep].to(k_cache.dtype)
    v_cache[slots // page, slots % page] = v[keep].to(v_cache.dtype)
