"""The sampler's noise: uniforms hashed from (seed, position, token id), and the Gumbel
scores of many rows in torch (the form ``kernels.gumbel`` follows). Torch only: the
sampler and the kernel module both import it.

The hash is 32-bit integer arithmetic (murmur3's finalizer) carried in int64, on Python
integers or tensors alike, so a row's values depend on nothing but its key.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor

__all__ = ["fmix32", "gumbel_scores", "hashed_uniform", "key_uniforms", "mul32", "row_key"]

_M32 = 0xFFFFFFFF
_Int = TypeVar("_Int", int, Tensor)  # the hash runs on Python integers and int64 tensors


def mul32(x: _Int, c: int) -> _Int:
    """(x * c) mod 2**32 for x < 2**32 without int64 overflow (c split in 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def fmix32(h: _Int) -> _Int:
    h = h ^ (h >> 16)
    h = mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def row_key(seed: int, position: int) -> int:
    """The per-(seed, position) key, in Python integers (the same 64-bit arithmetic as
    ``key_uniforms``' tensors, without a host-to-device copy that would wait for the
    device)."""
    lo, hi, pos = seed & _M32, (seed >> 32) & _M32, position & _M32
    return fmix32(lo ^ fmix32(hi ^ fmix32(pos + 0x9E3779B9)))


def key_uniforms(key: int | Tensor, vocab: int, device: torch.device | str) -> Tensor:
    """Uniform(0, 1) float64 per token id of one row (``key`` an int: [V]) or of many
    (``key`` an int64 [n, 1] column of row keys: [n, V]). Integer arithmetic and one exact
    conversion per element, so a row's values do not depend on the rows beside it."""
    ids = torch.arange(vocab, dtype=torch.int64, device=device)
    h = fmix32(key ^ mul32(ids, 0x9E3779B1))
    h2 = fmix32(h ^ 0x27D4EB2F)
    bits = (h << 21) | (h2 >> 11)  # 53 random bits
    return (bits.double() + 0.5) / float(1 << 53)


def hashed_uniform(seed: int, position: int, vocab: int, device: torch.device | str = "cpu") -> Tensor:
    """Uniform(0, 1) float64 per token id, a pure function of (seed, position, token id)."""
    return key_uniforms(row_key(seed, position), vocab, device)


def gumbel_scores(logits: Tensor, kth: Tensor, inv_temp: Tensor, keys: Tensor) -> Tensor:
    """The Gumbel scores of ``logits`` [n, V] from ``sampler._gumbel_inputs``' per-row top-k
    threshold, reciprocal temperature and hash key, in torch's kernels: float64 [n, V]
    (the form ``kernels.gumbel`` follows)."""
    rows = logits.float()
    rows = rows.masked_fill(rows < kth[:, None], float("-inf"))
    noise = torch.log(-torch.log(key_uniforms(keys[:, None], logits.shape[1], logits.device)))
    return rows.double() * inv_temp[:, None] - noise
