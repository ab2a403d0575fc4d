"""Token selection: greedy, and seeded temperature / top-k / top-p sampling.

Sampling draws ``argmax(logits / T + Gumbel(u))`` where ``u`` is a hash of
(seed, position, token id): the same seed, position and logits give the same token in any
batch, on any device, with no random-number-generator state. Every function works on one
row at a time on purpose: a row's result must not depend on what else is being sampled.
"""

from __future__ import annotations

import torch
from torch import Tensor

from detserve.outputs import TokenLogprob
from detserve.params import SamplingSpec

__all__ = ["SamplingSpec", "hashed_uniform", "sample_row", "sample_rows"]

_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x < 2**32 without int64 overflow (c split in 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(h: Tensor) -> Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def hashed_uniform(seed: int, position: int, vocab: int, device: torch.device | str = "cpu") -> Tensor:
    """Uniform(0, 1) float64 per token id, a pure function of (seed, position, token id)."""
    key = torch.tensor([seed & _M32, (seed >> 32) & _M32, position & _M32], dtype=torch.int64,
                       device=device)
    base = _fmix32(key[0] ^ _fmix32(key[1] ^ _fmix32(key[2] + 0x9E3779B9)))
    ids = torch.arange(vocab, dtype=torch.int64, device=device)
    h = _fmix32(base ^ _mul32(ids, 0x9E3779B1))
    h2 = _fmix32(h ^ 0x27D4EB2F)
    bits = (h << 21) | (h2 >> 11)  # 53 random bits
    return (bits.double() + 0.5) / float(1 << 53)


def _filter(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set logits outside top-k / the top-p nucleus to -inf (row: [V] fp32)."""
    out = logits
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(out, dim=-1)
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = before >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_row(logits: Tensor, spec: SamplingSpec, position: int) -> tuple[int, TokenLogprob | None]:
    """Pick the token at ``position`` from one row of fp32 logits [V].

    Logprobs are those of the model's raw distribution (before temperature/filtering).
    Stop tokens are masked while fewer than ``min_tokens`` outputs exist.
    """
    row = logits.float()
    if spec.min_tokens and position - spec.prompt_len < spec.min_tokens and spec.stop_ids:
        row = row.clone()
        row[list(spec.stop_ids)] = float("-inf")
    if spec.temperature == 0.0:
        token = int(torch.argmax(row).item())  # first maximal index on ties
    else:
        scores = _filter(row, spec.top_k, spec.top_p).double() / spec.temperature
        u = hashed_uniform(spec.seed, position, row.shape[-1], row.device)
        token = int(torch.argmax(scores - torch.log(-torch.log(u))).item())
    if spec.logprobs is None:
        return token, None
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: dict[int, float] = {}
    if spec.logprobs > 0:
        vals, ids = torch.topk(lp, spec.logprobs)
        top = {int(i): float(v) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)}
    return token, TokenLogprob(token_id=token, logprob=float(lp[token].item()), top=top)


def sample_rows(logits: Tensor, specs: list[SamplingSpec], positions: list[int]
                ) -> list[tuple[int, TokenLogprob | None]]:
    """Sample many rows. Greedy rows without logprobs share one batched argmax (exact, so
    still row-independent); the others go row by row."""
    simple = [s.temperature == 0.0 and s.logprobs is None and not s.min_tokens for s in specs]
    out: list[tuple[int, TokenLogprob | None]] = [(0, None)] * len(specs)
    idx = [i for i, ok in enumerate(simple) if ok]
    if idx:
        rows = logits if len(idx) == len(specs) else logits[torch.tensor(idx, device=logits.device)]
        for i, t in zip(idx, torch.argmax(rows, dim=-1).tolist(), strict=True):
            out[i] = (int(t), None)
    for i, ok in enumerate(simple):
        if not ok:
            out[i] = sample_row(logits[i], specs[i], positions[i])
    return out
