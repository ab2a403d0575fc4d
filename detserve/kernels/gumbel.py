"""Seeded Gumbel sampling of many rows in one pass: ``argmax(logits * (1 / T) - log(-log(u)))``
with ``u`` the position-hashed uniform of ``detserve.gumbel_noise``.

The torch form (``gumbel_argmax_ref``: ``gumbel_noise.gumbel_scores``) runs about thirty elementwise kernels over
[rows, V] float64 and int64 temporaries: at a 128,256-token vocabulary a few milliseconds of
memory traffic per 128 rows. This kernel reads each logit once, computes its noise in
registers and leaves one (max, index) per block of columns; a last small reduction picks
each row's first maximum. Its arithmetic follows the torch form step for step: the top-k
threshold compared in fp32, the logit widened to float64 and multiplied by the host's
reciprocal of the temperature (how torch's CUDA division by a host scalar computes), the
hash in 32-bit integers (``(x * c) mod 2**32`` is what ``gumbel_noise.mul32`` computes), the
same 53 bits scaled by 2**-53, CUDA's ``log`` twice, and no fused multiply-add. So on CUDA
it is meant to give the torch form's bits; ``tests/test_kernels_gumbel.py`` checks every
score on the GPU. Under the Triton interpreter the logs are numpy's, so there the tokens
are checked. A row's result never depends on the rows beside it: each program sees one
row's columns, and the reductions are exact (a maximum and a minimum index).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from detserve.gumbel_noise import gumbel_scores
from detserve.kernels._utils import cdiv, expect

__all__ = ["gumbel_argmax", "gumbel_argmax_ref"]

try:  # CUDA's log, the one torch's float64 log calls
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older Triton
    libdevice = None

BLOCK = 2048  # columns a program takes
NUM_WARPS = 8


@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _gumbel_kernel(logits_ptr, kth_ptr, inv_ptr, key_ptr, val_ptr, idx_ptr, scores_ptr,
                   vocab, stride_l, stride_s, num_blocks,
                   BLOCK: tl.constexpr, ACCURATE: tl.constexpr, STORE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    live = cols < vocab
    x = tl.load(logits_ptr + row * stride_l + cols, mask=live, other=0.0).to(tl.float32)
    kth = tl.load(kth_ptr + row)
    x = tl.where(x < kth, float("-inf"), x)
    key = tl.load(key_ptr + row).to(tl.uint32)
    h = _fmix32(key ^ (cols.to(tl.uint32) * 0x9E3779B1))
    h2 = _fmix32(h ^ 0x27D4EB2F)
    bits = (h.to(tl.uint64) << 21) | (h2 >> 11).to(tl.uint64)  # 53 random bits
    u = (bits.to(tl.float64) + 0.5) * 1.1102230246251565e-16  # * 2**-53, exact
    if ACCURATE:
        noise = libdevice.log(-libdevice.log(u))
    else:  # the interpreter has no libdevice
        noise = tl.log(-tl.log(u))
    s = x.to(tl.float64) * tl.load(inv_ptr + row) - noise
    if STORE:
        tl.store(scores_ptr + row * stride_s + cols, s, mask=live)
    s = tl.where(live, s, float("-inf"))
    best = tl.max(s, 0)
    first = tl.min(tl.where(live & (s == best), cols, vocab), 0)
    tl.store(val_ptr + row * num_blocks + blk, best)
    tl.store(idx_ptr + row * num_blocks + blk, first)


def gumbel_argmax(logits: Tensor, kth: Tensor, inv_temp: Tensor, keys: Tensor,
                  scores_out: Tensor | None = None) -> Tensor:
    """Tokens (int64 [n]) of seeded Gumbel sampling of ``logits`` [n, V] (any float dtype,
    rows contiguous): per row, logits below ``kth`` (fp32 [n]; -inf: no top-k) are dropped,
    the rest widened to float64 times ``inv_temp`` (float64 [n]), minus ``log(-log(u))`` of
    the hashed uniforms of ``keys`` (int64 [n], ``gumbel_noise.row_key`` values < 2**32); the
    first maximum wins. ``scores_out`` (float64 [n, V], optional): also write every score."""
    expect(logits.dim() == 2 and logits.stride(1) == 1,
           f"logits must be [n, V] with contiguous rows, got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    for name, t, dtype in (("kth", kth, torch.float32), ("inv_temp", inv_temp, torch.float64),
                           ("keys", keys, torch.int64)):
        expect(t.shape == (n,) and t.dtype == dtype and t.device == logits.device,
               f"{name} must be {dtype} [{n}] on {logits.device}")
    if scores_out is not None:
        expect(tuple(scores_out.shape) == (n, vocab) and scores_out.dtype == torch.float64
               and scores_out.stride(1) == 1, f"scores_out must be float64 [{n}, {vocab}]")
    if n == 0:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    nb = cdiv(vocab, BLOCK)
    vals = torch.empty((n, nb), dtype=torch.float64, device=logits.device)
    idxs = torch.empty((n, nb), dtype=torch.int32, device=logits.device)
    accurate = libdevice is not None and os.environ.get("TRITON_INTERPRET") != "1"
    store = scores_out is not None
    _gumbel_kernel[(n, nb)](
        logits, kth, inv_temp, keys, vals, idxs, scores_out if store else vals, vocab,
        logits.stride(0), scores_out.stride(0) if scores_out is not None else 0, nb,
        BLOCK=BLOCK, ACCURATE=accurate, STORE=store, num_warps=NUM_WARPS,
        enable_fp_fusion=False)
    best = vals.amax(dim=1, keepdim=True)
    return torch.where(vals == best, idxs, vocab).amin(dim=1).long()


def gumbel_argmax_ref(logits: Tensor, kth: Tensor, inv_temp: Tensor, keys: Tensor,
                      scores_out: Tensor | None = None) -> Tensor:
    """The plain-torch form the kernel follows (``gumbel_noise.gumbel_scores``), same contract."""
    scores = gumbel_scores(logits, kth, inv_temp, keys)
    if scores_out is not None:
        scores_out.copy_(scores)
    return scores.argmax(dim=-1)
