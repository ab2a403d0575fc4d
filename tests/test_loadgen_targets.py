"""Targets' timing and metric plumbing: the in-process engine target (driven by a toy
engine), the OpenAI HTTP target (against a toy SSE server), the gRPC stub loading, and a
whole run through run_benchmark."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeEngine
from fake_openai_server import running_server

from loadgen.runner import RunConfig, run_benchmark, save_result
from loadgen.targets import ReplayOptions, make_target
from loadgen.targets.engine import EngineTarget
from loadgen.trace import Trace, TraceRequest


def _reqs(n: int, *, out: int = 6, det_every: int = 2, gap: float = 0.0,
          logprobs: int | None = None) -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", f"prompt number {i}", 15, out, arrival_s=i * gap,
                         is_deterministic=i % det_every == 0, logprobs=logprobs)
            for i in range(n)]


class CountingEngine(FakeEngine):
    """Records the largest number of requests it held at once."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.max_running = 0

    def step(self) -> list[Any]:
        self.max_running = max(self.max_running, len(self._reqs))
        return super().step()


def test_engine_target_offline_replay() -> None:
    engine = FakeEngine(window=3, step_time_s=0.001)
    target = EngineTarget(engine)
    reqs = _reqs(6, out=7, logprobs=1)
    results = asyncio.run(target.replay(reqs, ReplayOptions()))
    assert [r.request_id for r in results] == [r.id for r in reqs]
    for req, res in zip(reqs, results, strict=True):
        assert res.success and res.output_len == 7 and res.finish_reason == "length"
        assert len(res.text) == 7 and res.token_ids is not None and len(res.token_ids) == 7
        assert res.logprobs is not None and len(res.logprobs) == 7
        assert 0 < res.ttft_s <= res.e2el_s
        assert len(res.itl_s) == len(res.chunk_tokens) - 1
        # deterministic requests commit windows of 3 (the last may be shorter)
        assert res.chunk_tokens == ([3, 3, 1] if req.is_deterministic else [1] * 7)
    stats = asyncio.run(target.server_stats())
    assert stats["committed_tokens"] == 42


def test_engine_target_honours_arrivals_and_concurrency() -> None:
    engine = CountingEngine(step_time_s=0.002)
    target = EngineTarget(engine)
    reqs = _reqs(8, out=4, gap=0.03)
    results = asyncio.run(target.replay(reqs, ReplayOptions(max_concurrency=2)))
    assert all(r.success for r in results)
    assert engine.max_running <= 2
    for req, res in zip(reqs, results, strict=True):
        assert res.start_s >= req.arrival_s - 1e-3


def test_engine_target_reports_rejected_requests() -> None:
    target = EngineTarget(FakeEngine())
    reqs = [TraceRequest("ok", "fine", 4, 3), TraceRequest("bad", "", 0, 3)]
    ok, bad = asyncio.run(target.replay(reqs, ReplayOptions()))
    assert ok.success and not bad.success and "rejected" in bad.error


def test_http_target_against_streaming_server(tmp_path: Path) -> None:
    reqs = _reqs(10, out=5, gap=0.01, logprobs=1)
    with running_server(FakeEngine(window=2, step_time_s=0.001)) as url:
        target = make_target(url)

        async def go() -> tuple[dict, list]:
            try:
                return await run_benchmark(target, Trace(tuple(reqs), {"traffic": {"qps": 100}}),
                                           RunConfig(progress=False), mode="fake", ratio=0.5)
            finally:
                await target.aclose()

        result, results = asyncio.run(go())
    assert result["completed"] == 10 and result["failed"] == 0
    assert result["total_output_tokens"] == 50 and result["num_deterministic"] == 5
    for req, res in zip(reqs, results, strict=True):
        assert res.output_len == 5 and len(res.text) == 5 and len(res.logprobs or []) == 5
        if req.is_deterministic:
            assert res.determinism == {"fingerprint": "fake-profile"}
            assert res.chunk_tokens == [2, 2, 1]
    assert result["determinism_profiles"] == ["fake-profile"]
    assert result["server_counters"]["committed_tokens"] == 50       # delta over the run
    assert result["server_stats"]["windows"] > 0
    assert result["labels"] == {"mode": "fake", "ratio": 0.5}
    path = save_result(result, tmp_path / "r.json")
    back = json.loads(path.read_text())
    assert back["completed"] == 10 and back["request_rate"] == 100


def test_http_target_error_paths() -> None:
    with running_server(FakeEngine()) as url:
        target = make_target(url, model="fake-model")
        bad = TraceRequest("e", "", 0, 3)          # the server answers 400
        nowhere = make_target("http://127.0.0.1:9/")   # nothing listens on port 9

        async def go() -> list:
            try:
                a = await target.replay([bad], ReplayOptions())
                b = await nowhere.replay([bad], ReplayOptions())
                return a + b
            finally:
                await target.aclose()
                await nowhere.aclose()

        served, refused = asyncio.run(go())
    assert not served.success and served.error.startswith("HTTP 400")
    assert not refused.success and refused.error


def test_http_payload_fields() -> None:
    from loadgen.targets.openai_http import OpenAIHTTPTarget

    req = TraceRequest("a", "hi", 1, 9, is_deterministic=True, seed=5, ignore_eos=True,
                       logprobs=2, prompt_token_ids=(7, 8))
    body = OpenAIHTTPTarget("http://x", send_token_ids=True).payload(req, "m")
    assert body["prompt"] == [7, 8] and body["max_tokens"] == 9 and body["seed"] == 5
    assert body["is_deterministic"] is True and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    chat = OpenAIHTTPTarget("http://x", api="chat", extra_fields=False).payload(req, "m")
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["logprobs"] is True and chat["top_logprobs"] == 2
    assert "is_deterministic" not in chat and "ignore_eos" not in chat


def test_grpc_target_explains_missing_stubs(monkeypatch: pytest.MonkeyPatch) -> None:
    from loadgen.targets import grpc_client

    monkeypatch.setattr(grpc_client, "STUB_MODULES", ("no_such_pkg.detserve_pb2",))
    with pytest.raises(RuntimeError, match="proto/gen.py"):
        make_target("grpc://127.0.0.1:50051")


def test_make_target_rejects_unknown() -> None:
    with pytest.raises(ValueError):
        make_target("ftp://x")


def test_http_replay_deadline_ends_an_overrunning_run_on_time() -> None:
    # slow steps: the first two requests are still streaming at the deadline, the last one
    # would be sent after it; all fail as timed out and the replay returns on time
    reqs = _reqs(3, out=16, gap=0.0)
    reqs[-1] = reqs[-1].with_(arrival_s=0.6)
    engine = FakeEngine(step_time_s=0.05)
    with running_server(engine) as url:
        async def go() -> tuple[list[Any], float]:
            target = make_target(url)
            t0 = time.perf_counter()
            try:
                results = await target.replay(reqs, ReplayOptions(deadline_s=0.4))
            finally:
                await target.aclose()
            took = time.perf_counter() - t0
            while engine.has_unfinished_requests():   # let the server finish what it holds
                await asyncio.sleep(0.05)
            return results, took

        results, took = asyncio.run(go())
    assert took < 1.5
    assert [r.success for r in results] == [False, False, False]
    assert all("timed out" in r.error for r in results)
    assert results[2].start_s >= 0.6   # sent at its arrival, failed at once
    with pytest.raises(ValueError):
        ReplayOptions(deadline_s=0.0)
    assert ReplayOptions(request_timeout_s=5.0, deadline_s=3.0).timeout_at(1.0) == 2.0
    assert ReplayOptions(request_timeout_s=5.0).timeout_at(100.0) == 5.0


def test_sharded_http_target_sends_from_several_processes_in_order() -> None:
    from loadgen.targets.sharded import ShardedHTTPTarget

    reqs = _reqs(7, out=5, gap=0.05, logprobs=1)
    with running_server(FakeEngine()) as url:
        async def go() -> tuple[list[Any], dict[str, float], list[str]]:
            target = ShardedHTTPTarget(url, 3)
            done: list[str] = []
            try:
                results = await target.replay(reqs, ReplayOptions(max_concurrency=4),
                                              on_done=lambda r: done.append(r.request_id))
                stats = await target.server_stats()
            finally:
                await target.aclose()
            return results, stats, done

        results, stats, done = asyncio.run(go())
    assert [r.request_id for r in results] == [r.id for r in reqs] and sorted(done) == sorted(
        r.id for r in reqs)
    assert all(r.success and r.output_len == 5 and len(r.logprobs or []) == 5 for r in results)
    # every request was sent at its arrival offset from the common start
    for req, res in zip(reqs, results, strict=True):
        assert req.arrival_s - 0.01 <= res.start_s <= req.arrival_s + 0.5
        assert res.is_deterministic == req.is_deterministic
    assert stats["committed_tokens"] == 35
    with pytest.raises(ValueError):
        ShardedHTTPTarget("http://127.0.0.1:1", 0)
