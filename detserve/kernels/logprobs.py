"""Logprobs of many rows in one pass: each row's log-softmax at its chosen token and its
top-k alternatives.

The sampler's row-by-row form runs ``log_softmax`` over the row, an index and a
``topk``: three launches a row, so a 128-row step with logprobs spends its host time on
hundreds of small kernels. Here one program takes one row: it reads the row for its
maximum, again for the sum of ``exp(x - max)`` (a [BLOCK] accumulator over the blocks in
column order, summed once at the end), and once per alternative for the next-largest
logit in the order (value descending, index ascending). A logprob is ``(x - max) -
log(sum)`` in fp32, torch's formula. Nothing in a program depends on the rows beside it or
on how many run, so a row gets the same bits alone or in any batch; its bits are this
kernel's own, not ``torch.log_softmax``'s (another summation order), which is why the
sampler takes this path only where ``sampler.LOGPROB_KERNEL`` says so, in every mode
alike. Ties among the alternatives go to the lower token id.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from detserve.kernels._utils import expect

__all__ = ["row_logprobs", "row_logprobs_ref"]

try:  # CUDA's exp and log
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older Triton
    libdevice = None

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _logprob_kernel(logits_ptr, tok_ptr, chosen_ptr, vals_ptr, ids_ptr, vocab, k, stride_l,
                    BLOCK: tl.constexpr, ACCURATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_l
    offs = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf"))
        top = tl.maximum(top, x)
    m = tl.max(top, 0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf"))
        if ACCURATE:
            acc += libdevice.exp(x - m)
        else:  # the interpreter has no libdevice
            acc += tl.exp(x - m)
    total = tl.sum(acc, 0)
    if ACCURATE:
        log_total = libdevice.log(total)
    else:
        log_total = tl.log(total)
    token = tl.load(tok_ptr + row)
    tl.store(chosen_ptr + row, (tl.load(base + token) - m) - log_total)
    # the alternatives: each pass takes the largest logit after the previous one in the
    # order (value descending, index ascending)
    prev_val = float("inf")
    prev_idx = -1
    for j in range(0, k):
        best = float("-inf")
        best_idx = vocab
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            live = cols < vocab
            x = tl.load(base + cols, mask=live, other=float("-inf"))
            after = (x < prev_val) | ((x == prev_val) & (cols > prev_idx))
            ok = live & after
            s = tl.where(ok, x, float("-inf"))
            blk = tl.max(s, 0)
            first = tl.min(tl.where(ok & (s == blk), cols, vocab), 0)
            # blocks come in column order: an equal value found later has a larger index
            take = (first < vocab) & ((best_idx == vocab) | (blk > best))
            best = tl.where(take, blk, best)
            best_idx = tl.where(take, first, best_idx)
        tl.store(vals_ptr + row * k + j, (best - m) - log_total)
        tl.store(ids_ptr + row * k + j, best_idx.to(tl.int64))
        prev_val = best
        prev_idx = best_idx


def row_logprobs(logits: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """For fp32 ``logits`` [n, V] (rows contiguous) and chosen ``tokens`` (int64 [n]): the
    chosen tokens' logprobs (fp32 [n]) and the top ``k`` alternatives' logprobs (fp32
    [n, k]) and ids (int64 [n, k]), largest first, the lower id first among equals."""
    expect(logits.dim() == 2 and logits.stride(1) == 1 and logits.dtype == torch.float32,
           f"logits must be fp32 [n, V] with contiguous rows, got {logits.dtype} "
           f"{tuple(logits.shape)}")
    n, vocab = logits.shape
    expect(tokens.shape == (n,) and tokens.dtype == torch.int64
           and tokens.device == logits.device, f"tokens must be int64 [{n}] on {logits.device}")
    expect(0 <= k <= vocab, f"k must be in [0, {vocab}], got {k}")
    chosen = torch.empty(n, dtype=torch.float32, device=logits.device)
    vals = torch.empty((n, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((n, k), dtype=torch.int64, device=logits.device)
    if n:
        accurate = libdevice is not None and os.environ.get("TRITON_INTERPRET") != "1"
        _logprob_kernel[(n,)](logits, tokens, chosen, vals, ids, vocab, k, logits.stride(0),
                              BLOCK=BLOCK, ACCURATE=accurate, num_warps=NUM_WARPS)
    return chosen, vals, ids


def row_logprobs_ref(logits: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The same in torch (``log_softmax``, a stable sort): equal ids, close values."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    order = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    return lp.gather(1, tokens[:, None])[:, 0], lp.gather(1, order), order
