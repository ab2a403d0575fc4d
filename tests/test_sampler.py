"""The sampler: the hash behind seeded sampling, and batched sampling (launched on the
device, read back later) against row-by-row sampling."""

from __future__ import annotations

import random

import torch

from detserve.sampler import SamplingSpec, _fmix32, _mul32, hashed_uniform, launch_rows, sample_row


def _tensor_hash(seed: int, position: int, vocab: int) -> torch.Tensor:
    """hashed_uniform with its key computed in tensors too (how it was first written)."""
    key = torch.tensor([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, position & 0xFFFFFFFF])
    base = _fmix32(key[0] ^ _fmix32(key[1] ^ _fmix32(key[2] + 0x9E3779B9)))
    h = _fmix32(base ^ _mul32(torch.arange(vocab, dtype=torch.int64), 0x9E3779B1))
    h2 = _fmix32(h ^ 0x27D4EB2F)
    return (((h << 21) | (h2 >> 11)).double() + 0.5) / float(1 << 53)


def test_hash_key_in_python_integers_equals_tensors() -> None:
    rng = random.Random(0)
    cases = [(0, 0), (2**63 - 1, 2**32 - 1), (1234, 77)]
    cases += [(rng.getrandbits(63), rng.getrandbits(32)) for _ in range(100)]
    for seed, pos in cases:
        assert torch.equal(hashed_uniform(seed, pos, 997), _tensor_hash(seed, pos, 997))


def test_launched_rows_equal_row_by_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(7, 300)
    specs = [SamplingSpec(), SamplingSpec(temperature=0.7, seed=3),
             SamplingSpec(logprobs=3), SamplingSpec(temperature=1.1, top_p=0.8, top_k=40,
                                                    seed=9, logprobs=0),
             SamplingSpec(min_tokens=5, prompt_len=10, stop_ids=(int(logits[4].argmax()),)),
             SamplingSpec(), SamplingSpec(temperature=0.5, seed=1, logprobs=2)]
    positions = [11, 12, 13, 14, 12, 15, 16]
    expected = [sample_row(logits[i], s, p) for i, (s, p) in
                enumerate(zip(specs, positions, strict=True))]
    for row_by_row in (False, True):
        picked = launch_rows(logits, specs, positions, row_by_row=row_by_row)
        assert picked.tokens.tolist() == [t for t, _ in expected]
        assert picked.result() == expected
    assert expected[4][0] != int(logits[4].argmax())  # min_tokens masked the stop token
    assert expected[2][1] is not None and len(expected[2][1].top) == 3
