"""Small helpers shared by the kernel launchers (argument checks, sizes, device facts)."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

LOG2E = 1.4426950408889634

# Programs a launcher assumes when there is no CUDA device (TRITON_INTERPRET=1 on a CPU):
# small, so that persistent loops and KV splits are exercised at test sizes.
INTERPRETER_SMS = 4


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expect(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless cond: launchers reject bad arguments before launching."""
    if not cond:
        raise ValueError(msg)


def expect_int_vector(t: Tensor, name: str, n: int | None = None) -> None:
    expect(t.dim() == 1, f"{name} must be 1-D, got shape {tuple(t.shape)}")
    expect(t.dtype in (torch.int32, torch.int64), f"{name} must be int32/int64, got {t.dtype}")
    expect(t.stride(0) == 1 or t.numel() <= 1, f"{name} must be contiguous")
    if n is not None:
        expect(t.shape[0] == n, f"{name} has {t.shape[0]} entries, expected {n}")


def expect_paged_cache(k_cache: Tensor, v_cache: Tensor) -> tuple[int, int, int, int]:
    """Check the cache contract; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    expect(k_cache.dim() == 4, f"k_cache must be [num_blocks, block_size, kv_heads, head_dim], "
                               f"got shape {tuple(k_cache.shape)}")
    expect(k_cache.shape == v_cache.shape, "k_cache and v_cache shapes differ")
    expect(k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ")
    expect(k_cache.device == v_cache.device, "k_cache and v_cache devices differ")
    expect(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches need contiguous head_dim")
    return tuple(k_cache.shape)  # type: ignore[return-value]


def expect_block_tables(block_tables: Tensor, device: torch.device) -> None:
    expect(block_tables.dim() == 2, "block_tables must be [num_seqs, max_blocks_per_seq]")
    expect(block_tables.dtype == torch.int32, f"block_tables must be int32, got {block_tables.dtype}")
    expect(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
    expect(block_tables.device == device, "block_tables must be on the cache's device")


def paged_strides(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                  out: Tensor) -> tuple[int, ...]:
    """The strides the paged attention kernels take, in their order: q's row and head, the
    caches' block, slot and head, the block tables' row, the output's row and head."""
    return (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            out.stride(0), out.stride(1))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands get IEEE dots (TF32 would round them); 16-bit ones ignore this."""
    return "ieee" if dtype == torch.float32 else "tf32"


def default_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def gather_kv(k_cache: Tensor, v_cache: Tensor, table_row: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Reference helper: the first n cached tokens of one sequence as fp32 [n, Hkv, D] pairs."""
    page = k_cache.shape[1]
    pos = torch.arange(n, device=k_cache.device)
    blocks = table_row.long()[pos // page]
    return k_cache[blocks, pos % page].float(), v_cache[blocks, pos % page].float()
