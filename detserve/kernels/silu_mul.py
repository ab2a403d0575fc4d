"""Fused SiLU-and-multiply: ``silu(gate) * up`` of ``gate_up = [gate | up]`` in one pass.

The torch form (``detserve.executor.ops.silu_mul``) runs two elementwise kernels over
strided halves of ``gate_up`` (torch's non-vectorized path, since neither half is
contiguous) and writes the SiLU in between. This kernel reads each half once and writes the
product once. Its arithmetic follows torch's step for step: the gate in fp32, ``x / (1 +
exp(-x))`` with an accurate exp and a correctly rounded division, one rounding to the output
dtype, then that value times ``up`` in fp32, one rounding. So on CUDA it is meant to give
torch's bits; `tests/test_kernels_silu_mul.py` checks that on the GPU. Under the Triton
interpreter (CPU tests) the exp is the interpreter's own, so there only closeness is
checked. Elementwise, so a row's bits never depend on the batch around it.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from torch import Tensor

from detserve.executor.ops import silu_mul as silu_mul_ref  # the torch form it follows
from detserve.kernels._utils import cdiv, expect

__all__ = ["silu_mul_fused", "silu_mul_ref"]

try:  # CUDA's expf, the one torch's SiLU calls
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older Triton
    libdevice = None

BLOCK = 1024  # columns a program takes
NUM_WARPS = 4


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, stride_gu, stride_out,
                     BLOCK: tl.constexpr, ACCURATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < n_cols
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=live, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=live, other=0.0)
    if ACCURATE:
        e = libdevice.exp(-gate)
    else:  # the interpreter has no libdevice
        e = tl.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + e).to(out_ptr.dtype.element_ty)
    prod = (silu.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, prod, mask=live)


def silu_mul_fused(gate_up: Tensor, out: Tensor | None = None) -> Tensor:
    """``silu(gate) * up`` for ``gate_up`` [n, 2 * d] (rows contiguous), into ``out`` [n, d]
    if given (its rows contiguous, any row stride)."""
    expect(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0,
           f"gate_up must be [n, 2d], got shape {tuple(gate_up.shape)}")
    expect(gate_up.stride(1) == 1, "gate_up's rows must be contiguous")
    n, d = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = gate_up.new_empty((n, d))
    expect(tuple(out.shape) == (n, d) and out.dtype == gate_up.dtype
           and out.device == gate_up.device,
           f"out must be [{n}, {d}] {gate_up.dtype} on {gate_up.device}")
    expect(out.stride(1) == 1 or d == 1, "out's rows must be contiguous")
    if n == 0 or d == 0:
        return out
    accurate = libdevice is not None and os.environ.get("TRITON_INTERPRET") != "1"
    _silu_mul_kernel[(n, cdiv(d, BLOCK))](
        gate_up, out, d, gate_up.stride(0), out.stride(0),
        BLOCK=BLOCK, ACCURATE=accurate, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out
