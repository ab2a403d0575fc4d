"""prefill_attention (varlen chunks, causal over the paged cache) against the torch reference.

CPU: the non-GPU tests run in a TRITON_INTERPRET=1 subprocess (test_interpreter_suite).
GPU: bf16 at model sizes (marked gpu).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import kernel_helpers as kt  # noqa: E402
from kernel_suite import interp, interpreter_suite, needs_cuda  # noqa: E402

from detserve.kernels.config import PrefillConfig  # noqa: E402
from detserve.kernels.prefill_attention import (  # noqa: E402
    prefill_attention,
    prefill_attention_ref,
)

test_interpreter_suite = interpreter_suite(__file__)


def check(device: str, dtype: torch.dtype, h: int, hkv: int, d: int, page: int,
          chunks: list[tuple[int, int]], atol: float, cfg: PrefillConfig | None = None,
          pass_max: bool = True) -> None:
    """chunks: (context_len, q_len) per sequence; the chunk is the last q_len tokens."""
    lens = [c for c, _ in chunks]
    kv = kt.make_paged_kv(lens, hkv, d, page, dtype=dtype, device=device, seed=1)
    q_lens = [n for _, n in chunks]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    q = kt.randn(sum(q_lens), h, d, dtype=dtype, device=device, seed=2)
    out = prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens,
                            max_q_len=max(q_lens) if pass_max else None, cfg=cfg or PrefillConfig())
    ref = prefill_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)


CPU_CHUNKS = [(5, 5), (70, 30), (33, 1), (0, 0), (40, 40), (17, 16)]


@interp
@pytest.mark.parametrize("h,hkv,d,page", [(6, 2, 32, 4), (4, 4, 24, 16), (9, 3, 64, 64)])
def test_matches_reference_interp(h: int, hkv: int, d: int, page: int) -> None:
    check("cpu", torch.float32, h, hkv, d, page, CPU_CHUNKS, 1e-5,
          PrefillConfig(block_m=16, block_n=16))


@interp
def test_default_tiles_and_max_q_len_from_device_interp() -> None:
    check("cpu", torch.float32, 4, 2, 32, 8, CPU_CHUNKS, 1e-5, pass_max=False)


@interp
def test_rejects_bad_arguments() -> None:
    kv = kt.make_paged_kv([8], 2, 16, 8, dtype=torch.float32, device="cpu")
    q = torch.zeros(3, 4, 16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu.long(), kv.context_lens)
    with pytest.raises(ValueError, match="context_lens"):
        prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens[:0])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("h,hkv,d", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("page", [16, 64])
def test_matches_reference_gpu(h: int, hkv: int, d: int, page: int) -> None:
    chunks = [(2048, 2048), (3000, 512), (301, 300), (4097, 1), (1000, 77)]
    check("cuda", torch.bfloat16, h, hkv, d, page, chunks, 2e-2)
