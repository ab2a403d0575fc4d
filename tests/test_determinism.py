"""Determinism matrix (in the spirit of SGLang's test_deterministic), on CPU.

The deterministic target request must give bitwise-identical token ids and logprobs alone,
in batches of others, with mixed prompt lengths, shared prefixes, staggered arrivals and
fast-path fault injection, and equal the ``lane_only`` oracle. Negative controls show that
the same perturbations do change non-deterministic requests, so the test can fail.
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import Req, random_prompts, run_engine, signature, tiny_model

from detserve.outputs import RequestOutput
from detserve.params import SamplingParams

GREEDY = SamplingParams(max_tokens=40, is_deterministic=True, logprobs=2, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=1234,
                         is_deterministic=True, logprobs=2, ignore_eos=True)
TARGET = random_prompts(1, [21], seed=99)[0]


@pytest.fixture(scope="module")
def model() -> str:
    return tiny_model()


def _others(n: int, det: bool, seed: int = 1, prefix: list[int] | None = None,
            max_tokens: int = 30) -> list[Req]:
    prompts = random_prompts(n, [3, 17, 40, 9, 64, 5, 28], seed=seed, prefix=prefix)
    return [Req(p, SamplingParams(max_tokens=max_tokens + 7 * (i % 3), is_deterministic=det,
                                  temperature=0.7 * (i % 2), seed=i, ignore_eos=True),
                arrival=i % 4)
            for i, p in enumerate(prompts)]


@pytest.fixture(scope="module", params=[GREEDY, SAMPLED], ids=["greedy", "seeded-sampling"])
def oracle(request: pytest.FixtureRequest, model: str) -> tuple[SamplingParams, tuple]:
    params = request.param
    outs, _, _ = run_engine(model, [Req(TARGET, params)], mode="lane_only")
    return params, signature(outs[0])


CASES = {
    "alone": lambda: [],
    "batch1": lambda: _others(1, det=False),
    "batch3-mixed": lambda: _others(3, det=True) + _others(2, det=False, seed=5),
    "batch10": lambda: _others(10, det=False, seed=2),
    "shared-prefix": lambda: _others(5, det=True, seed=3, prefix=TARGET[:15]),
    "late-arrival": lambda: [Req(r.prompt, r.params, r.arrival) for r in _others(6, True, seed=4)],
}


@pytest.mark.parametrize("perturbation", [0.0, 0.25], ids=["clean", "perturbed"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("target_arrival", [0, 5])
def test_deterministic_request_equals_oracle(model: str, oracle: tuple, case: str,
                                             perturbation: float, target_arrival: int) -> None:
    params, expected = oracle
    reqs = CASES[case]()
    reqs.insert(len(reqs) // 2, Req(TARGET, params, arrival=target_arrival))
    idx = len(reqs) // 2 if reqs[len(reqs) // 2].prompt is TARGET else reqs.index(
        next(r for r in reqs if r.prompt is TARGET))
    outs, stats, _ = run_engine(model, reqs, perturbation=perturbation, seed=7)
    assert len(outs[idx].token_ids) == params.max_tokens
    assert signature(outs[idx]) == expected
    if perturbation:
        assert stats["perturbed_tokens"] > 0
        assert stats["rollbacks"] > 0


@pytest.mark.parametrize("window,group", [(4, 2), (16, 1), (64, 8)])
def test_window_geometry_does_not_change_lane_only_equality(model: str, window: int,
                                                            group: int) -> None:
    """For each lane geometry, DVR under perturbation equals lane_only of that geometry."""
    reqs = [Req(TARGET, GREEDY)] + _others(4, det=True, seed=8)
    oracle, _, _ = run_engine(model, reqs, mode="lane_only", window=window, group=group)
    dvr, stats, _ = run_engine(model, reqs, window=window, group=group, perturbation=0.3)
    assert stats["rollbacks"] > 0
    for a, b in zip(oracle, dvr, strict=True):
        assert signature(a) == signature(b)


def test_negative_control_perturbation_changes_nondeterministic(model: str) -> None:
    """The same fault injection that DVR absorbs must visibly change non-det requests."""
    nd = SamplingParams(max_tokens=40, is_deterministic=False, logprobs=1, ignore_eos=True)
    clean, _, _ = run_engine(model, [Req(TARGET, nd)] + _others(3, det=False))
    oracle, _, _ = run_engine(model, [Req(TARGET, GREEDY)], mode="lane_only")
    for mode in ("llm42", "nondeterministic"):
        reqs = [Req(TARGET, nd), Req(TARGET, GREEDY)] + _others(3, det=False)
        outs, stats, _ = run_engine(model, reqs, mode=mode, perturbation=0.25, seed=7)
        assert stats["perturbed_tokens"] > 0
        assert outs[0].token_ids != clean[0].token_ids, f"{mode}: perturbation had no effect"
        assert not outs[0].is_deterministic
        if mode == "llm42":
            assert signature(outs[1]) == signature(oracle[0])
        else:  # nondeterministic mode ignores the flag: the det request changes too
            assert outs[1].token_ids != oracle[0].token_ids


def test_no_rollbacks_without_perturbation_fp32(model: str) -> None:
    reqs = [Req(TARGET, GREEDY)] + _others(6, det=True, seed=11)
    outs, stats, _ = run_engine(model, reqs)
    assert stats["windows"] > 0
    assert stats["rollbacks"] == 0 and stats["tokens_rolled_back"] == 0
    assert stats["committed_tokens"] == sum(len(o.token_ids) for o in outs)


def test_rollback_accounting_with_perturbation(model: str) -> None:
    reqs = [Req(TARGET, GREEDY)] + _others(6, det=True, seed=12)
    oracle, _, _ = run_engine(model, reqs, mode="lane_only")
    outs, stats, engine = run_engine(model, reqs, perturbation=0.2, seed=3)
    assert stats["rollbacks"] > 0
    assert stats["tokens_rolled_back"] >= stats["rollbacks"]
    assert stats["recomputed_tokens"] >= stats["tokens_rolled_back"]
    per_request = sum(o.stats.tokens_rolled_back for o in outs)
    assert per_request == stats["tokens_rolled_back"]
    assert sum(o.stats.rollbacks for o in outs) == stats["rollbacks"]
    assert stats["lane_padding_rows"] >= 0 and stats["verify_passes"] > 0
    for a, b in zip(oracle, outs, strict=True):
        assert signature(a) == signature(b)


def test_preemption_keeps_determinism(model: str) -> None:
    """A KV cache too small for the batch forces preemption by recompute."""
    reqs = [Req(TARGET, GREEDY)] + _others(8, det=True, seed=13, max_tokens=60)
    oracle, _, _ = run_engine(model, [Req(TARGET, GREEDY)], mode="lane_only")
    outs, stats, _ = run_engine(model, reqs, perturbation=0.1, num_blocks=24, max_model_len=256)
    assert stats["preemptions"] > 0
    assert signature(outs[0]) == signature(oracle[0])


def test_batch_invariant_mode_is_deterministic(model: str) -> None:
    alone, _, _ = run_engine(model, [Req(TARGET, GREEDY)], mode="batch_invariant")
    for case in ("batch10", "shared-prefix"):
        reqs = [Req(TARGET, GREEDY)] + CASES[case]()
        outs, stats, _ = run_engine(model, reqs, mode="batch_invariant")
        assert stats["verify_passes"] == 0
        assert signature(outs[0]) == signature(alone[0])
        assert outs[0].is_deterministic


def test_batch_invariant_mode_samples_many_rows_as_row_by_row(
        model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """batch_invariant picks its greedy rows with one batched argmax (exact: first maximum,
    row by row), as every mode does: its outputs equal those of row-by-row sampling.
    Control: steps with several greedy rows did go through the batched path."""
    from detserve.executor import runner

    reqs = [Req(TARGET, GREEDY)] + _others(6, det=True, seed=8) + _others(3, det=False, seed=9)
    launched: list[int] = []
    real = runner.launch_rows

    def spy(logits, specs, positions, **kw):  # type: ignore[no-untyped-def]
        launched.append(sum(s.temperature == 0.0 and s.logprobs is None for s in specs))
        return real(logits, specs, positions, **kw)

    monkeypatch.setattr(runner, "launch_rows", spy)
    many, _, _ = run_engine(model, reqs, mode="batch_invariant")
    assert max(launched) > 1
    monkeypatch.setattr(runner, "launch_rows",
                        lambda logits, specs, positions, **kw: real(logits, specs, positions,
                                                                    row_by_row=True, **kw))
    rows, _, _ = run_engine(model, reqs, mode="batch_invariant")
    assert [signature(o) for o in many] == [signature(o) for o in rows]


def test_logit_bias_requests_stay_deterministic(model: str) -> None:
    """Requests with a logit bias (greedy and sampled, rows the sampler takes one by one)
    under fast-path perturbation equal the lane_only oracle, alone and in a batch. Controls:
    the bias does change the output (it bans tokens the unbiased output picks), and the
    perturbation does change a non-deterministic request with the same bias."""
    for kind in (dict(logprobs=1), dict(temperature=0.9, seed=5)):
        plain = SamplingParams(max_tokens=40, is_deterministic=True, ignore_eos=True, **kind)
        unbiased, _, _ = run_engine(model, [Req(TARGET, plain)], mode="lane_only")
        banned = set(unbiased[0].token_ids[:3])
        bias = {**{t: -100.0 for t in banned}, **{t: 4.0 for t in range(40, 60)
                                                   if t not in banned}}
        p = SamplingParams(**{**plain.__dict__, "logit_bias": bias})
        oracle, _, _ = run_engine(model, [Req(TARGET, p)], mode="lane_only")
        assert not banned & set(oracle[0].token_ids)
        assert signature(oracle[0]) != signature(unbiased[0])
        batch = _others(6, det=True, seed=11) + [Req(TARGET, p)] + _others(3, det=False, seed=12)
        outs, stats, _ = run_engine(model, batch, perturbation=0.25)
        assert stats["rollbacks"] > 0
        assert signature(outs[6]) == signature(oracle[0])
        free = SamplingParams(**{**p.__dict__, "is_deterministic": False})
        clean, _, _ = run_engine(model, [Req(TARGET, free)])
        drift, _, _ = run_engine(model, [Req(TARGET, free)], perturbation=0.25)
        assert signature(drift[0]) != signature(clean[0])


def _penalized_logits(model: str, prompt: list[int], out: list[int],
                      p: SamplingParams) -> list[torch.Tensor]:
    """For each position of ``out``: the logits after ``prompt + out[:t]`` from a dense
    reference forward (``model_helpers``), less OpenAI's penalties of ``out[:t]``."""
    from model_helpers import DenseAttention, ReferenceOps

    from detserve.model.loader import load_model

    llama = load_model(model)[0]
    ops, rows = ReferenceOps(), []
    for t in range(len(out)):
        ids = prompt + out[:t]
        attn = DenseAttention(llama.config, len(ids))
        positions = torch.arange(len(ids))
        attn.set_positions(positions)
        logits = llama.logits(llama(torch.tensor(ids), positions, attn, ops), ops)[-1]
        counts = torch.bincount(torch.tensor(out[:t], dtype=torch.long),
                                minlength=logits.shape[-1]).float()
        rows.append(logits - (counts * p.frequency_penalty + (counts > 0) * p.presence_penalty))
    return rows


# a generated token gains 1.0 once, less 0.3 per time it occurred: repeats, then moves on
PENALTIES = {"presence_penalty": -1.0, "frequency_penalty": 0.3}


@pytest.mark.parametrize("kw", [{"async_scheduling": False}, {"async_scheduling": True}],
                         ids=["sync", "async"])
def test_penalized_requests_stay_deterministic(model: str, kw: dict[str, bool]) -> None:
    """Presence and frequency penalties read every token generated before a position: the
    fast path (its last token fed on the device under asynchronous scheduling) and the lane
    (a window's candidates, the tokens before it sent along) must count alike. Under
    perturbation a penalized deterministic request equals the lane_only oracle, alone and
    in a batch with others penalized or not. Controls: the penalties change the output and
    make it repeat tokens (they reward them here: the tiny random model seldom repeats a
    token by itself, so a positive penalty would seldom bite); the perturbation changes the
    same request when non-deterministic."""
    for kind in (dict(logprobs=1), dict(temperature=0.9, seed=5)):
        plain = SamplingParams(max_tokens=40, is_deterministic=True, ignore_eos=True, **kind)
        p = SamplingParams(**{**plain.__dict__, **PENALTIES})
        unpenalized, _, _ = run_engine(model, [Req(TARGET, plain)], mode="lane_only", **kw)
        oracle, _, _ = run_engine(model, [Req(TARGET, p)], mode="lane_only", **kw)
        assert signature(oracle[0]) != signature(unpenalized[0])
        assert len(set(oracle[0].token_ids)) < len(set(unpenalized[0].token_ids))
        others = _penalized_others()
        batch = others[:4] + [Req(TARGET, p, arrival=2)] + others[4:]
        outs, stats, _ = run_engine(model, batch, perturbation=0.25, **kw)
        assert stats["rollbacks"] > 0
        assert signature(outs[4]) == signature(oracle[0])
        free = SamplingParams(**{**p.__dict__, "is_deterministic": False})
        clean, _, _ = run_engine(model, [Req(TARGET, free)], **kw)
        drift, _, _ = run_engine(model, [Req(TARGET, free)], perturbation=0.25, **kw)
        assert signature(drift[0]) != signature(clean[0])


def _penalized_others() -> list[Req]:
    """Others of every kind: penalized or not, deterministic or not."""
    return [Req(r.prompt, SamplingParams(**{**r.params.__dict__,
                                            "presence_penalty": (0.0, 0.8, -0.5)[i % 3],
                                            "frequency_penalty": (0.0, 0.3)[i % 2],
                                            "is_deterministic": i % 2 == 0}), r.arrival)
            for i, r in enumerate(_others(8, det=True, seed=13))]


@pytest.mark.parametrize("mode", ["nondeterministic", "llm42"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_penalties_follow_openais_formula(model: str, mode: str, async_scheduling: bool) -> None:
    """Each greedy token of a penalized request (the fast path's, its last token fed on the
    device when asynchronous, or the lane's) is the
    first maximum of that position's logits less ``count * frequency + (count > 0) *
    presence`` over the tokens generated before it (a dense reference forward; a near tie
    within 1e-4 may go either way). Control: the penalties do move some choice."""
    p = SamplingParams(max_tokens=16, is_deterministic=True, ignore_eos=True, **PENALTIES)
    out = run_engine(model, [Req(TARGET, p)], mode=mode,
                     async_scheduling=async_scheduling)[0][0].token_ids
    rows = _penalized_logits(model, TARGET, out, p)
    for t, row in enumerate(rows):
        assert float(row[out[t]]) >= float(row.max()) - 1e-4, t
    raw = _penalized_logits(model, TARGET, out, SamplingParams())
    assert any(int(r.argmax()) != out[t] for t, r in enumerate(raw))


def _prompt_signature(out: RequestOutput) -> list[tuple[int, float, tuple]]:
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    return [(lp.token_id, lp.logprob, tuple(lp.top.items()))
            for lp in out.prompt_logprobs[1:] if lp is not None]


def test_prompt_logprobs_are_deterministic(model: str) -> None:
    """``prompt_logprobs`` of a deterministic request come from the lane: under fast-path
    perturbation, in a batch, with chunked prefill and an earlier request sharing its
    prefix (whose cached blocks it must not reuse), they equal the lane_only oracle bit for
    bit, one per prompt token, with their top alternatives; and they are the model's (a
    dense reference). Control: the fast path computes other bits for the same prompt, so
    the equality is the lane's doing."""
    from model_helpers import DenseAttention, ReferenceOps

    from detserve.model.loader import load_model

    p = SamplingParams(max_tokens=20, is_deterministic=True, prompt_logprobs=3, logprobs=1,
                       ignore_eos=True)
    oracle = run_engine(model, [Req(TARGET, p)], mode="lane_only",
                        max_num_batched_tokens=16)[0][0]
    expected = _prompt_signature(oracle)
    assert len(expected) == len(TARGET) - 1
    assert [t for t, _, _ in expected] == TARGET[1:]
    sharer = Req(TARGET[:17] + [5, 6, 7], SamplingParams(max_tokens=8, is_deterministic=True))
    later = Req(TARGET[:17] + [9, 9], SamplingParams(max_tokens=8, is_deterministic=True),
                arrival=8)  # reuses the sharer's cached block: the cache was there
    batch = [sharer, *_others(8, det=True, seed=21), Req(TARGET, p, arrival=6),
             *_others(3, det=False, seed=22), later]
    outs, stats, _ = run_engine(model, batch, perturbation=0.25, max_num_batched_tokens=16)
    assert stats["rollbacks"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert _prompt_signature(outs[9]) == expected
    assert signature(outs[9]) == signature(oracle)
    fast = run_engine(model, [Req(TARGET, SamplingParams(**{**p.__dict__,
                                                            "is_deterministic": False}))],
                      mode="nondeterministic")[0][0]
    assert _prompt_signature(fast) != expected
    llama = load_model(model)[0]
    ops, attn = ReferenceOps(), DenseAttention(llama.config, len(TARGET))
    positions = torch.arange(len(TARGET))
    attn.set_positions(positions)
    ref = torch.log_softmax(llama.logits(llama(torch.tensor(TARGET), positions, attn, ops),
                                         ops), dim=-1)
    for i, (token, logprob, top) in enumerate(expected, 1):
        assert logprob == pytest.approx(float(ref[i - 1, token]), abs=1e-5)
        assert [t for t, _ in top] == ref[i - 1].topk(3).indices.tolist()


def test_nondeterministic_mode_ignores_flag(model: str) -> None:
    outs, stats, _ = run_engine(model, [Req(TARGET, GREEDY)], mode="nondeterministic")
    assert stats["verify_passes"] == 0
    assert not outs[0].is_deterministic


def test_threaded_lane_verifier_equals_oracle(model: str) -> None:
    """Lane passes on a worker thread (asynchronous decisions, steps planned while a pass
    is in flight) change nothing in the output."""
    reqs = [Req(TARGET, SAMPLED)] + _others(6, det=True, seed=14)
    oracle, _, _ = run_engine(model, reqs, mode="lane_only")
    outs, stats, engine = run_engine(model, reqs, perturbation=0.2, lane_threaded=True)
    in_flight_at_plan = engine.counters["lane_in_flight_at_plan"]
    engine.close()
    assert stats["rollbacks"] > 0
    assert in_flight_at_plan > 0
    for a, b in zip(oracle, outs, strict=True):
        assert signature(a) == signature(b)


def test_prefix_cache_reuses_lane_blocks_without_changing_outputs(model: str) -> None:
    """Deterministic requests sharing a prompt prefix reuse lane-written KV blocks; the
    outputs are those of an engine with the cache switched off, bit for bit."""
    long_prefix = random_prompts(1, [70], seed=31)[0]
    prompts = random_prompts(6, [5, 19, 33], seed=32, prefix=long_prefix)
    reqs = [Req(p, GREEDY if i % 2 else SAMPLED, arrival=3 * i) for i, p in enumerate(prompts)]
    reqs.append(Req(prompts[0], SAMPLED, arrival=40))  # the same request again, later
    cold, cold_stats, _ = run_engine(model, reqs, perturbation=0.2,
                                     enable_prefix_caching=False)
    warm, warm_stats, _ = run_engine(model, reqs, perturbation=0.2)
    assert cold_stats["prefix_cache_hit_tokens"] == 0
    assert warm_stats["prefix_cache_hit_tokens"] >= 4 * 64, "later requests must hit"
    assert warm_stats["lane_prefill_rows"] < cold_stats["lane_prefill_rows"]
    for a, b in zip(cold, warm, strict=True):
        assert signature(a) == signature(b)
    assert signature(warm[0]) == signature(warm[-1])


def test_prefix_cache_with_preemption(model: str) -> None:
    prefix = random_prompts(1, [48], seed=33)[0]
    reqs = [Req(p, GREEDY, arrival=i) for i, p in
            enumerate(random_prompts(8, [4, 20], seed=34, prefix=prefix))]
    cold, _, _ = run_engine(model, reqs, enable_prefix_caching=False)
    warm, stats, _ = run_engine(model, reqs, perturbation=0.1, num_blocks=20,
                                max_model_len=256)
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    for a, b in zip(cold, warm, strict=True):
        assert signature(a) == signature(b)


def test_block_manager_prefix_cache_bookkeeping() -> None:
    from detserve.block_manager import BlockManager

    bm = BlockManager(6, 4)
    tokens = list(range(10, 22))
    digests = bm.chain_digests(tokens, 3)
    assert bm.chain_digests(tokens, 3, digests[:1]) == digests
    assert bm.chain_digests(tokens[:4] + [0] * 8, 3)[0] == digests[0]
    assert bm.chain_digests([0] + tokens[1:], 3)[1] != digests[1], "chained on the prefix"
    table = bm.allocate(3)
    assert table is not None
    for b, d in zip(table, digests, strict=True):
        bm.register(b, d)
    shared = bm.match(digests[:2])
    assert shared == table[:2]
    bm.check_integrity([table, shared])
    bm.free(table)
    bm.free(shared)
    bm.check_integrity([])
    assert bm.match(digests) == table, "freed registered blocks stay findable"
    bm.free(table)
    assert bm.allocate(5) is not None  # evicts them
    assert bm.match(digests) == []
    bm.check_integrity([[1, 2, 3, 4, 5]])


@pytest.mark.parametrize("joins", [True, False], ids=["lane-rows-join", "lane-rows-sit-out"])
def test_decode_rows_padded_only_when_the_lane_verifies_them(
        model: str, oracle: tuple, monkeypatch: pytest.MonkeyPatch, joins: bool) -> None:
    """With decode buckets (as on CUDA), an eager step pads its decode rows' products only
    when a lane sequence's row is among them; whether lane rows join steps with prefill
    rows or sit out every other one, the deterministic request still equals the oracle."""
    from engine_utils import drive

    from detserve.engine import LLMEngine
    from detserve.executor import runner as runner_mod

    params, expected = oracle
    padded: list[int] = []

    class CountingPad(runner_mod.HeadPaddedOps):
        def __init__(self, base, head: int, size: int,  # type: ignore[no-untyped-def]
                     single_call=None, counts=None, pads=None) -> None:
            padded.append(head)
            super().__init__(base, head, size, single_call, counts, pads)

    monkeypatch.setattr(runner_mod, "HeadPaddedOps", CountingPad)
    engine = LLMEngine.from_args(model, "llm42", verify_window=8, verify_group=4,
                                 max_model_len=512, max_num_batched_tokens=16,
                                 lane_decode_in_mixed_steps=joins)
    engine.runner.decode_buckets = (4, 8, 16, 32)  # what the CUDA alignment would plan
    steps: list[tuple[bool, bool, int]] = []  # (lane decode rows?, prefill rows?, pads)
    real = engine.runner.launch_batch

    def spy(segs, specs, batch_invariant=False, align_decode=True,  # type: ignore[no-untyped-def]
            feed=None, **kw):
        before = len(padded)
        res = real(segs, specs, batch_invariant, align_decode, feed, **kw)
        steps.append((align_decode, any(len(s.input_ids) > 1 for s in segs),
                      len(padded) - before))
        return res

    engine.runner.launch_batch = spy  # type: ignore[method-assign]
    others = [Req(r.prompt, r.params, arrival=6 + 5 * i)
              for i, r in enumerate(_others(6, det=False, seed=2))]
    outs = drive(engine, [Req(TARGET, params), *others])
    engine.close()
    assert signature(outs[0]) == expected
    assert all(pads == 0 for lane, _, pads in steps if not lane)
    assert all(pads > 0 for lane, _, pads in steps if lane)
    assert any(not lane for lane, _, _ in steps) and any(lane for lane, _, _ in steps)
    mixed = [lane for lane, prefill, _ in steps if prefill]
    assert mixed and (all(mixed) if joins else not all(mixed))
    stats = engine.stats()  # (no single-call sizes probed here: steps with prefill split)
    assert stats["head_products_split"] > 0 and stats["head_products_one_call"] > 0


@pytest.mark.parametrize("case", ["batch10", "batch3-mixed", "shared-prefix"])
def test_lane_row_chunks_on_cpu_keep_lane_only_equality(model: str, case: str) -> None:
    """``lane_gemm_rows`` on CPU: the lane computes only the 8-row chunks a pass fills. The
    target equals the ``lane_only`` oracle of the same profile, under perturbation, and
    passes really were trimmed (fewer rows computed than G*W each)."""
    params = GREEDY
    (ref,), _, oracle_engine = run_engine(model, [Req(TARGET, params)], mode="lane_only",
                                          lane_gemm_rows=8)
    profile = oracle_engine.determinism_profile()
    assert profile["lane_gemm_rows"] == 8
    reqs = CASES[case]() + [Req(TARGET, params, arrival=2)]
    outs, stats, engine = run_engine(model, reqs, perturbation=0.25, seed=3, lane_gemm_rows=8)
    assert signature(outs[-1]) == signature(ref)
    assert engine.determinism_profile()["lane_gemm_rows"] == 8
    assert stats["rollbacks"] > 0 and stats["verify_passes"] > 0
    assert stats["lane_computed_rows"] < stats["lane_rows"]


@pytest.mark.parametrize("threaded", [False, True], ids=["in-process", "lane-thread"])
def test_pipelined_prompt_chunks_equal_the_oracle(model: str, threaded: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Long deterministic prompts (4-6 lane passes each, W=8 G=4) beside others: pipelined,
    two of a prompt's chunks are in the lane at once (the second queued behind the first);
    the output still equals lane_only's, as it does without pipelining. Control: the
    unpipelined engine never has more than one lane item of a sequence in flight. (The
    in-process verifier answers at submit, so there nothing is ever left in flight.)"""
    from detserve.engine import LLMEngine
    from detserve.lane_planner import LANE_PREFILL_DEPTH

    prompts = random_prompts(3, [100, 130, 150], seed=21)
    reqs = [Req(p, SamplingParams(max_tokens=20, is_deterministic=True, logprobs=1,
                                  temperature=0.6 * i, seed=i, ignore_eos=True), arrival=2 * i)
            for i, p in enumerate(prompts)] + _others(3, det=False, seed=8)
    oracle, _, o = run_engine(model, reqs[:3], mode="lane_only", window=8, group=4)
    o.close()
    real = LLMEngine._lane_pass  # (builds each pass the engine submits)
    for batch in (reqs, reqs[:1]):  # with others, and a long prompt alone
        peak = {True: 0, False: 0}
        for pipeline in (True, False):
            def submit(self, items, _p=pipeline, _peak=peak):  # type: ignore[no-untyped-def]
                _peak[_p] = max([_peak[_p], *(it.seq.lane_items for it in items)])
                return real(self, items)

            monkeypatch.setattr(LLMEngine, "_lane_pass", submit)
            outs, stats, eng = run_engine(model, batch, window=8, group=4, perturbation=0.2,
                                          lane_threaded=threaded, pipeline_lane_prefill=pipeline)
            eng.close()
            assert stats["perturbed_tokens"] > 0 or len(batch) == 1
            for a, b in zip(oracle, outs[:3], strict=False):
                assert signature(a) == signature(b)
        assert peak[False] == 1
        assert peak[True] == (LANE_PREFILL_DEPTH if threaded else 1)


def test_steps_yielded_to_the_lane_keep_the_oracle(model: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With a pass in flight and most sequences waiting on the lane, the engine plans a step
    without fast rows and waits for the pass; outputs still equal lane_only's, and no fast
    row ever writes a slot of a pass in flight. Control: with lane_bound_fraction=1.0
    (never lane-bound) no step is yielded."""
    from detserve.engine import LLMEngine
    from detserve.scheduler import Scheduler

    launch_fast = LLMEngine._launch_fast

    def checked(self, items, prev):  # type: ignore[no-untyped-def]
        # no fast row may write a slot that a lane pass in flight writes (its K/V would
        # race the lane's: see Scheduler._fast_rows)
        for item in items:
            for sent in self._inflight.values():
                lane = sent.get(item.seq.request_id)
                assert lane is None or item.start >= lane.end or item.end <= lane.start
        return launch_fast(self, items, prev)

    monkeypatch.setattr(LLMEngine, "_launch_fast", checked)
    reqs = [Req(TARGET, SAMPLED)] + _others(6, det=True, seed=17) + _others(2, False, seed=3)
    oracle, _, o = run_engine(model, reqs, mode="lane_only")
    o.close()
    real = Scheduler.schedule
    for fraction in (0.3, 1.0):
        yielded: list[bool] = []

        def schedule(self, fast=True, _y=yielded, **kw):  # type: ignore[no-untyped-def]
            _y.append(not fast)
            return real(self, fast, **kw)

        monkeypatch.setattr(Scheduler, "schedule", schedule)
        outs, stats, engine = run_engine(model, reqs, perturbation=0.2, lane_threaded=True,
                                         lane_bound_fraction=fraction)
        engine.close()
        assert stats["perturbed_tokens"] > 0
        for a, b in zip(oracle, outs[:7], strict=False):
            assert signature(a) == signature(b)
        if fraction < 1.0:
            assert any(yielded) and stats["lane_bound_waits"] >= sum(yielded)
        else:
            assert not any(yielded)


def _oracle_with_and_without(model: str, reqs: list[Req], max_num_seqs: int, option: str,
                             values: tuple[float, ...], counter: str, **kw: object) -> None:
    """Run ``reqs`` with a perturbed fast path once per value of scheduler ``option``:
    every deterministic output equals lane_only's, and ``counter`` (the option's own
    counter) is non-zero exactly when the option is on (the control)."""
    oracle, _, o = run_engine(model, reqs, mode="lane_only", max_num_seqs=max_num_seqs)
    o.close()
    det = [i for i, r in enumerate(reqs) if r.params.is_deterministic]
    for value in values:
        outs, stats, engine = run_engine(model, reqs, perturbation=0.2,
                                         max_num_seqs=max_num_seqs, **{option: value}, **kw)
        engine.close()
        assert stats["perturbed_tokens"] > 0
        for i in det:
            assert signature(outs[i]) == signature(oracle[i]), (option, value, i)
        assert (stats[counter] > 0) == (value > 0), (option, value)


def test_parked_sequences_lending_slots_keep_the_oracle(model: str) -> None:
    """Admission past max_num_seqs while deterministic sequences sit parked on the lane
    changes which sequences share each step, never a deterministic output: every
    deterministic request equals lane_only's with the headroom and without it. Control: the
    headroom run did admit into parked slots, and the run without it did not."""
    reqs = ([Req(TARGET, SAMPLED)] + _others(5, det=True, seed=21)
            + _others(6, det=False, seed=22))
    _oracle_with_and_without(model, reqs, 4, "parked_seq_headroom", (0.5, 0.0),
                             "parked_admissions")


def test_prompts_admitted_ahead_into_spare_lane_rows_keep_the_oracle(model: str) -> None:
    """Deterministic requests queued behind others whose prompts go through a lane pass's
    spare rows, admitted ahead of the queue (``lane_prefill_ahead``): their prompts are
    chunked and scheduled differently, their outputs are not. Every deterministic request
    equals lane_only's with a perturbed fast path, with the option and without it. Control:
    prompts were admitted ahead only with it."""
    reqs = (_others(4, det=False, seed=31) + [Req(TARGET, SAMPLED)]
            + _others(3, det=False, seed=32) + _others(4, det=True, seed=33))
    _oracle_with_and_without(model, reqs, 3, "lane_prefill_ahead", (8, 0),
                             "lane_ahead_admissions")


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async-scheduling"])
def test_partial_windows_in_spare_lane_rows_keep_the_oracle(model: str, async_: bool) -> None:
    """Partial windows (``lane_partial_windows``: a pass's spare rows verify the candidates
    so far of sequences in the middle of a window) move where windows start, never a
    deterministic output: with a perturbed fast path (so some partial windows roll back)
    every deterministic request equals lane_only's, with the option and without it.
    Control: partial windows were sent only with it."""
    reqs = ([Req(TARGET, SAMPLED)] + _others(6, det=True, seed=41)
            + _others(4, det=False, seed=42))
    _oracle_with_and_without(model, reqs, 4, "lane_partial_windows", (True, False),
                             "partial_windows", async_scheduling=async_)




def test_stop_string_ends_at_its_token_however_many_a_step_commits(model: str) -> None:
    """A deterministic request with a stop string ends at the token that completes it,
    whether the lane commits a whole window at once (llm42, no perturbation: every
    window verifies whole), a window cut short by a rollback (llm42, perturbed) or one
    token a pass (lane_only): the same tokens, logprobs and text in all three. Control:
    the stop string's token is the last one; finishing with whatever the step settled (the
    rule before) kept the rest of the window in the unperturbed llm42 run (17 tokens
    against 11 in the model this test builds)."""
    from detserve.model.loader import load_model

    tok = load_model(model)[1]
    free = SamplingParams(max_tokens=24, is_deterministic=True, logprobs=1, ignore_eos=True)
    ref, _, _ = run_engine(model, [Req(TARGET, free)], "lane_only")
    out_ids = ref[0].token_ids
    # a stop string completed by a token in the middle of the W=8 window that holds it
    stop = None
    for k in (10, 11, 12, 13, 9, 14):
        piece = tok.decode(out_ids[k:k + 1]).strip()
        if piece and piece not in tok.decode(out_ids[:k]):
            stop, end = piece, k
            break
    if stop is None:
        pytest.skip("no output token with fresh text in this random model")
    params = SamplingParams(max_tokens=24, is_deterministic=True, logprobs=1,
                            ignore_eos=True, stop=[stop])
    others = _others(4, det=False, seed=7)
    got = {(mode, p): run_engine(model, [Req(TARGET, params), *others], mode,
                                 perturbation=p)[0][0]
           for mode, p in (("llm42", 0.0), ("llm42", 0.3), ("lane_only", 0.0))}
    assert len({signature(o) for o in got.values()}) == 1
    for o in got.values():
        assert o.finish_reason == "stop" and o.text == tok.decode(o.token_ids)[:len(o.text)]
        assert stop in tok.decode(o.token_ids) and stop not in tok.decode(o.token_ids[:-1])
        assert len(o.token_ids) <= end + 1
