"""Logprobs of many rows in one Triton pass (``kernels.logprobs``) against torch
(``log_softmax`` and a stable sort).

CPU: the non-GPU tests run in a TRITON_INTERPRET=1 subprocess (test_interpreter_suite):
the alternatives' ids equal the stable sort's exactly (ties to the lower id), the values
are close to ``log_softmax``'s, and a row's bits are the same alone as in any batch. GPU:
the same at real vocabulary sizes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_suite import interp, interpreter_suite, needs_cuda  # noqa: E402

from detserve.kernels.logprobs import row_logprobs, row_logprobs_ref  # noqa: E402

test_interpreter_suite = interpreter_suite(__file__)


def case(n: int, vocab: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with ties (values rounded to a coarse grid, as bf16 logits are) and chosen
    tokens anywhere in the row."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=gen) * 4).mul(8).round().div(8)
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    return logits.to(device), tokens.to(device)


def check(n: int, vocab: int, k: int, device: str) -> None:
    logits, tokens = case(n, vocab, device, seed=vocab + k)
    chosen, vals, ids = row_logprobs(logits, tokens, k)
    ref_chosen, ref_vals, ref_ids = row_logprobs_ref(logits, tokens, k)
    assert torch.equal(ids, ref_ids)  # exact: the (value desc, id asc) order
    torch.testing.assert_close(chosen, ref_chosen, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vals, ref_vals, rtol=1e-5, atol=1e-5)
    # a row's bits do not depend on the rows beside it
    for i in (0, n // 2, n - 1):
        c1, v1, i1 = row_logprobs(logits[i:i + 1].clone(), tokens[i:i + 1].clone(), k)
        assert torch.equal(c1[0], chosen[i]) and torch.equal(v1[0], vals[i])
        assert torch.equal(i1[0], ids[i])


@interp
@pytest.mark.parametrize("n,vocab,k", [(1, 7, 3), (5, 2048, 0), (6, 5000, 5), (3, 4097, 20)])
def test_rows_match_torch_and_stand_alone_interp(n: int, vocab: int, k: int) -> None:
    check(n, vocab, k, "cpu")


@interp
def test_bad_arguments_are_refused_interp() -> None:
    logits, tokens = case(2, 50, "cpu")
    with pytest.raises(ValueError, match="fp32"):
        row_logprobs(logits.double(), tokens, 1)
    with pytest.raises(ValueError, match="tokens"):
        row_logprobs(logits, tokens[:1], 1)
    with pytest.raises(ValueError, match="k must"):
        row_logprobs(logits, tokens, 51)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n,vocab,k", [(128, 128256, 5), (64, 49152, 20), (3, 1001, 0)])
def test_rows_match_torch_and_stand_alone_on_cuda(n: int, vocab: int, k: int) -> None:
    check(n, vocab, k, "cuda")


def _many_vs_row_by_row(device: str) -> None:
    """Rows whose tokens the many-row paths picked get their logprobs from one pass
    (``sampler._many_logprobs``, what ``launch_rows`` does on CUDA with
    ``SamplerConfig.logprob_kernel``): the same top ids as row by row, close values, and a row's bits
    the same alone."""
    from detserve import sampler
    from detserve.params import SamplingSpec

    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(5, 3000, generator=gen) * 4).to(device)
    specs = [SamplingSpec(logprobs=3), SamplingSpec(), SamplingSpec(logprobs=0),
             SamplingSpec(logprobs=20), SamplingSpec(logprobs=1)]
    tokens = logits.argmax(dim=-1)
    simple, gumbel = [True] * 5, [False] * 5
    many = sampler._many_logprobs(logits, tokens, specs, simple, gumbel)
    assert many is not None and many[0] == [0, 2, 3, 4] and many[4] == [3, 0, 20, 1]
    got = sampler.PickedRows(tokens, [None] * 5, many).result()
    rows = [sampler.sample_row(logits[i], s, 9) for i, s in enumerate(specs)]
    for (token, lp), (ref_token, ref) in zip(got, rows, strict=True):
        assert token == ref_token and (lp is None) == (ref is None)
        if lp is not None and ref is not None:
            assert list(lp.top) == list(ref.top)
            assert lp.logprob == pytest.approx(ref.logprob, abs=1e-5)
            assert list(lp.top.values()) == pytest.approx(list(ref.top.values()), abs=1e-5)
    alone = sampler._many_logprobs(logits[3:4], tokens[3:4], specs[3:4], [True], [False])
    assert alone is not None
    assert sampler.PickedRows(tokens[3:4], [None], alone).result()[0] == got[3]


@interp
def test_many_rows_logprobs_equal_row_by_row_interp() -> None:
    _many_vs_row_by_row("cpu")


@pytest.mark.gpu
@needs_cuda
def test_many_rows_logprobs_equal_row_by_row_on_cuda() -> None:
    _many_vs_row_by_row("cuda")
