"""Asynchronous scheduling on CPU: the engine plans and queues step n+1 before it reads
step n's tokens (placeholders in the scheduler's state, fed on the device). It must
release exactly what the synchronous engine releases: same tokens, logprobs, finish
reasons and lane decisions, with stops found a step late, preemption, fault injection and
a threaded lane. Each case also checks that the asynchronous path really ran (rows fed
from the device, rows dropped after a stop)."""

from __future__ import annotations

import pytest
from engine_utils import Req, random_prompts, run_engine, signature, tiny_model

from detserve.outputs import RequestOutput
from detserve.params import SamplingParams


@pytest.fixture(scope="module")
def model() -> str:
    return tiny_model()


def _mix(n: int, det_every: int, seed: int, **params: object) -> list[Req]:
    prompts = random_prompts(n, [5, 23, 11, 40, 3, 17], seed=seed)
    reqs = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_tokens=12 + 5 * (i % 4), is_deterministic=i % det_every == 0,
                            temperature=0.8 * (i % 2), seed=100 + i, logprobs=1,
                            **params)  # type: ignore[arg-type]
        reqs.append(Req(p, sp, arrival=i % 5))
    return reqs


def _with_stops(model: str, reqs: list[Req], mode: str) -> list[Req]:
    """The same requests, each given a stop token it samples part-way (found by a first
    run), so sequences stop on a token the step after it could not know about."""
    outs, _, eng = run_engine(model, reqs, mode)
    eng.close()
    stopped = []
    for i, (r, out) in enumerate(zip(reqs, outs, strict=True)):
        stop = out.token_ids[2 + i % 5] if len(out.token_ids) > 7 else None
        stop_ids = [] if stop is None else [stop]
        p = r.params
        sp = SamplingParams(max_tokens=p.max_tokens, is_deterministic=p.is_deterministic,
                            temperature=p.temperature, seed=p.seed, logprobs=p.logprobs,
                            stop_token_ids=stop_ids, min_tokens=1 if i % 3 == 0 else 0)
        stopped.append(Req(r.prompt, sp, r.arrival))
    return stopped


def _released(outs: list[RequestOutput]) -> list[tuple]:
    return [(*signature(o), o.finish_reason) for o in outs]


def _both(model: str, reqs: list[Req], mode: str, exact: bool = True, **kw: object
          ) -> tuple[list[tuple], dict[str, float], dict[str, float]]:
    """Run ``reqs`` synchronously and asynchronously; what they release must be equal. With
    ``exact=False`` a fast-path request's logprobs may differ in the last bits: a row run
    after a stop joins the asynchronous engine's batch, and on the fast path a row's
    arithmetic may depend on its batch (the lane's and batch_invariant's may not)."""
    runs = []
    for async_scheduling in (False, True):
        outs, stats, eng = run_engine(model, reqs, mode, async_scheduling=async_scheduling, **kw)
        eng.close()
        runs.append((_released(outs), stats))
    (sync_out, sync_stats), (async_out, async_stats) = runs
    if exact:
        assert async_out == sync_out
    for r, a, b in zip(reqs, async_out, sync_out, strict=True):
        assert (a[0], a[2]) == (b[0], b[2])  # tokens and finish reason
        if mode != "nondeterministic" and r.params.is_deterministic:
            assert a[1] == b[1]
        else:
            assert a[1] == pytest.approx(b[1], abs=1e-5)
    assert sync_stats["fed_rows"] == 0 and async_stats["fed_rows"] > 0
    return async_out, sync_stats, async_stats


@pytest.mark.parametrize("mode", ["nondeterministic", "llm42", "batch_invariant"])
def test_async_releases_what_sync_releases(model: str, mode: str) -> None:
    reqs = _mix(9, det_every=3, seed=1, ignore_eos=True)
    _, sync_stats, async_stats = _both(model, reqs, mode)
    assert async_stats["dropped_rows"] == 0  # nothing stops early: no row runs in vain
    for key in ("rollbacks", "tokens_rolled_back", "windows", "committed_tokens"):
        assert async_stats[key] == sync_stats[key], key


@pytest.mark.parametrize("mode", ["nondeterministic", "llm42"])
def test_stop_tokens_found_a_step_late(model: str, mode: str) -> None:
    """Requests stop on a sampled stop token; the asynchronous engine has already queued
    a row after it, which must be dropped, never released or left in the state."""
    reqs = _with_stops(model, _mix(8, det_every=2, seed=2), mode)
    released, _, async_stats = _both(model, reqs, mode, exact=False)
    assert sum(r[2] == "stop" for r in released) >= 4
    assert async_stats["dropped_rows"] > 0


def test_preemption_and_fault_injection(model: str) -> None:
    """Few KV blocks (sequences are preempted, placeholders and all) and fast-path
    perturbation (the next step must be fed the perturbed token) with a threaded lane:
    deterministic requests equal ``lane_only``. (The others are not compared: with the
    lane on a thread, when its results arrive decides the batches, in either engine.)"""
    reqs = _mix(10, det_every=2, seed=3, ignore_eos=True)
    kw: dict[str, object] = dict(num_blocks=20, block_size=8, max_model_len=128,
                                 max_num_seqs=8)
    oracle, _, eng = run_engine(model, reqs, "lane_only", **kw)
    eng.close()
    outs, stats, eng = run_engine(model, reqs, "llm42", async_scheduling=True, perturbation=0.2,
                                  lane_threaded=True, **kw)
    eng.close()
    assert stats["fed_rows"] > 0 and stats["preemptions"] > 0
    assert stats["perturbed_tokens"] > 0 and stats["rollbacks"] > 0
    for r, a, b in zip(reqs, outs, oracle, strict=True):
        if r.params.is_deterministic:
            assert signature(a) == signature(b)
        assert len(a.token_ids) == r.params.max_tokens


def test_deterministic_requests_equal_the_oracle_under_async(model: str) -> None:
    """Deterministic requests scheduled asynchronously, with perturbation, equal
    ``lane_only``; the same perturbation changes the non-deterministic ones (control)."""
    reqs = _mix(8, det_every=2, seed=4, ignore_eos=True)
    oracle, _, eng = run_engine(model, reqs, "lane_only")
    eng.close()
    clean, _, eng = run_engine(model, reqs, "llm42", async_scheduling=True)
    eng.close()
    perturbed, stats, eng = run_engine(model, reqs, "llm42", async_scheduling=True,
                                       perturbation=0.3, seed=5)
    eng.close()
    assert stats["fed_rows"] > 0 and stats["perturbed_tokens"] > 0
    det = [i for i, r in enumerate(reqs) if r.params.is_deterministic]
    for i in det:
        assert signature(perturbed[i]) == signature(oracle[i])
    changed = [i for i in range(len(reqs)) if i not in det
               and signature(perturbed[i]) != signature(clean[i])]
    assert changed


def test_abort_with_a_launch_in_flight(model: str) -> None:
    """Requests aborted between asynchronous steps (a placeholder in their state, a row on
    the device) finish as aborted with only read tokens; nothing leaks."""
    from detserve.engine import LLMEngine

    eng = LLMEngine.from_args(model, "llm42", verify_window=8, verify_group=4,
                              max_model_len=512, async_scheduling=True)
    reqs = _mix(6, det_every=2, seed=6, ignore_eos=True)
    for i, r in enumerate(reqs):
        eng.add_request(f"r{i}", None, r.params, prompt_token_ids=r.prompt)
    finished = {}
    for step in range(200):
        if step == 6:
            assert eng._launch is not None  # a batch is in flight while we abort
            assert eng.abort_request("r1") and eng.abort_request("r0")
        for out in eng.step():
            assert -1 not in out.token_ids
            if out.finished:
                finished[out.request_id] = out
        eng.check_integrity()
        if not eng.has_unfinished_requests():
            break
    eng.close()
    assert len(finished) == 6
    assert finished["r1"].finish_reason == "abort" and finished["r0"].finish_reason == "abort"
    assert eng.blocks.num_free == eng.blocks.num_blocks - 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_held_prompts_change_no_deterministic_output(model: str, async_scheduling: bool) -> None:
    """Prompts held back for company (``prefill_batch_tokens``, on by default on CUDA) move
    the fast path's batches around: deterministic requests still release the lane_only
    oracle's tokens and logprobs, every request its full length, and prompts were held."""
    reqs = [Req(r.prompt, r.params, arrival=3 * i) for i, r in
            enumerate(_mix(10, det_every=2, seed=5, ignore_eos=True))]
    oracle, _, eng = run_engine(model, reqs, "lane_only")
    eng.close()
    for held in (0, 48):
        outs, stats, eng = run_engine(model, reqs, "llm42", async_scheduling=async_scheduling,
                                      prefill_batch_tokens=held)
        eng.close()
        assert (stats["prefill_held_steps"] > 0) == bool(held)
        for r, out, ref in zip(reqs, outs, oracle, strict=True):
            assert len(out.token_ids) == r.params.max_tokens
            if r.params.is_deterministic:
                assert signature(out) == signature(ref)
