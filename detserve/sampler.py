"""Token selection: greedy, and seeded temperature / top-k / top-p sampling.

Sampling draws ``argmax(logits / T + Gumbel(u))`` where ``u`` is a hash of
(seed, position, token id): the same seed, position and logits give the same token in any
batch, on any device, with no random-number-generator state. Every function works on one
row at a time on purpose: a row's result must not depend on what else is being sampled.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor

from detserve.executor.transfer import upload
from detserve.outputs import TokenLogprob
from detserve.params import SamplingSpec

__all__ = ["PickedRows", "SamplingSpec", "hashed_uniform", "launch_rows", "sample_row",
           "sample_rows"]

_M32 = 0xFFFFFFFF
_Int = TypeVar("_Int", int, Tensor)  # the hash runs on Python integers and int64 tensors


def _mul32(x: _Int, c: int) -> _Int:
    """(x * c) mod 2**32 for x < 2**32 without int64 overflow (c split in 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(h: _Int) -> _Int:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def hashed_uniform(seed: int, position: int, vocab: int, device: torch.device | str = "cpu") -> Tensor:
    """Uniform(0, 1) float64 per token id, a pure function of (seed, position, token id)."""
    # the per-(seed, position) key in Python integers: the same 64-bit arithmetic as the
    # tensors below, without a host-to-device copy that would wait for the device
    lo, hi, pos = seed & _M32, (seed >> 32) & _M32, position & _M32
    base = _fmix32(lo ^ _fmix32(hi ^ _fmix32(pos + 0x9E3779B9)))
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


class PickedRows:
    """Tokens picked on the device, not yet read back: ``tokens`` (int64 [n], one per row,
    usable by later kernels, e.g. as the next step's input ids) and ``result()``, which
    waits for them and returns (token, logprob or None) per row."""

    def __init__(self, tokens: Tensor, logprobs: list[tuple[Tensor, Tensor, Tensor] | None]
                 ) -> None:
        self.tokens = tokens
        self._logprobs = logprobs  # per row: (chosen logprob, top values, top ids) or None
        self._host, self._done = tokens, None
        if tokens.is_cuda:
            # copy back now, behind this step's kernels: a copy queued when the result is
            # read would wait for whatever was queued since (the next step's forward)
            self._host = tokens.to("cpu", non_blocking=True)
            self._logprobs = [None if lp is None else
                              tuple(t.to("cpu", non_blocking=True) for t in lp)  # type: ignore[misc]
                              for lp in logprobs]
            self._done = torch.cuda.Event()
            self._done.record()

    def result(self) -> list[tuple[int, TokenLogprob | None]]:
        if self._done is not None:
            self._done.synchronize()
        tokens = [int(t) for t in self._host.tolist()]
        out: list[tuple[int, TokenLogprob | None]] = []
        for token, lp in zip(tokens, self._logprobs, strict=True):
            if lp is None:
                out.append((token, None))
                continue
            chosen, vals, ids = lp
            top = {int(i): float(v) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)}
            out.append((token, TokenLogprob(token_id=token, logprob=float(chosen.item()),
                                            top=top)))
        return out


def _pick(logits: Tensor, spec: SamplingSpec, position: int
          ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor] | None]:
    """One row of fp32 logits [V] -> (0-d int64 token, logprob tensors or None), all on the
    logits' device: nothing waits for the device here.

    Logprobs are those of the model's raw distribution (before temperature/filtering).
    Stop tokens are masked while fewer than ``min_tokens`` outputs exist.
    """
    row = logits.float()
    if spec.min_tokens and position - spec.prompt_len < spec.min_tokens and spec.stop_ids:
        row = row.clone()
        row[upload(list(spec.stop_ids), row.device)] = float("-inf")
    if spec.temperature == 0.0:
        token = torch.argmax(row)  # first maximal index on ties
    else:
        scores = _filter(row, spec.top_k, spec.top_p).double() / spec.temperature
        u = hashed_uniform(spec.seed, position, row.shape[-1], row.device)
        token = torch.argmax(scores - torch.log(-torch.log(u)))
    if spec.logprobs is None:
        return token, None
    lp = torch.log_softmax(logits.float(), dim=-1)
    k = spec.logprobs
    vals, ids = torch.topk(lp, k) if k > 0 else (lp[:0], token.new_zeros(0))
    return token, (lp[token], vals, ids)


def sample_row(logits: Tensor, spec: SamplingSpec, position: int) -> tuple[int, TokenLogprob | None]:
    """Pick the token at ``position`` from one row of fp32 logits [V] (see ``_pick``)."""
    token, lp = _pick(logits, spec, position)
    return PickedRows(token.view(1), [lp]).result()[0]


def launch_rows(logits: Tensor, specs: list[SamplingSpec], positions: list[int],
                row_by_row: bool = False) -> PickedRows:
    """Sample many rows without waiting for the device. Greedy rows without logprobs share
    one batched argmax (exact, so still row-independent) unless ``row_by_row``; the others
    go row by row."""
    simple = [not row_by_row and s.temperature == 0.0 and s.logprobs is None
              and not s.min_tokens for s in specs]
    n = len(specs)
    tokens = torch.empty(n, dtype=torch.long, device=logits.device)
    lps: list[tuple[Tensor, Tensor, Tensor] | None] = [None] * n
    idx = [i for i, ok in enumerate(simple) if ok]
    if idx:
        if len(idx) == n:
            tokens = torch.argmax(logits, dim=-1)
        else:
            at = upload(idx, logits.device)
            tokens[at] = torch.argmax(logits[at], dim=-1)
    for i, ok in enumerate(simple):
        if not ok:
            token, lps[i] = _pick(logits[i], specs[i], positions[i])
            tokens[i] = token
    return PickedRows(tokens, lps)


def sample_rows(logits: Tensor, specs: list[SamplingSpec], positions: list[int]
                ) -> list[tuple[int, TokenLogprob | None]]:
    """Sample many rows and wait for the tokens (``launch_rows`` then ``result``)."""
    return launch_rows(logits, specs, positions).result()
