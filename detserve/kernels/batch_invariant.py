"""Batch-invariant kernels for the ``batch_invariant`` mode (the SGLang/vLLM baseline).

- ``matmul_bi``: persistent matmul, one fixed tile config for every M, no split-K: each
  output tile is reduced over K in one program, in order, so a row's result does not
  depend on M or on the other rows.
- ``rmsnorm_bi`` / ``log_softmax_bi``: one row per program, reduced in fixed chunks.
Tile sizes come from ``config.TABLE``; they are part of the determinism profile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from detserve.kernels._utils import cdiv, dot_precision, expect, num_sms
from detserve.kernels.config import TABLE, MatmulConfig, RowConfig


@triton.jit(do_not_specialize=["M", "num_programs"])
def _matmul_persistent_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K, num_programs,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_pid_in_group = GROUP_M * num_pid_n
    offs_k = tl.arange(0, BLOCK_K)
    for tile_id in tl.range(pid, num_tiles, num_programs, flatten=True):
        group_id = tile_id // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + (tile_id % group_size_m)
        pid_n = (tile_id % num_pid_in_group) // group_size_m

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Out-of-range rows/cols read row/col 0 (never stored): no M/N masks in the K loop.
        rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
        cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_left = K - ki * BLOCK_K
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        offs_cm = offs_m.to(tl.int64)
        c_ptrs = c_ptr + offs_cm[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def matmul_config(dtype: torch.dtype) -> MatmulConfig:
    return TABLE.matmul_fp32 if dtype == torch.float32 else TABLE.matmul_bf16


def matmul_bi(x: Tensor, w: Tensor, bias: Tensor | None = None, *,
              out_dtype: torch.dtype | None = None, cfg: MatmulConfig | None = None) -> Tensor:
    """``x @ w.T (+ bias)`` with fp32 accumulation; row results bitwise independent of M.

    x: [M, K]; w: [N, K] (nn.Linear layout) of x's dtype; bias: [N] or None. The output
    ([M, N], ``out_dtype`` or x's dtype) is rounded once, after the bias add. fp32 operands
    use IEEE fp32 dots, never TF32.
    """
    expect(x.dim() == 2 and w.dim() == 2, "matmul_bi takes x [M, K] and w [N, K]")
    expect(x.shape[1] == w.shape[1], f"K mismatch: x {tuple(x.shape)} vs w {tuple(w.shape)}")
    expect(x.dtype == w.dtype, f"x dtype {x.dtype} != w dtype {w.dtype}")
    expect(x.device == w.device, "x and w on different devices")
    if bias is not None:
        expect(bias.shape == (w.shape[0],) and bias.stride(0) == 1, "bias must be contiguous [N]")
    cfg = cfg or matmul_config(x.dtype)
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    num_tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    programs = min(num_sms(x.device), num_tiles)
    _matmul_persistent_kernel[(programs,)](
        x, w, out, bias if bias is not None else out,
        m, n, k, programs,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        PRECISION=dot_precision(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def matmul_bi_ref(x: Tensor, w: Tensor, bias: Tensor | None = None, *,
                  out_dtype: torch.dtype | None = None) -> Tensor:
    y = x.double() @ w.double().T
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype or x.dtype)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, N, eps,
                    d_ptr, sum_ptr, stride_d, stride_s,
                    BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    # HAS_RES: normalise x + d instead of x, rounded to x's dtype as torch's add rounds it,
    # and write that sum to sum_ptr (the residual stream); the norm's arithmetic is the
    # same either way (the sum is recomputed in the second loop, never read back)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    o_row = out_ptr + row * stride_o
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < N
        if HAS_RES:
            x = _residual_sum(x_row, d_ptr + row * stride_d, cols, mask)
            tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
            x = x.to(tl.float32)
        else:
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        acc += x * x
    rstd = tl.rsqrt(tl.sum(acc, 0) / N + eps)
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < N
        if HAS_RES:
            x = _residual_sum(x_row, d_ptr + row * stride_d, cols, mask).to(tl.float32)
        else:
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_row + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _residual_sum(x_row, d_row, cols, mask):
    """x + d in fp32, rounded once to x's dtype (torch's add of two such tensors)."""
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    d = tl.load(d_row + cols, mask=mask, other=0.0)
    return (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)


def _expect_rows(x: Tensor, name: str) -> Tensor:
    expect(x.dim() >= 1, f"{name} needs at least one dimension")
    x2 = x.reshape(-1, x.shape[-1])
    expect(x2.stride(-1) == 1 or x2.shape[-1] <= 1, f"{name} needs a contiguous last dim")
    return x2


def rmsnorm_bi(x: Tensor, weight: Tensor, eps: float, *, out_dtype: torch.dtype | None = None,
               cfg: RowConfig = TABLE.rmsnorm) -> Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` in fp32, rounded once to ``out_dtype``/x's dtype.

    One row per program, sum of squares reduced in ``cfg.block``-column chunks: fixed order.
    x: [..., N]; weight: [N].
    """
    x2 = _expect_rows(x, "x")
    n = x2.shape[1]
    expect(weight.shape == (n,) and weight.stride(0) == 1, f"weight must be contiguous [{n}]")
    out = torch.empty(x2.shape, dtype=out_dtype or x.dtype, device=x.device)
    if x2.shape[0] > 0:
        _rmsnorm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), n, float(eps),
                                        x2, x2, 0, 0, BLOCK=cfg.block, HAS_RES=False,
                                        num_warps=cfg.num_warps)
    return out.reshape(x.shape)


def add_rmsnorm_bi(x: Tensor, delta: Tensor, weight: Tensor, eps: float, *,
                   cfg: RowConfig = TABLE.rmsnorm) -> tuple[Tensor, Tensor]:
    """``(s, rmsnorm_bi(s, weight, eps))`` for ``s = x + delta`` (rounded to x's dtype, as
    torch adds), in one kernel: the residual add before a norm, fused. The norm gives
    ``rmsnorm_bi``'s bits for ``s`` (the same kernel, the same reduction order).
    x, delta: [rows, N], rows contiguous."""
    x2, d2 = _expect_rows(x, "x"), _expect_rows(delta, "delta")
    n = x2.shape[1]
    expect(d2.shape == x2.shape and delta.dtype == x.dtype and delta.device == x.device,
           f"delta must match x: {tuple(x.shape)} {x.dtype}")
    expect(weight.shape == (n,) and weight.stride(0) == 1, f"weight must be contiguous [{n}]")
    total = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        _rmsnorm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), n, float(eps),
                                        d2, total, d2.stride(0), total.stride(0),
                                        BLOCK=cfg.block, HAS_RES=True, num_warps=cfg.num_warps)
    return total.reshape(x.shape), out.reshape(x.shape)


def rmsnorm_ref(x: Tensor, weight: Tensor, eps: float, *,
                out_dtype: torch.dtype | None = None) -> Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(out_dtype or x.dtype)


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    o_row = out_ptr + row * stride_o
    # Per-lane running max and sum, merged once at the end: a fixed order for any batch.
    m_vec = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s_vec = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_vec, x)
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # all -inf so far: sum stays 0
        s_vec = s_vec * tl.exp(m_vec - m_ref) + tl.exp(x - m_ref)
        m_vec = m_new
    m = tl.max(m_vec, 0)
    s = tl.sum(s_vec * tl.exp(m_vec - m), 0)
    lse = m + tl.log(s)
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_row + cols, x - lse, mask=mask)


def log_softmax_bi(x: Tensor, *, cfg: RowConfig = TABLE.log_softmax) -> Tensor:
    """fp32 ``log_softmax`` over the last dim, one row per program. x: [..., N] any float."""
    x2 = _expect_rows(x, "x")
    out = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if x2.shape[0] > 0 and x2.shape[1] > 0:
        _log_softmax_kernel[(x2.shape[0],)](x2, out, x2.stride(0), out.stride(0), x2.shape[1],
                                            BLOCK=cfg.block, num_warps=cfg.num_warps)
    return out.reshape(x.shape)


def log_softmax_ref(x: Tensor) -> Tensor:
    return torch.log_softmax(x.float(), dim=-1)
