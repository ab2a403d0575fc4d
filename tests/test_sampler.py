"""The sampler: the hash behind seeded sampling, and batched sampling (launched on the
device, read back later) against row-by-row sampling."""

from __future__ import annotations

import random

import pytest
import torch

from detserve import sampler
from detserve.gumbel_noise import fmix32, hashed_uniform, mul32
from detserve.sampler import SamplingSpec, launch_rows, sample_row


def _tensor_hash(seed: int, position: int, vocab: int) -> torch.Tensor:
    """hashed_uniform with its key computed in tensors too (how it was first written)."""
    key = torch.tensor([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, position & 0xFFFFFFFF])
    base = fmix32(key[0] ^ fmix32(key[1] ^ fmix32(key[2] + 0x9E3779B9)))
    h = fmix32(base ^ mul32(torch.arange(vocab, dtype=torch.int64), 0x9E3779B1))
    h2 = fmix32(h ^ 0x27D4EB2F)
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


def _gumbel_specs(n: int, vocab: int, seed: int) -> tuple[list[SamplingSpec], list[int]]:
    """Sampled specs of every kind ``gumbel_rows`` takes: temperatures, top-k (none, some,
    one, the whole vocabulary), 63-bit seeds, and positions."""
    rng = random.Random(seed)
    ks = [0, 1, 40, vocab, 5]
    specs = [SamplingSpec(temperature=rng.choice([0.3, 0.7, 1.0, 1.3]), top_k=ks[i % len(ks)],
                          seed=rng.getrandbits(63)) for i in range(n)]
    return specs, [rng.randrange(1, 4000) for _ in range(n)]


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_gumbel_rows_pick_each_rows_token(chunk: int) -> None:
    """Sampled rows picked many at a time (``gumbel_rows``, any chunk) get the token that
    row-by-row sampling gives each; a top-k of 1 is the row's argmax. (CPU: tokens; the
    bitwise scores are checked on CUDA, where launch_rows uses it.)"""
    torch.manual_seed(1)
    logits = torch.randn(11, 512) * 3
    specs, positions = _gumbel_specs(11, 512, seed=chunk)
    expected = [sample_row(logits[i], s, p)[0] for i, (s, p) in
                enumerate(zip(specs, positions, strict=True))]
    got = sampler.gumbel_rows(logits, specs, positions, chunk=chunk)
    assert got.tolist() == expected
    assert got[1] == logits[1].argmax()  # top-k 1
    # control: another seed moves some token (the noise is really there)
    moved = sampler.gumbel_rows(logits, [SamplingSpec(temperature=s.temperature, top_k=s.top_k,
                                                      seed=s.seed + 1) for s in specs],
                                positions, chunk=chunk)
    assert moved.tolist() != expected


def test_only_plain_sampled_rows_are_picked_many_at_a_time() -> None:
    """Top-p, logprobs and an active min_tokens mask keep a row on the row-by-row path."""
    ok = sampler._gumbel_batchable
    assert ok(SamplingSpec(temperature=0.8, top_k=20), 5)
    assert not ok(SamplingSpec(), 5)  # greedy: the shared argmax
    assert not ok(SamplingSpec(temperature=0.8, top_p=0.9), 5)
    assert not ok(SamplingSpec(temperature=0.8, logprobs=0), 5)
    assert not ok(SamplingSpec(temperature=0.8, logit_bias=((1, 2.0),)), 5)
    masked = SamplingSpec(temperature=0.8, min_tokens=3, prompt_len=4, stop_ids=(2,))
    assert not ok(masked, 5) and ok(masked, 7)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [128256, 49152, 1001])
def test_gumbel_rows_give_the_row_scores_bit_for_bit_on_cuda(vocab: int) -> None:
    """On CUDA every row's scores from the many-row path equal ``_pick``'s (``_row_scores``)
    bit for bit, whatever the rows beside it, and ``launch_rows`` (which takes that path)
    gives row-by-row's tokens."""
    torch.manual_seed(2)
    logits = (torch.randn(70, vocab, device="cuda") * 4).float()
    specs, positions = _gumbel_specs(70, vocab, seed=vocab)
    many = sampler._gumbel_scores(logits, specs, positions)
    for i in range(70):
        one = sampler._row_scores(logits[i].float(), specs[i], positions[i])
        assert torch.equal(many[i], one), i
    assert torch.equal(sampler._gumbel_scores(logits[5:9], specs[5:9], positions[5:9]),
                       many[5:9])
    expected = [sample_row(logits[i], s, p)[0] for i, (s, p) in
                enumerate(zip(specs, positions, strict=True))]
    assert launch_rows(logits, specs, positions).tokens.tolist() == expected
    assert launch_rows(logits, specs, positions, row_by_row=True).tokens.tolist() == expected


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_logit_bias_bans_and_forces_tokens_and_leaves_logprobs_raw(device: str) -> None:
    """-100 bans a token, +100 all but forces one, greedy and sampled alike; the logprobs
    stay the model's own; a biased row in a batch (on CUDA beside rows the many-row paths
    take) gets its row-by-row token, and the logits are not changed in place."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(3)
    logits = (torch.randn(6, 50) * 3).to(device)
    before = logits.clone()
    top = int(logits[0].argmax())
    banned = SamplingSpec(logit_bias=((top, -100.0),), logprobs=1)
    token, lp = sample_row(logits[0], banned, 5)
    assert token != top and token == int(logits[0].masked_fill(
        torch.arange(50, device=device) == top, float("-inf")).argmax())
    raw = torch.log_softmax(logits[0], dim=-1)
    assert lp is not None and lp.logprob == float(raw[token])
    forced = [SamplingSpec(temperature=t, seed=9, logit_bias=((7, 100.0),)) for t in (0.0, 1.0)]
    assert all(sample_row(logits[1], s, p)[0] == 7 for s in forced for p in range(20))
    specs = [SamplingSpec(), banned, *forced, SamplingSpec(temperature=0.9, seed=4),
             SamplingSpec(temperature=0.9, seed=4, logit_bias=((2, 5.0),))]
    picked = launch_rows(logits, specs, [5] * 6).result()
    assert [t for t, _ in picked] == [sample_row(logits[i], s, 5)[0]
                                      for i, s in enumerate(specs)]
    assert torch.equal(logits, before)


def test_penalties_lower_generated_tokens_by_presence_and_frequency() -> None:
    """``token_counts`` counts a history (and a token still on the device); a penalized
    row's logits lose ``count * frequency + (count > 0) * presence``; a penalized row with
    no counts is refused (the engine always passes them)."""
    from detserve.sampler import token_counts

    logits = torch.tensor([[2.0, 1.9, 1.8, 0.0]])
    counts = token_counts([0, 0, 2], 4, "cpu", extra=torch.tensor(0))
    assert counts.tolist() == [3, 0, 1, 0]
    spec = SamplingSpec(presence_penalty=0.05, frequency_penalty=0.1)
    # token 0: 2.0 - 0.3 - 0.05; token 1: 1.9; token 2: 1.8 - 0.1 - 0.05
    assert sample_row(logits[0], spec, 9, counts)[0] == 1
    assert sample_row(logits[0], SamplingSpec(), 9, counts)[0] == 0
    rewarded = SamplingSpec(presence_penalty=-0.5)
    assert sample_row(torch.tensor([1.0, 1.2, 1.1, 0.0]), rewarded, 9, counts)[0] == 2
    assert launch_rows(logits, [spec], [9], counts=[counts]).result()[0][0] == 1
    with pytest.raises(ValueError, match="penalties"):
        launch_rows(logits, [spec], [9])
