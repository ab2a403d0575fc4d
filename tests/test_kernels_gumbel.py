"""Seeded Gumbel sampling of many rows in one Triton pass against the torch form
(``sampler._gumbel_scores``, whose rows equal row-by-row sampling's on CUDA).

CPU: the non-GPU tests run in a TRITON_INTERPRET=1 subprocess (test_interpreter_suite); the
interpreter's log is numpy's, so there the scores are checked for closeness (the hash
exactly: a wrong bit would move a score far) and the tokens for equality. GPU: every score
bitwise equal to the torch form at real vocabulary sizes, the tokens equal to row-by-row
sampling's, and a row's token the same whatever rows run beside it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

pytest.importorskip("triton")

from kernel_suite import interp, interpreter_suite, needs_cuda  # noqa: E402

from detserve import sampler  # noqa: E402
from detserve.kernels.gumbel import gumbel_argmax, gumbel_argmax_ref  # noqa: E402
from detserve.params import SamplingSpec  # noqa: E402

test_interpreter_suite = interpreter_suite(__file__)


def case(n: int, vocab: int, device: str, seed: int = 0
         ) -> tuple[torch.Tensor, list[SamplingSpec], list[int]]:
    """Logits with a wide spread, and specs of every kind: temperatures, top-k of none,
    one, some and the whole vocabulary, 63-bit seeds, positions."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=gen) * 4).to(device)
    rng = random.Random(seed)
    ks = [0, 1, 40, vocab, 7]
    specs = [SamplingSpec(temperature=rng.choice([0.3, 0.7, 1.0, 1.3]), top_k=ks[i % len(ks)],
                          seed=rng.getrandbits(63)) for i in range(n)]
    return logits, specs, [rng.randrange(1, 5000) for _ in range(n)]


def run(logits: torch.Tensor, specs: list[SamplingSpec], positions: list[int],
        fn: Callable[..., torch.Tensor] = gumbel_argmax) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, every score) from the kernel (or ``fn``, its reference)."""
    scores = torch.empty(logits.shape, dtype=torch.float64, device=logits.device)
    tokens = fn(logits, *sampler._gumbel_inputs(logits, specs, positions), scores_out=scores)
    return tokens, scores


@interp
@pytest.mark.parametrize("n,vocab", [(1, 7), (6, 5000), (9, 2048), (3, 4097)])
def test_close_to_the_torch_form_interp(n: int, vocab: int) -> None:
    logits, specs, positions = case(n, vocab, "cpu", seed=vocab)
    tokens, scores = run(logits, specs, positions)
    ref_tokens, ref = run(logits, specs, positions, gumbel_argmax_ref)
    assert torch.equal(ref, sampler._gumbel_scores(logits, specs, positions))
    kept = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(scores), kept)  # the same top-k cut
    torch.testing.assert_close(scores[kept], ref[kept], rtol=1e-14, atol=1e-14)
    assert tokens.tolist() == ref_tokens.tolist()
    if n > 1:  # (top-k 1: the argmax)
        assert tokens[1] == logits[1].argmax()


@interp
def test_rejects_bad_arguments_interp() -> None:
    logits, specs, positions = case(3, 64, "cpu")
    kth, inv, keys = sampler._gumbel_inputs(logits, specs, positions)
    with pytest.raises(ValueError, match="contiguous rows"):
        gumbel_argmax(logits.t(), kth, inv, keys)
    with pytest.raises(ValueError, match="inv_temp"):
        gumbel_argmax(logits, kth, inv.float(), keys)
    with pytest.raises(ValueError, match="keys"):
        gumbel_argmax(logits, kth, inv, keys[:2])
    with pytest.raises(ValueError, match="scores_out"):
        gumbel_argmax(logits, kth, inv, keys, scores_out=torch.empty(3, 64))
    empty = gumbel_argmax(logits[:0], kth[:0], inv[:0], keys[:0])
    assert empty.shape == (0,) and empty.dtype == torch.long


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("vocab", [128256, 49152, 1001])
def test_bitwise_equal_to_the_torch_form_gpu(vocab: int) -> None:
    logits, specs, positions = case(70, vocab, "cuda", seed=vocab)
    tokens, scores = run(logits, specs, positions)
    ref = sampler._gumbel_scores(logits, specs, positions)
    assert torch.equal(scores, ref)
    rows = [sampler.sample_row(logits[i], s, p)[0]
            for i, (s, p) in enumerate(zip(specs, positions, strict=True))]
    assert tokens.tolist() == rows
    # a row's token whatever rows run beside it
    assert torch.equal(run(logits[5:9], specs[5:9], positions[5:9])[0], tokens[5:9])
    # control: another seed moves tokens
    other = [SamplingSpec(temperature=s.temperature, top_k=s.top_k, seed=s.seed + 1)
             for s in specs]
    assert run(logits, other, positions)[0].tolist() != rows
