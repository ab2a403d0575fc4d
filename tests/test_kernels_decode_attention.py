"""decode_attention (split-KV, paged, GQA) against the torch reference.

CPU: the non-GPU tests run in a TRITON_INTERPRET=1 subprocess (test_interpreter_suite).
GPU: bf16 at model sizes (marked gpu).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import kernel_helpers as kt  # noqa: E402
from kernel_suite import interp, interpreter_suite, needs_cuda  # noqa: E402

from detserve.kernels.config import DecodeConfig  # noqa: E402
from detserve.kernels.decode_attention import (  # noqa: E402
    choose_num_splits,
    decode_attention,
    decode_attention_ref,
)

test_interpreter_suite = interpreter_suite(__file__)


def check(device: str, dtype: torch.dtype, h: int, hkv: int, d: int, page: int,
          lens: list[int], num_splits: int | None, atol: float,
          cfg: DecodeConfig | None = None) -> None:
    kv = kt.make_paged_kv(lens, hkv, d, page, dtype=dtype, device=device, seed=1)
    q = kt.randn(len(lens), h, d, dtype=dtype, device=device, seed=2)
    out = decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens,
                           num_splits=num_splits, cfg=cfg or DecodeConfig())
    ref = decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)


def test_choose_num_splits() -> None:
    cfg = DecodeConfig(min_tokens_per_split=256, max_splits=16, programs_per_sm=2)
    assert choose_num_splits(1, 8, 100, 132, cfg) == 1  # short: no split
    assert choose_num_splits(1, 8, 4096, 132, cfg) == 16  # long, lone sequence: many
    assert choose_num_splits(64, 8, 4096, 132, cfg) == 1  # the batch fills the GPU
    assert choose_num_splits(8, 8, 1 << 20, 132, cfg) == 5
    assert choose_num_splits(0, 8, 0, 132, cfg) == 1


@interp
@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
@pytest.mark.parametrize("h,hkv,d,page", [(6, 2, 32, 4), (4, 4, 24, 16), (9, 3, 64, 64)])
def test_matches_reference_interp(h: int, hkv: int, d: int, page: int,
                                  num_splits: int | None) -> None:
    lens = [1, 100, 0, 64, 37]  # 0: a padding row -> zeros
    check("cpu", torch.float32, h, hkv, d, page, lens, num_splits, 1e-5,
          DecodeConfig(block_n=16, min_tokens_per_split=16))


@interp
def test_rejects_bad_arguments() -> None:
    kv = kt.make_paged_kv([8, 3], 2, 16, 8, dtype=torch.float32, device="cpu")
    q = torch.zeros(2, 4, 16)
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(q.double(), kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(torch.zeros(2, 3, 16), kv.k_cache, kv.v_cache, kv.block_tables,
                         kv.context_lens)
    with pytest.raises(ValueError, match="int32"):
        decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables.long(), kv.context_lens)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("h,hkv,d", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("lens", [[8191], [1, 17, 300, 4096, 2048, 5, 1000, 0], [513] * 64])
def test_matches_reference_gpu(h: int, hkv: int, d: int, lens: list[int],
                               num_splits: int | None) -> None:
    check("cuda", torch.bfloat16, h, hkv, d, 16, lens, num_splits, 2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("spans", [4, 9])
def test_aligned_fast_decode_gives_every_row_the_lane_bits(spans: int) -> None:
    """The aligned fast path: every row, long contexts included, gets the lane kernel's
    exact bits (what the lane recomputes) whatever the spans launched; padding rows 0."""
    from detserve.executor.gpu import fast_decode_attention
    from detserve.kernels.config import TABLE
    from detserve.kernels.lane_attention import lane_attention

    span = TABLE.lane.span
    lens = [1, 300, span, span + 700, 0, 64, span + 1, 3 * span + 5]
    h, hkv, d = 32, 8, 128
    kv = kt.make_paged_kv(lens, hkv, d, 16, dtype=torch.bfloat16, device="cuda", seed=3)
    q = kt.randn(len(lens), h, d, dtype=torch.bfloat16, device="cuda", seed=4)
    rows = torch.arange(len(lens), dtype=torch.int32, device="cuda")
    pos = kv.context_lens - 1  # -1 for the padding row
    out = fast_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens,
                                rows, pos, spans, aligned=True)
    lane = lane_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, rows, pos)
    assert torch.equal(out, lane)
    assert not out[4].any()
    ref = decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
