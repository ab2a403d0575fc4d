"""Batch-invariant matmul / RMSNorm / log_softmax: match references, rows independent of M.

CPU: the non-GPU tests run in a TRITON_INTERPRET=1 subprocess (test_interpreter_suite).
GPU: bf16 at Llama-3.1-8B sizes (marked gpu).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import kernel_helpers as kt  # noqa: E402
from kernel_suite import interp, interpreter_suite, needs_cuda  # noqa: E402

from detserve.kernels.batch_invariant import (  # noqa: E402
    add_rmsnorm_bi,
    log_softmax_bi,
    log_softmax_ref,
    matmul_bi,
    matmul_bi_ref,
    rmsnorm_bi,
    rmsnorm_ref,
)
from detserve.kernels.config import MatmulConfig, RowConfig  # noqa: E402

test_interpreter_suite = interpreter_suite(__file__)


def check_matmul(device: str, dtype: torch.dtype, n: int, k: int, ms: list[int], *,
                 bias: bool, atol: float, cfg: MatmulConfig | None = None,
                 out_dtype: torch.dtype | None = None) -> None:
    """Rows of x[:m] @ w.T equal rows of the full product, bitwise, for each m in ms.

    Then every row is moved to another index (another place in its tile).
    """
    x = kt.randn(max(ms), k, dtype=dtype, device=device, seed=1)
    w = kt.randn(n, k, dtype=dtype, device=device, seed=2, scale=k ** -0.5)
    b = kt.randn(n, dtype=dtype, device=device, seed=3) if bias else None
    full = matmul_bi(x, w, b, cfg=cfg, out_dtype=out_dtype)
    ref = matmul_bi_ref(x, w, b, out_dtype=out_dtype)
    torch.testing.assert_close(full.float(), ref.float(), atol=atol, rtol=atol)
    for m in ms:
        got = matmul_bi(x[:m].clone(), w, b, cfg=cfg, out_dtype=out_dtype)
        assert kt.bitwise_equal(got, full[:m]), f"rows changed at M={m}"
    tail = matmul_bi(x[max(ms) // 2:].clone(), w, b, cfg=cfg, out_dtype=out_dtype)
    assert kt.bitwise_equal(tail, full[max(ms) // 2:]), "rows changed with their index"


def check_rows(device: str, dtype: torch.dtype, rows: int, n: int, atol: float,
               norm_cfg: RowConfig, lsm_cfg: RowConfig) -> None:
    x = kt.randn(rows, n, dtype=dtype, device=device, seed=4, scale=3.0)
    w = kt.randn(n, dtype=dtype, device=device, seed=5)
    y = rmsnorm_bi(x, w, 1e-5, cfg=norm_cfg)
    torch.testing.assert_close(y.float(), rmsnorm_ref(x, w, 1e-5).float(), atol=atol, rtol=atol)
    z = log_softmax_bi(x, cfg=lsm_cfg)
    torch.testing.assert_close(z, log_softmax_ref(x), atol=atol, rtol=atol)
    for m in (1, 3, rows // 2):
        sl = slice(rows - m, rows)
        assert kt.bitwise_equal(rmsnorm_bi(x[sl].clone(), w, 1e-5, cfg=norm_cfg), y[sl])
        assert kt.bitwise_equal(log_softmax_bi(x[sl].clone(), cfg=lsm_cfg), z[sl])


def check_add_rmsnorm(device: str, dtype: torch.dtype, rows: int, n: int, cfg: RowConfig) -> None:
    """The fused residual add and norm: the sum as torch adds, the norm rmsnorm_bi's bits of
    that sum, bit for bit."""
    x = kt.randn(rows, n, dtype=dtype, device=device, seed=6, scale=3.0)
    d = kt.randn(rows, n, dtype=dtype, device=device, seed=7)
    w = kt.randn(n, dtype=dtype, device=device, seed=8)
    total, y = add_rmsnorm_bi(x, d, w, 1e-5, cfg=cfg)
    assert kt.bitwise_equal(total, x + d)
    assert kt.bitwise_equal(y, rmsnorm_bi(x + d, w, 1e-5, cfg=cfg))
    assert total.data_ptr() != x.data_ptr()  # x stays as it was (graphs may reuse it)


SMALL_MM = MatmulConfig(block_m=32, block_n=32, block_k=16, group_m=2, num_warps=4)


@interp
@pytest.mark.parametrize("k", [64, 80])
@pytest.mark.parametrize("cfg", [None, SMALL_MM], ids=["table", "small"])
def test_matmul_interp(k: int, cfg: MatmulConfig | None) -> None:
    check_matmul("cpu", torch.float32, 200, k, [1, 2, 3, 17, 33, 70], bias=k == 80, atol=1e-5,
                 cfg=cfg)


@interp
def test_matmul_out_dtype_and_empty_interp() -> None:
    check_matmul("cpu", torch.float32, 48, 32, [1, 5], bias=True, atol=1e-5,
                 out_dtype=torch.float64)
    assert matmul_bi(torch.zeros(0, 8), torch.zeros(4, 8)).shape == (0, 4)
    b = torch.arange(4.0)
    assert torch.equal(matmul_bi(torch.zeros(2, 0), torch.zeros(4, 0), b), b.expand(2, 4))


@interp
@pytest.mark.parametrize("n", [1000, 64, 5])
def test_rmsnorm_log_softmax_interp(n: int) -> None:
    check_rows("cpu", torch.float32, 9, n, 1e-5, RowConfig(block=256), RowConfig(block=128))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # (interpreter: no bf16)
@pytest.mark.parametrize("n", [1000, 64, 5])
def test_add_rmsnorm_interp(n: int, dtype: torch.dtype) -> None:
    check_add_rmsnorm("cpu", dtype, 9, n, RowConfig(block=256))


@interp
def test_log_softmax_handles_infinities_interp() -> None:
    x = torch.full((3, 300), float("-inf"))
    x[0, 7] = 2.0
    x[1] = torch.randn(300)
    x[1, ::3] = float("-inf")
    got = log_softmax_bi(x, cfg=RowConfig(block=64))
    torch.testing.assert_close(got[:2], log_softmax_ref(x[:2]))
    assert got[2].isnan().all()  # like torch: nothing to normalise


@interp
def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="K mismatch"):
        matmul_bi(torch.zeros(2, 8), torch.zeros(4, 9))
    with pytest.raises(ValueError, match="dtype"):
        matmul_bi(torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="weight"):
        rmsnorm_bi(torch.zeros(2, 8), torch.zeros(9), 1e-5)
    with pytest.raises(ValueError, match="delta must match"):
        add_rmsnorm_bi(torch.zeros(2, 8), torch.zeros(3, 8), torch.zeros(8), 1e-5)


LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
            "down": (4096, 14336)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", list(LLAMA_8B))
def test_matmul_gpu(shape: str) -> None:
    n, k = LLAMA_8B[shape]
    ms = [1, 2, 3, 4, 7, 8, 16, 31, 64, 100, 127, 128, 129, 255, 256, 511, 1024]
    check_matmul("cuda", torch.bfloat16, n, k, ms + [2048], bias=shape == "qkv", atol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_matmul_fp32_gpu() -> None:
    check_matmul("cuda", torch.float32, 1000, 576, [1, 3, 64, 300], bias=True, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_log_softmax_gpu(dtype: torch.dtype) -> None:
    from detserve.kernels.config import TABLE

    check_rows("cuda", dtype, 257, 4096, 2e-2 if dtype == torch.bfloat16 else 1e-5,
               TABLE.rmsnorm, TABLE.log_softmax)
    check_rows("cuda", dtype, 33, 128256, 2e-2 if dtype == torch.bfloat16 else 1e-5,
               TABLE.rmsnorm, TABLE.log_softmax)
    check_add_rmsnorm("cuda", dtype, 257, 4096, TABLE.rmsnorm)
