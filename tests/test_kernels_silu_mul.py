"""Fused SiLU-and-multiply against torch's two-kernel form.

CPU: the non-GPU tests run in a TRITON_INTERPRET=1 subprocess (test_interpreter_suite);
the interpreter's exp is not CUDA's, so there the kernel is checked for closeness, in fp32
and fp16 (and for writing exactly the rows and columns it owns). GPU: bitwise equal to torch, bf16 and
fp32, at the 8B model's width, and the same bits for a row whatever the batch.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import kernel_helpers as kt  # noqa: E402
from kernel_suite import interp, interpreter_suite, needs_cuda  # noqa: E402

from detserve.kernels.silu_mul import silu_mul_fused, silu_mul_ref  # noqa: E402

test_interpreter_suite = interpreter_suite(__file__)


def gate_up(n: int, d: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    # gates from -12 to 12, where exp(-x) spans many binades, plus exact zeros
    x = kt.randn(n, 2 * d, dtype=torch.float32, device="cpu", seed=seed) * 4
    x[:, :3] = 0.0
    return x.to(device=device, dtype=dtype)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,d", [(1, 7), (5, 300), (3, 1024), (2, 1500)])
def test_close_to_torch_interp(n: int, d: int, dtype: torch.dtype) -> None:
    # (no bf16 here: the interpreter rounds fp32 to bf16 toward zero, a GPU to nearest)
    x = gate_up(n, d, dtype, "cpu")
    got = silu_mul_fused(x)
    ref = silu_mul_ref(x)
    assert got.shape == (n, d) and got.dtype == dtype
    # the interpreter's exp is numpy's, torch's on CPU another: an ulp or two apart
    tol = 2e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@interp
def test_writes_into_a_given_buffer_and_nothing_else_interp() -> None:
    x = gate_up(4, 200, torch.float32, "cpu", seed=1)
    buf = torch.full((6, 200), 7.0)  # a padded buffer: rows 4 and 5 must stay as they are
    got = silu_mul_fused(x, out=buf[:4])
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf[:4], silu_mul_ref(x), rtol=1e-6, atol=1e-6)
    assert torch.equal(buf[4:], torch.full((2, 200), 7.0))


@interp
def test_rejects_bad_arguments_interp() -> None:
    x = gate_up(2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"\[n, 2d\]"):
        silu_mul_fused(x[:, :15])
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul_fused(x.t().contiguous().t())
    with pytest.raises(ValueError, match="out must be"):
        silu_mul_fused(x, out=torch.empty(2, 9))
    assert silu_mul_fused(x[:0]).shape == (0, 8)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bitwise_equal_to_torch_gpu(dtype: torch.dtype) -> None:
    # the 8B model's MLP width, decode- and prefill-sized batches
    for n in (1, 64, 128, 517):
        x = gate_up(n, 14336, dtype, "cuda", seed=n)
        ref = silu_mul_ref(x)
        assert kt.bitwise_equal(silu_mul_fused(x), ref), (n, dtype)
        out = torch.empty(n + 3, 14336, dtype=dtype, device="cuda")
        assert kt.bitwise_equal(silu_mul_fused(x, out=out[:n]), ref)


@pytest.mark.gpu
@needs_cuda
def test_a_row_keeps_its_bits_in_any_batch_gpu() -> None:
    x = gate_up(64, 14336, torch.bfloat16, "cuda", seed=3)
    whole = silu_mul_fused(x)
    for rows in (slice(0, 1), slice(5, 37), slice(63, 64)):
        assert kt.bitwise_equal(silu_mul_fused(x[rows]), whole[rows])
