"""The fast path's attention over a step whose decode rows lead and prefill rows follow
(the scheduler's layout) reads and writes row slices of q and of the output, with the
per-step kernel inputs built once (``GpuMeta``); its bits equal the gather/scatter path's.

CPU: under TRITON_INTERPRET=1 in a subprocess (test_interpreter_suite). GPU: bf16, marked gpu.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

import kernel_helpers as kt  # noqa: E402

from detserve.executor.attention import RowSegment, build_rows  # noqa: E402
from detserve.executor.gpu import GpuMeta, fast_attention_gpu  # noqa: E402
from detserve.executor.kv_pool import KVPool  # noqa: E402

if kt.INTERPRETED:
    kt.patch_interpreter()

interp = pytest.mark.skipif(not kt.INTERPRETED, reason="runs in test_interpreter_suite's subprocess")
BLOCK = 16


@pytest.mark.skipif(kt.INTERPRETED, reason="this is the parent of the interpreter run")
def test_interpreter_suite() -> None:
    kt.run_in_interpreter(__file__)


def _check(device: str, dtype: torch.dtype, h: int, hkv: int, d: int) -> None:
    contexts = [5, 40, 2100]  # the last one past the lane's first span: two spans, merged
    chunks = [(0, 24), (30, 20)]  # (start, rows): a first chunk and a later one
    segs: list[RowSegment] = []
    used = 0

    def table(n: int) -> tuple[int, ...]:
        nonlocal used
        blocks = -(-n // BLOCK)
        used += blocks
        return tuple(range(1 + used - blocks, 1 + used))  # block 0 is the scratch block

    for c in contexts:
        segs.append(RowSegment((3,), c - 1, table(c)))
    for start, rows in chunks:
        segs.append(RowSegment(tuple(range(3, 3 + rows)), start, table(start + rows)))
    pool = KVPool(1, used + 1, BLOCK, hkv, d, dtype, device)
    pool.data.copy_(kt.randn(*pool.data.shape, dtype=dtype, device=device, seed=1))
    rope = (torch.randn(4096, d // 2, generator=torch.Generator().manual_seed(2)).to(device),
            torch.randn(4096, d // 2, generator=torch.Generator().manual_seed(3)).to(device))
    batch = build_rows(segs, BLOCK, device)
    n = batch.num_rows
    meta = GpuMeta.build(batch)
    assert meta.decode_span == (0, 3) and meta.prefill_span == (3, n)
    qkv = kt.randn(n, (h + 2 * hkv) * d, dtype=dtype, device=device, seed=4)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)  # row-strided views, as the model's
    q, k, v = q.reshape(n, h, d), k.reshape(n, hkv, d), v.reshape(n, hkv, d)
    for aligned in (True, False):
        plain = dataclasses.replace(meta, decode_span=None, prefill_span=None, _decode={},
                                    _prefill=None)
        sliced = fast_attention_gpu(pool, 0, q.clone(), k, v, batch, meta, rope, aligned)
        again = fast_attention_gpu(pool, 0, q.clone(), k, v, batch, meta, rope, aligned)
        gathered = fast_attention_gpu(pool, 0, q.clone(), k, v, batch, plain, rope, aligned)
        assert kt.bitwise_equal(sliced, gathered) and kt.bitwise_equal(sliced, again)
        assert sliced.abs().sum() > 0
        dec = meta.decode_inputs(hkv, torch.device(device), aligned)
        assert dec is meta.decode_inputs(hkv, torch.device(device), aligned), "built once"
        assert dec.num_splits > 1  # split-KV's splits, or the aligned lane kernel's spans


@interp
def test_sliced_rows_equal_gathered_rows_interpreted() -> None:
    _check("cpu", torch.float32, 4, 2, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sliced_rows_equal_gathered_rows_gpu() -> None:
    _check("cuda", torch.bfloat16, 32, 8, 128)
