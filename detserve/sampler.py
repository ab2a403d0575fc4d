"""Token selection: greedy, and seeded temperature / top-k / top-p sampling.

Sampling draws ``argmax(logits / T + Gumbel(u))`` where ``u`` is a hash of
(seed, position, token id): the same seed, position and logits give the same token in any
batch, on any device, with no random-number-generator state. A row's result must not
depend on what else is being sampled: the row-by-row functions work on one row at a time,
and the many-row paths (the greedy argmax; ``gumbel_rows`` on CUDA) only use operations
that never mix rows, so each row gets exactly its row-by-row result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor

from detserve.config import SamplerConfig
from detserve.executor.transfer import upload
from detserve.gumbel_noise import gumbel_scores, hashed_uniform, row_key
from detserve.outputs import TokenLogprob
from detserve.params import SamplingSpec

__all__ = ["PickedRows", "PromptLogprobs", "SamplerConfig", "SamplingSpec", "gumbel_rows",
           "launch_rows", "sample_row", "sample_rows"]

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


# rows' logprobs from one pass (``kernels.logprobs``), for the rows the many-row paths pick:
# (row indices, chosen logprobs [m], top values [m, k], top ids [m, k], each row's k)
ManyLogprobs = tuple[list[int], Tensor, Tensor, Tensor, list[int]]


class PickedRows:
    """Tokens picked on the device, not yet read back: ``tokens`` (int64 [n], one per row,
    usable by later kernels, e.g. as the next step's input ids) and ``result()``, which
    waits for them and returns (token, logprob or None) per row. ``logprobs``: a row's own
    (chosen logprob, top values, top ids) tensors, or None; ``many``: those of several rows
    from one pass, which then fill their rows."""

    def __init__(self, tokens: Tensor, logprobs: list[tuple[Tensor, Tensor, Tensor] | None],
                 many: ManyLogprobs | None = None) -> None:
        self.tokens = tokens
        self._logprobs = logprobs  # per row: (chosen logprob, top values, top ids) or None
        self._many = many
        self._host, self._done = tokens, None
        if tokens.is_cuda:
            # copy back now, behind this step's kernels: a copy queued when the result is
            # read would wait for whatever was queued since (the next step's forward)
            self._host = tokens.to("cpu", non_blocking=True)
            self._logprobs = [None if lp is None else
                              tuple(t.to("cpu", non_blocking=True) for t in lp)  # type: ignore[misc]
                              for lp in logprobs]
            if many is not None:
                rows, *tensors, ks = many
                chosen, vals, ids = (t.to("cpu", non_blocking=True) for t in tensors)
                self._many = (rows, chosen, vals, ids, ks)
            self._done = torch.cuda.Event()
            self._done.record()

    def result(self) -> list[tuple[int, TokenLogprob | None]]:
        if self._done is not None:
            self._done.synchronize()
        tokens = [int(t) for t in self._host.tolist()]
        lps: list[TokenLogprob | None] = [
            None if lp is None else _token_logprob(tokens[i], float(lp[0].item()),
                                                   lp[2].tolist(), lp[1].tolist())
            for i, lp in enumerate(self._logprobs)]
        if self._many is not None:
            rows, chosen, vals, ids, ks = self._many
            for j, (i, c, v, t) in enumerate(zip(rows, chosen.tolist(), vals.tolist(),
                                                 ids.tolist(), strict=True)):
                lps[i] = _token_logprob(tokens[i], c, t[:ks[j]], v[:ks[j]])
        return list(zip(tokens, lps, strict=True))


class PromptLogprobs:
    """The logprobs of prompt tokens (``targets``) from the logits of the rows that predict
    them (fp32 [m, V]), with ``k`` top alternatives, launched on the device and read later
    (``result``). ``exact``: each row alone (``log_softmax`` and ``topk`` of one row, as
    ``_pick`` does), so a row's values do not depend on the rows beside it; else all rows
    in one call (non-deterministic requests)."""

    def __init__(self, logits: Tensor, targets: Sequence[int], k: int, exact: bool) -> None:
        self.targets = list(targets)
        ids = upload(self.targets, logits.device)
        if exact:
            rows = [_row_logprobs(logits[i], ids[i], k) for i in range(len(targets))]
            chosen, vals, top_ids = (torch.stack(parts) for parts in zip(*rows, strict=True))
        else:
            lp = torch.log_softmax(logits.float(), dim=-1)
            chosen = lp.gather(1, ids[:, None])[:, 0]
            vals, top_ids = torch.topk(lp, k, dim=-1)
        self._tensors: tuple[Tensor, ...] = (chosen, vals, top_ids)
        self._done = None
        if logits.is_cuda:
            self._tensors = tuple(t.to("cpu", non_blocking=True) for t in self._tensors)
            self._done = torch.cuda.Event()
            self._done.record()

    def result(self) -> list[TokenLogprob]:
        if self._done is not None:
            self._done.synchronize()
        chosen, vals, ids = (t.tolist() for t in self._tensors)
        return [_token_logprob(t, c, i, v)
                for t, c, i, v in zip(self.targets, chosen, ids, vals, strict=True)]


def _token_logprob(token: int, chosen: float, ids: list[int], vals: list[float]) -> TokenLogprob:
    top = {int(i): float(v) for i, v in zip(ids, vals, strict=True)}
    return TokenLogprob(token_id=token, logprob=chosen, top=top)


def _row_scores(row: Tensor, spec: SamplingSpec, position: int) -> Tensor:
    """The Gumbel-perturbed float64 scores [V] whose argmax ``_pick`` samples (temperature
    > 0): filtered logits over the temperature, plus the hashed noise."""
    scores = _filter(row, spec.top_k, spec.top_p).double() / spec.temperature
    u = hashed_uniform(spec.seed, position, row.shape[-1], row.device)
    return scores - torch.log(-torch.log(u))


def _pick(logits: Tensor, spec: SamplingSpec, position: int, counts: Tensor | None = None
          ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor] | None]:
    """One row of fp32 logits [V] -> (0-d int64 token, logprob tensors or None), all on the
    logits' device: nothing waits for the device here.

    Logprobs are those of the model's raw distribution (before temperature/filtering).
    The logit bias is added, then (``counts``: int64 [V], how often each token was
    generated before this position) the penalties subtracted. Stop tokens are masked while
    fewer than ``min_tokens`` outputs exist.
    """
    row = logits.float()
    if spec.logit_bias:
        row = _biased(row, spec.logit_bias)
    if counts is not None and spec.penalized:
        row = _penalized(row, counts, spec)
    if spec.min_tokens and position - spec.prompt_len < spec.min_tokens and spec.stop_ids:
        row = row.clone()
        row[upload(list(spec.stop_ids), row.device)] = float("-inf")
    if spec.temperature == 0.0:
        token = torch.argmax(row)  # first maximal index on ties
    else:
        token = torch.argmax(_row_scores(row, spec, position))
    if spec.logprobs is None:
        return token, None
    return token, _row_logprobs(logits, token, spec.logprobs)


def _row_logprobs(logits: Tensor, token: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """One row of logits [V] alone: the logprob of ``token`` (0-d int64 on the device) and
    the ``k`` largest logprobs with their ids, of the model's raw distribution."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = torch.topk(lp, k) if k > 0 else (lp[:0], token.new_zeros(0))
    return lp[token], vals, ids


def _biased(row: Tensor, bias: tuple[tuple[int, float], ...]) -> Tensor:
    """A copy of one fp32 row with each (token id, bias) added to its logit: one fp32 add
    an element, so the same bits on every path."""
    ids = upload([t for t, _ in bias], row.device)
    values = upload(torch.tensor([b for _, b in bias], dtype=torch.float32), row.device,
                    torch.float32)
    out = row.clone()
    out[ids] = row[ids] + values
    return out


def _penalized(row: Tensor, counts: Tensor, spec: SamplingSpec) -> Tensor:
    """``row`` less each token's penalty: ``count * frequency + (count > 0) * presence``,
    in fp32 elementwise (the counts are exact integers, so the same bits on every path)."""
    penalty = counts.float() * spec.frequency_penalty + \
        (counts > 0).float() * spec.presence_penalty
    return row - penalty


def token_counts(history: Sequence[int], vocab: int, device: torch.device | str,
                 extra: Tensor | None = None) -> Tensor:
    """int64 [vocab]: how often each token of ``history`` (and ``extra``, a 0-d token on
    the device, not yet read back) occurs. Integer adds: the same counts in any order."""
    counts = torch.zeros(vocab, dtype=torch.int64, device=device)
    if history:
        ids = upload(list(history), device)
        counts.index_add_(0, ids, torch.ones_like(ids))
    if extra is not None:
        counts.index_add_(0, extra.view(1), torch.ones(1, dtype=torch.int64, device=device))
    return counts


def sample_row(logits: Tensor, spec: SamplingSpec, position: int,
               counts: Tensor | None = None) -> tuple[int, TokenLogprob | None]:
    """Pick the token at ``position`` from one row of fp32 logits [V] (see ``_pick``)."""
    token, lp = _pick(logits, spec, position, counts)
    return PickedRows(token.view(1), [lp]).result()[0]


DEFAULT_SAMPLER = SamplerConfig()


def _gumbel_batchable(spec: SamplingSpec, position: int, logprobs_ok: bool = False) -> bool:
    """Whether ``_pick`` of this row is only elementwise ops, a top-k selection and an
    argmax (no top-p nucleus, logprobs unless ``logprobs_ok``, stop-token mask or logit
    bias), which ``gumbel_rows`` gives exactly for many rows at once."""
    masked = spec.min_tokens and position - spec.prompt_len < spec.min_tokens and spec.stop_ids
    return (spec.temperature > 0.0 and spec.top_p >= 1.0
            and (spec.logprobs is None or logprobs_ok) and not masked and not spec.logit_bias
            and not spec.penalized)


def gumbel_rows(logits: Tensor, specs: list[SamplingSpec], positions: list[int],
                chunk: int = DEFAULT_SAMPLER.gumbel_chunk_rows,
                kernel: bool = DEFAULT_SAMPLER.gumbel_kernel) -> Tensor:
    """Seeded temperature (and top-k) sampling of the rows of ``logits`` [n, V]: int64 [n]
    tokens. Every row's token is exactly ``_pick``'s on CUDA: its top-k threshold is the
    same selected value, the temperature is the same multiply by the host's reciprocal
    (torch's CUDA division by a host scalar), the noise the same integer hash, and the
    logs and the argmax (first maximum) never mix rows. On CUDA with ``kernel`` one
    Triton pass (``kernels.gumbel``); else torch's kernels, ``chunk`` rows at a time. For
    ``_gumbel_batchable`` rows only (not on CPU in the engine, whose vectorized logs may
    round a row's tail elements otherwise than a lone row's)."""
    if logits.is_cuda and kernel:
        from detserve.kernels.gumbel import gumbel_argmax

        return gumbel_argmax(logits.contiguous(), *_gumbel_inputs(logits, specs, positions))
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    step = max(1, chunk)
    for a in range(0, logits.shape[0], step):
        b = min(logits.shape[0], a + step)
        out[a:b] = torch.argmax(_gumbel_scores(logits[a:b], specs[a:b], positions[a:b]),
                                dim=-1)
    return out


def _gumbel_inputs(logits: Tensor, specs: list[SamplingSpec], positions: list[int]
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of ``logits`` [n, V]: the top-k threshold (fp32, -inf: none; the k-th largest
    logit, as ``_filter`` selects it), the reciprocal of the temperature (float64, computed
    on the host as torch's CUDA division by a host scalar does) and the hash key (int64)."""
    dev, vocab = logits.device, logits.shape[1]
    ks = [s.top_k if 0 < s.top_k < vocab else 0 for s in specs]
    kth = torch.full((len(specs),), float("-inf"), dtype=torch.float32, device=dev)
    if any(ks):
        top = torch.topk(logits.float(), max(ks), dim=-1).values  # descending: k-th at k - 1
        kth = top.gather(1, upload([max(k - 1, 0) for k in ks], dev)[:, None])[:, 0]
        kth = kth.masked_fill(upload(torch.tensor([k == 0 for k in ks]), dev, torch.bool),
                              float("-inf"))
    inv = upload(torch.tensor([1.0 / s.temperature for s in specs], dtype=torch.float64),
                 dev, torch.float64)
    keys = upload([row_key(s.seed, p) for s, p in zip(specs, positions, strict=True)], dev)
    return kth, inv, keys


def _gumbel_scores(logits: Tensor, specs: list[SamplingSpec], positions: list[int]) -> Tensor:
    """``_row_scores`` of every row of ``logits`` [n, V] at once, in torch: float64 [n, V]."""
    return gumbel_scores(logits, *_gumbel_inputs(logits, specs, positions))


def launch_rows(logits: Tensor, specs: list[SamplingSpec], positions: list[int],
                row_by_row: bool = False, cfg: SamplerConfig = DEFAULT_SAMPLER,
                counts: Sequence[Tensor | None] = ()) -> PickedRows:
    """Sample many rows without waiting for the device. Greedy rows without logprobs share
    one batched argmax (exact, so still row-independent) unless ``row_by_row``; so do, on
    CUDA, sampled rows without top-p, logprobs, a stop mask, a logit bias or penalties
    (``gumbel_rows``, exact too); the others go row by row. ``counts`` (per row, or empty):
    the token counts a penalized row's penalties read (``token_counts``). ``row_by_row``:
    every row does (the reference the many-row paths are tested against)."""
    lp_ok = not row_by_row and logits.is_cuda and cfg.logprob_kernel
    simple = [not row_by_row and s.temperature == 0.0 and (s.logprobs is None or lp_ok)
              and not s.min_tokens and not s.logit_bias and not s.penalized for s in specs]
    many_ok = not row_by_row and logits.is_cuda and cfg.gumbel_chunk_rows > 0
    gumbel = [many_ok and _gumbel_batchable(s, p, lp_ok)
              for s, p in zip(specs, positions, strict=True)]
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
    many = [i for i, ok in enumerate(gumbel) if ok]
    if many:
        at = upload(many, logits.device)
        tokens[at] = gumbel_rows(logits[at], [specs[i] for i in many],
                                 [positions[i] for i in many], cfg.gumbel_chunk_rows,
                                 cfg.gumbel_kernel)
    for i, (ok, batched) in enumerate(zip(simple, gumbel, strict=True)):
        if not (ok or batched):  # (every row with penalties)
            row_counts = counts[i] if counts else None
            if specs[i].penalized and row_counts is None:
                raise ValueError("a row with penalties needs the counts of the tokens before it")
            token, lps[i] = _pick(logits[i], specs[i], positions[i], row_counts)
            tokens[i] = token
    return PickedRows(tokens, lps, _many_logprobs(logits, tokens, specs, simple, gumbel))


def _many_logprobs(logits: Tensor, tokens: Tensor, specs: list[SamplingSpec],
                   simple: list[bool], gumbel: list[bool]) -> ManyLogprobs | None:
    """The logprobs of the rows with logprobs that the many-row paths picked, in one
    ``kernels.logprobs`` pass (``SamplerConfig.logprob_kernel``), from the model's own
    logits."""
    rows = [i for i, s in enumerate(specs)
            if s.logprobs is not None and (simple[i] or gumbel[i])]
    if not rows:
        return None
    from detserve.kernels.logprobs import row_logprobs

    ks = [cast(int, specs[i].logprobs) for i in rows]
    at = upload(rows, logits.device)
    chosen, vals, ids = row_logprobs(logits[at].float().contiguous(), tokens[at], max(ks))
    return rows, chosen, vals, ids, ks


def sample_rows(logits: Tensor, specs: list[SamplingSpec], positions: list[int]
                ) -> list[tuple[int, TokenLogprob | None]]:
    """Sample many rows and wait for the tokens (``launch_rows`` then ``result``)."""
    return launch_rows(logits, specs, positions).result()
