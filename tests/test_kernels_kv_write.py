"""Fused RoPE + paged K/V write: bitwise equal to the model's unfused torch arithmetic.

CPU: the non-GPU tests run in a TRITON_INTERPRET=1 subprocess (test_interpreter_suite).
GPU: bf16 at model sizes (marked gpu).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import kernel_helpers as kt  # noqa: E402
from kernel_suite import interp, interpreter_suite, needs_cuda  # noqa: E402

from detserve.kernels.kv_write import (  # noqa: E402
    kv_write,
    kv_write_ref,
    rope_kv_write,
    rope_kv_write_ref,
)

test_interpreter_suite = interpreter_suite(__file__)


def rope_tables(max_pos: int, d: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    return freqs.cos().float().to(device), freqs.sin().float().to(device)


def check(device: str, dtype: torch.dtype, n: int, h: int, hkv: int, d: int, page: int,
          num_blocks: int, inplace: bool, cache_dtype: torch.dtype | None = None) -> None:
    cache_dtype = cache_dtype or dtype
    g = torch.Generator().manual_seed(0)
    q = kt.randn(n, h, d, dtype=dtype, device=device, seed=1)
    k = kt.randn(n, hkv, d, dtype=dtype, device=device, seed=2)
    v = kt.randn(n, hkv, d, dtype=dtype, device=device, seed=3)
    cos, sin = rope_tables(4096, d, device)
    pos = torch.randint(0, 4096, (n,), generator=g).to(device)
    slots = torch.randperm(num_blocks * page, generator=g)[:n]
    slots[::5] = -1  # padding rows: not written
    slots = slots.to(device)
    kc = kt.randn(num_blocks, page, hkv, d, dtype=cache_dtype, device=device, seed=4)
    vc = kt.randn(num_blocks, page, hkv, d, dtype=cache_dtype, device=device, seed=5)
    kc_ref, vc_ref, q_in = kc.clone(), vc.clone(), q.clone()
    q_ref = rope_kv_write_ref(q, k, v, pos, cos, sin, kc_ref, vc_ref, slots)
    q_rot = rope_kv_write(q, k, v, pos.to(torch.int32), cos, sin, kc, vc, slots, inplace=inplace)
    assert (q_rot.data_ptr() == q.data_ptr()) == inplace
    assert inplace or kt.bitwise_equal(q, q_in)
    assert kt.bitwise_equal(q_rot, q_ref)
    assert kt.bitwise_equal(kc, kc_ref) and kt.bitwise_equal(vc, vc_ref)

    kc2, vc2 = kc.clone(), vc.clone()
    kv_write(k, v, kc, vc, slots.to(torch.int32))
    kv_write_ref(k, v, kc2, vc2, slots)
    assert kt.bitwise_equal(kc, kc2) and kt.bitwise_equal(vc, vc2)


@interp
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("h,hkv,d,page", [(6, 2, 32, 4), (9, 3, 64, 16), (4, 4, 24, 8), (2, 1, 16, 4)])
def test_matches_reference_interp(h: int, hkv: int, d: int, page: int, inplace: bool) -> None:
    check("cpu", torch.float32, 11, h, hkv, d, page, 8, inplace)


@interp
def test_rejects_bad_arguments() -> None:
    kc = torch.zeros(4, 4, 2, 16)
    k = torch.zeros(3, 2, 16)
    slots = torch.zeros(3, dtype=torch.int32)
    cos = torch.zeros(8, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_write(k, k, kc, kc.clone(), slots[:2])
    with pytest.raises(ValueError, match="cos"):
        rope_kv_write(torch.zeros(3, 4, 16), k, k, slots, cos.double(), cos, kc, kc.clone(), slots)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("h,hkv,d", [(32, 8, 128), (9, 3, 64)])
def test_matches_reference_gpu(h: int, hkv: int, d: int, inplace: bool) -> None:
    check("cuda", torch.bfloat16, 3000, h, hkv, d, 16, 1024, inplace)
    check("cuda", torch.float32, 300, h, hkv, d, 16, 64, inplace)
