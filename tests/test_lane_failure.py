"""Verification lost mid-request (``LLMEngine.fail_lane``), on CPU.

A verifier that stops answering (``LaneUnavailable`` from ``poll`` or ``submit``) ends every
deterministic request with ``finish_reason`` "error" and only lane-verified tokens (a
prefix of the ``lane_only`` oracle's); non-deterministic requests decode on to their end;
no block leaks; and once a verifier answers again a new deterministic request equals the
oracle.
"""

from __future__ import annotations

import math
from collections import deque

import pytest
from engine_utils import Req, drive, random_prompts, run_engine, signature, tiny_model

from detserve.config import EngineConfig
from detserve.engine import LLMEngine
from detserve.executor.runner import ModelRunner
from detserve.lane import LanePass, LaneResult
from detserve.outputs import RequestOutput
from detserve.params import SamplingParams
from detserve.sequence import PLACEHOLDER
from detserve.verifier import LaneUnavailable

DET = SamplingParams(max_tokens=40, is_deterministic=True, logprobs=1, ignore_eos=True)
FAST = SamplingParams(max_tokens=60, temperature=0.7, seed=3, ignore_eos=True)
PROMPTS = random_prompts(3, [21, 13, 30], seed=7)


class LosableVerifier:
    """Runs passes in process, until ``lose_after`` passes were submitted: then ``poll``
    drops every pass it holds and raises, and ``submit`` raises, until ``restore``. With
    ``hold``, ``poll`` keeps its results (the passes stay in flight)."""

    stream_ordered = True
    shares_device = True

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._done: deque[LaneResult] = deque()
        self.submitted = 0
        self.lose_after = math.inf
        self.lost = False
        self.dropped = 0  # passes whose result never came back
        self.hold = False

    def submit(self, lane_pass: LanePass) -> None:
        if self.lost:
            raise LaneUnavailable("test verifier lost")
        self.submitted += 1
        self._done.append(self.runner.run_lane(lane_pass))

    def poll(self, wait: bool = False) -> list[LaneResult]:
        if not self.lost and self.submitted >= self.lose_after:
            self.lost = True
        if self.lost and self._done:
            self.dropped += len(self._done)
            self._done.clear()
            raise LaneUnavailable("test verifier lost")
        if self.hold:
            return []
        out = list(self._done)
        self._done.clear()
        return out

    def in_flight(self) -> int:
        return len(self._done)

    def restore(self) -> None:
        self.lost, self.lose_after = False, math.inf

    def close(self) -> None:
        self._done.clear()


@pytest.fixture(scope="module")
def model() -> str:
    return tiny_model()


@pytest.fixture(scope="module")
def oracle(model: str) -> tuple:
    outs, _, _ = run_engine(model, [Req(PROMPTS[0], DET)], mode="lane_only")
    return signature(outs[0])


def _engine(model: str, **kw: object) -> LLMEngine:
    config = EngineConfig.create(model, "llm42", verify_window=8, verify_group=4,  # type: ignore[arg-type]
                                 seed=0, max_model_len=512, **kw)
    return LLMEngine(config, verifier_factory=LosableVerifier)


def _step(engine: LLMEngine) -> tuple[list[RequestOutput], bool]:
    """One step as the decoder's engine loop takes it: outputs, and whether the lane
    was lost in it."""
    try:
        return engine.step(), False
    except LaneUnavailable as e:
        return engine.fail_lane(str(e)), True


@pytest.mark.parametrize("lose_after", [1, 4, 9], ids=["prompt", "early", "later"])
def test_lost_verifier_fails_deterministic_requests_only(model: str, oracle: tuple,
                                                         lose_after: int) -> None:
    engine = _engine(model, fastpath_perturbation=0.25)
    verifier = engine.verifier
    assert isinstance(verifier, LosableVerifier)
    verifier.lose_after = lose_after
    engine.add_request("det", None, DET, prompt_token_ids=PROMPTS[0])
    engine.add_request("fast", None, FAST, prompt_token_ids=PROMPTS[1])
    final: dict[str, RequestOutput] = {}
    candidates_at_loss = -1
    steps = 0
    while engine.has_unfinished_requests():
        det = engine._seqs.get("det")
        pending = (det.num_tokens - det.num_committed) if det is not None else 0
        outs, lost = _step(engine)
        if lost and candidates_at_loss < 0:
            candidates_at_loss = pending
        for out in outs:
            assert PLACEHOLDER not in out.token_ids
            if out.request_id == "det":  # every release is verified: on the oracle's path
                assert tuple(out.token_ids) == oracle[0][:len(out.token_ids)]
            if out.finished:
                final[out.request_id] = out
        engine.check_integrity()
        steps += 1
        assert steps < 2_000, "engine made no progress"
    assert verifier.lost and verifier.dropped >= 1, "the verifier was never lost"
    det_out, fast_out = final["det"], final["fast"]
    assert det_out.finish_reason == "error"
    assert len(det_out.token_ids) < DET.max_tokens
    assert signature(det_out)[1] == oracle[1][:len(det_out.token_ids)]
    if lose_after > 1:  # the lane had sent candidates out, none of them released
        assert candidates_at_loss > 0
    assert fast_out.finish_reason == "length" and len(fast_out.token_ids) == FAST.max_tokens
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1, "blocks leaked"
    stats = engine.stats()
    assert stats["lane_failures"] >= 1 and stats["lane_failed_requests"] == 1

    # while no verifier answers, a new deterministic request fails at once, cleanly
    engine.add_request("det-again", None, DET, prompt_token_ids=PROMPTS[0])
    outs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        step_outs, _ = _step(engine)
        outs += step_outs
        engine.check_integrity()
    assert [(o.request_id, o.finish_reason, o.token_ids) for o in outs] == [
        ("det-again", "error", [])]
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1, "blocks leaked"

    # a verifier again: a new deterministic request equals the oracle, beside a fast one
    verifier.restore()
    again = drive(engine, [Req(PROMPTS[0], DET), Req(PROMPTS[2], FAST, arrival=2)])
    assert signature(again[0]) == oracle and again[0].finish_reason == "length"
    assert again[1].finish_reason == "length"
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1, "blocks leaked"
    engine.close()


def test_fail_lane_keeps_an_aborted_requests_reason(model: str) -> None:
    """A deterministic request aborted while its window is in the lane ends "abort", not
    "error", when the lane is lost before that window comes back."""
    engine = _engine(model)
    verifier = engine.verifier
    assert isinstance(verifier, LosableVerifier)
    verifier.hold = True
    engine.add_request("det", None, DET, prompt_token_ids=PROMPTS[0])
    seq = engine._seqs["det"]
    while not seq.in_lane:
        engine.step()
    assert engine.abort_request("det")
    outs = engine.fail_lane("test verifier lost")
    assert [(o.request_id, o.finish_reason) for o in outs] == [("det", "abort")]
    assert not engine.has_unfinished_requests()
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1, "blocks leaked"
    engine.close()
