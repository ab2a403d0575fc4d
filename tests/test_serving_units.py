"""Serving pieces without Ray: stream deltas, the engine loop, routing bookkeeping, replay,
admission, request preparation and the serve-config extension."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from serving_cluster import tiny_model

from detserve.engine import LLMEngine
from detserve.output_processor import DeltaCursor
from detserve.outputs import RequestOutput, TokenLogprob
from detserve.params import SamplingParams
from detserve.verifier import LaneUnavailable
from services.affinity import prefix_keys
from services.decoder.engine_loop import EngineLoop
from services.decoder.messages import DecodeChunk, DecodeRequest, coalesce
from services.router.admission import Admission
from services.router.errors import MAX_MESSAGE_CHARS, APIError
from services.router.http_app import build_http_app, parse_json_object
from services.router.limits import ServingLimits
from services.router.load_ledger import TokenLedger
from services.router.model_context import ModelContext
from services.router.prepare import prepare_chat, prepare_completion
from services.router.replay import ReplayDiverged, SentState
from services.router.schemas import ChatCompletionRequest, CompletionRequest
from services.router.service import RouterService
from services.serve_config import DEFAULT_ARGS, default_serve_config


def _out(cursor: DeltaCursor, text: str, ids: list[int],
         finished: bool = False) -> tuple[str, tuple[int, ...], tuple[TokenLogprob, ...] | None]:
    d = cursor.advance(text, ids, [TokenLogprob(t, -0.5) for t in ids], finished)
    return d.text, d.token_ids, d.logprobs


# ---- deltas ---------------------------------------------------------------------------
def test_deltas_hold_back_partial_characters_and_stop_prefixes() -> None:
    t = DeltaCursor(stop=("END",))
    assert _out(t, "ab\ufffd", [1, 2]) == ("a", (1, 2), (TokenLogprob(1, -0.5),
                                                         TokenLogprob(2, -0.5)))
    text, ids, _ = _out(t, "abcdE", [1, 2, 3])
    assert (text, ids) == ("bc", (3,))  # "dE" may start "END"
    text, ids, _ = _out(t, "abcd", [1, 2, 3, 4], finished=True)
    assert (text, ids) == ("d", (4,))


def test_engine_loop_streams_exactly_the_engine_output() -> None:
    engine = LLMEngine.from_args(tiny_model(), "llm42", verify_window=8, verify_group=4,
                                 max_model_len=256, fastpath_perturbation=0.3)
    loop = EngineLoop(engine, "test")
    loop.start()
    done = threading.Event()
    chunks: dict[str, list[DecodeChunk]] = {"a": [], "b": []}

    def sink(chunk: DecodeChunk) -> None:
        chunks[chunk.request_id].append(chunk)
        if all(c and c[-1].finished for c in chunks.values()):
            done.set()

    params = SamplingParams(max_tokens=20, is_deterministic=True, logprobs=0, ignore_eos=True)
    loop.submit(DecodeRequest("a", (5, 6, 7, 8), params), sink)
    loop.submit(DecodeRequest("b", (9, 10), SamplingParams(max_tokens=5, ignore_eos=True)), sink)
    assert done.wait(60)
    loop.stop()
    a = chunks["a"]
    assert sum(len(c.token_ids) for c in a) == 20 == a[-1].num_output_tokens
    assert len([lp for c in a for lp in c.logprobs or ()]) == 20
    assert a[-1].determinism and a[-1].determinism["fingerprint"]
    ids = [t for c in a for t in c.token_ids]
    assert "".join(c.text for c in a) == engine.tokenizer.decode(ids)
    assert chunks["b"][-1].determinism is None and loop.outstanding_tokens == 0
    # each finished request's time to first token, split on one monotonic clock
    timings = {t.request_id: t for t in loop.timings()}
    assert set(timings) == {"a", "b"}
    for t in timings.values():
        assert t.first_token is not None and t.received <= t.arrival <= t.first_token
        assert t.accepted == t.dispatched == 0.0  # submitted here, not by a router
    assert loop.timings(since=time.monotonic()) == []


def test_split_ttft_medians_and_spread() -> None:
    """Served TTFT split into its parts: client -> decoder, queue, engine, back."""
    from benchmarks.bench_serving_overhead import ClientTiming, split_ttft
    from services.decoder.engine_loop import RequestTiming

    client = [ClientTiming(10.0, 10.050, "x-0"), ClientTiming(10.010, 10.090, "y-0"),
              ClientTiming(10.020, 10.5, "lost-0")]
    server = {"x-0": RequestTiming("x-0", 10.0005, 10.001, 10.004, 10.005, 10.045),
              "y-0": RequestTiming("y-0", 10.012, 10.014, 10.020, 10.030, 10.080)}
    sp = split_ttft(client, server)
    assert sp["requests"] == 2  # a request the decoder did not report is left out
    assert sp["to_router_ms"] == pytest.approx(1.25)     # median of 0.5 and 2
    assert sp["router_ms"] == pytest.approx(1.25)        # of 0.5 and 2
    assert sp["to_decoder_ms"] == pytest.approx(4.5)     # of 3 and 6
    assert sp["engine_queue_ms"] == pytest.approx(5.5)   # of 1 and 10
    assert sp["engine_ttft_ms"] == pytest.approx(45.0)   # of 40 and 50
    assert sp["back_ms"] == pytest.approx(7.5)           # of 5 and 10
    assert sp["dispatch_spread_s"] == pytest.approx(0.020)
    assert split_ttft(client[2:], server) == {}


def test_router_loop_lag_histogram_parsed() -> None:
    from prometheus_client import generate_latest

    from benchmarks.bench_serving_overhead import parse_router_lag
    from services.router.metrics import RouterMetrics

    m = RouterMetrics()
    for lag in (0.002, 0.03, 0.2):
        m.loop_lag.observe(lag)
    count, total, on_time = parse_router_lag(generate_latest(m.registry).decode())
    assert (count, on_time) == (3, 2) and total == pytest.approx(0.232)
    assert parse_router_lag("") == (0.0, 0.0, 0.0)


def test_engine_loop_delivers_each_step_in_one_batch() -> None:
    """Every chunk arrives, in order per request, and the chunks of one step come in one
    ``deliver`` call (the deployment turns it into one event-loop wake-up)."""
    engine = LLMEngine.from_args(tiny_model(), "nondeterministic", max_model_len=256)
    batches: list[list[tuple[object, DecodeChunk]]] = []
    done = threading.Event()

    def deliver(batch: list[tuple[object, DecodeChunk]]) -> None:
        batches.append(batch)
        if sum(c.finished for b in batches for _, c in b) == 4:
            done.set()

    loop = EngineLoop(engine, "test", deliver=deliver)
    sinks = {rid: object() for rid in "abcd"}
    for i, rid in enumerate("abcd"):
        loop.submit(DecodeRequest(rid, (5 + i, 6, 7), SamplingParams(max_tokens=12,
                                                                     ignore_eos=True)),
                    sinks[rid])  # type: ignore[arg-type]
    loop.start()  # all four are queued before the first step: they decode together
    assert done.wait(60)
    loop.stop()
    chunks = [(sink, c) for b in batches for sink, c in b]
    assert all(sink is sinks[c.request_id] for sink, c in chunks)
    for rid in "abcd":
        mine = [c for _, c in chunks if c.request_id == rid]
        assert sum(len(c.token_ids) for c in mine) == 12 and mine[-1].finished
        assert [c.num_output_tokens for c in mine] == sorted(c.num_output_tokens for c in mine)
    assert max(len(b) for b in batches) == 4 and len(batches) < len(chunks) / 2


def _run_loop(stream_interval: int, max_tokens: int) -> list[DecodeChunk]:
    """One greedy request through an EngineLoop; its chunks in order."""
    engine = LLMEngine.from_args(tiny_model(), "nondeterministic", max_model_len=256)
    chunks: list[DecodeChunk] = []
    done = threading.Event()

    def sink(chunk: DecodeChunk) -> None:
        chunks.append(chunk)
        if chunk.finished:
            done.set()

    loop = EngineLoop(engine, "test", stream_interval=stream_interval)
    loop.submit(DecodeRequest("r", (5, 6, 7), SamplingParams(max_tokens=max_tokens,
                                                             ignore_eos=True)), sink)
    loop.start()
    assert done.wait(60)
    loop.stop()
    return chunks


def test_stream_interval_gathers_tokens_without_changing_the_stream() -> None:
    """stream_interval=4: the first token goes out alone, then chunks of 4, the rest with
    the final chunk; ids, logprobs and text equal the every-step stream's."""
    every = _run_loop(1, 11)
    gathered = _run_loop(4, 11)
    assert [len(c.token_ids) for c in every] == [1] * 11
    assert [len(c.token_ids) for c in gathered] == [1, 4, 4, 2]
    assert gathered[-1].finished and not any(c.finished for c in gathered[:-1])
    for field in ("token_ids", "text"):
        assert [x for c in gathered for x in getattr(c, field)] == \
            [x for c in every for x in getattr(c, field)]
    with pytest.raises(ValueError, match="stream_interval"):
        EngineLoop(LLMEngine.from_args(tiny_model(), "nondeterministic", max_model_len=256),
                   "test", stream_interval=0)


def test_a_link_backlog_is_coalesced_per_request_in_order() -> None:
    from services.decoder.messages import coalesce_by_request

    a1 = DecodeChunk("a", "d", text="x", token_ids=(1,), num_output_tokens=1)
    b1 = DecodeChunk("b", "d", text="p", token_ids=(7,), num_output_tokens=1)
    a2 = DecodeChunk("a", "d", text="y", token_ids=(2,), num_output_tokens=2, finished=True,
                     finish_reason="length")
    b2 = DecodeChunk("b", "d", text="q", token_ids=(8,), num_output_tokens=2)
    merged = coalesce_by_request([a1, b1, a2, b2])
    assert [(c.request_id, c.text, c.token_ids, c.finished) for c in merged] == [
        ("a", "xy", (1, 2), True), ("b", "pq", (7, 8), False)]


def test_coalesced_chunks_carry_the_same_stream() -> None:
    lp = [TokenLogprob(t, -0.5 * t) for t in range(4)]
    parts = [DecodeChunk("r", "d", text="he", token_ids=(0,), logprobs=(lp[0],),
                         num_output_tokens=1),
             DecodeChunk("r", "d", text="", token_ids=(1, 2), logprobs=(lp[1], lp[2]),
                         num_output_tokens=3, engine_stats={"steps": 3.0}),
             DecodeChunk("r", "d", text="llo", token_ids=(3,), logprobs=(lp[3],),
                         num_output_tokens=4, finished=True, finish_reason="length",
                         determinism={"fingerprint": "x"})]
    (one,) = coalesce(parts)
    assert one.text == "hello" and one.token_ids == (0, 1, 2, 3) and one.logprobs == tuple(lp)
    assert one.finished and one.finish_reason == "length" and one.num_output_tokens == 4
    assert one.determinism == {"fingerprint": "x"} and one.engine_stats == {"steps": 3.0}
    # without logprobs they stay None; an error chunk is not merged into the progress
    failed = DecodeChunk("r", "d", finished=True, error="boom", error_type="server_error")
    plain = [replace(c, logprobs=None, finished=False) for c in parts[:2]]
    merged, err = coalesce([*plain, failed])
    assert merged.logprobs is None and merged.token_ids == (0, 1, 2) and not merged.finished
    assert err is failed
    assert coalesce([parts[0]]) == [parts[0]]


def test_engine_loop_fails_streams_when_the_engine_fails() -> None:
    engine = LLMEngine.from_args(tiny_model(), "nondeterministic", max_model_len=256)
    loop = EngineLoop(engine, "test")

    def broken() -> list[RequestOutput]:
        raise RuntimeError("boom")

    engine.step = broken  # type: ignore[method-assign]
    got: list[DecodeChunk] = []
    loop.start()
    loop.submit(DecodeRequest("x", (1, 2), SamplingParams()), got.append)
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got and got[0].error_type == "server_error" and "boom" in (got[0].error or "")
    assert not loop.healthy
    loop.submit(DecodeRequest("y", (1, 2), SamplingParams()), got.append)
    assert got[-1].request_id == "y" and got[-1].is_error


def test_engine_loop_ends_only_deterministic_streams_when_verification_is_lost() -> None:
    engine = LLMEngine.from_args(tiny_model(), "llm42", max_model_len=256, verify_window=8,
                                 verify_group=4)
    loop = EngineLoop(engine, "test")
    step, steps = engine.step, [0]

    def step_losing_the_lane_once() -> list[RequestOutput]:
        steps[0] += 1
        if steps[0] == 4:
            raise LaneUnavailable("no usable verifier (test)")
        return step()

    engine.step = step_losing_the_lane_once  # type: ignore[method-assign]
    got: dict[str, list[DecodeChunk]] = {"d": [], "n": [], "d2": []}
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    loop.start()
    loop.submit(DecodeRequest("d", (5, 6, 7), replace(params, is_deterministic=True)),
                got["d"].append)
    loop.submit(DecodeRequest("n", (5, 6, 7), params), got["n"].append)
    deadline = time.monotonic() + 30
    while not (got["d"] and got["d"][-1].finished and got["n"] and got["n"][-1].finished):
        assert time.monotonic() < deadline, got
        time.sleep(0.01)
    loop.submit(DecodeRequest("d2", (5, 6, 7), replace(params, is_deterministic=True)),
                got["d2"].append)
    while not (got["d2"] and got["d2"][-1].finished):
        assert time.monotonic() < deadline, got
        time.sleep(0.01)
    loop.stop()
    last = got["d"][-1]
    assert last.error_type == "verifier_unavailable" and last.finish_reason == "error"
    assert last.error == "verification unavailable: no usable verifier (test)"
    assert sum(len(c.token_ids) for c in got["d"]) < params.max_tokens
    for rid in ("n", "d2"):
        assert not any(c.is_error for c in got[rid]) and got[rid][-1].finish_reason == "length"
        assert sum(len(c.token_ids) for c in got[rid]) == params.max_tokens
    assert loop.healthy and engine.stats()["lane_failed_requests"] == 1


def test_engine_loop_refuses_invalid_requests_with_an_error_chunk() -> None:
    loop = EngineLoop(LLMEngine.from_args(tiny_model(), "llm42", max_model_len=256,
                                          verify_window=8, verify_group=4), "test")
    loop.start()
    got: list[DecodeChunk] = []
    loop.submit(DecodeRequest("x", (10**6,), SamplingParams()), got.append)
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop()
    assert got[0].error_type == "invalid_request" and loop.healthy


# ---- router bookkeeping ---------------------------------------------------------------
def test_ledger_ranks_by_outstanding_tokens_and_prefers_prefix_holder() -> None:
    ledger = TokenLedger(affinity_slack_tokens=100)
    ledger.routed("r1", "A", 500)
    assert ledger.rank(["A", "B"])[0] == "B"
    keys = prefix_keys(list(range(40)))
    ledger.routed("r2", "B", 450, keys)
    assert ledger.rank(["A", "B"], keys)[0] == "B"      # within the slack: affinity wins
    ledger.routed("r3", "B", 200)
    assert ledger.rank(["A", "B"], keys)[0] == "A"      # too loaded: least tokens wins
    ledger.completed("r3")
    ledger.completed("r1")
    ledger.check_integrity()
    assert (ledger.load("A"), ledger.load("B")) == (0, 450)
    ledger.forget("B")
    assert ledger.rank(["A", "C"], keys) in (["A", "C"], ["C", "A"])
    ledger.check_integrity()


def test_sent_state_drops_replayed_prefix_and_detects_divergence() -> None:
    sent = SentState()
    sent.new_part(DecodeChunk("r", "d0", text="hel", token_ids=(1, 2)))
    sent.restart()
    part = sent.new_part(DecodeChunk("r", "d1", text="hello", token_ids=(1, 2, 3),
                                     logprobs=(TokenLogprob(1, 0.0), TokenLogprob(2, 0.0),
                                               TokenLogprob(3, -1.0))))
    assert (part.text, part.token_ids, part.logprobs) == ("lo", (3,), (TokenLogprob(3, -1.0),))
    sent.restart()
    with pytest.raises(ReplayDiverged):
        sent.new_part(DecodeChunk("r", "d2", text="hex", token_ids=(1, 9)))


def test_sent_state_replay_overlap_spans_several_chunks() -> None:
    """A replay's chunks are cut elsewhere than the first attempt's: what the client has
    is dropped across chunk boundaries, the rest goes out once, logprobs with their tokens."""
    lp = {t: TokenLogprob(t, -0.1 * t) for t in range(1, 6)}
    sent = SentState()
    sent.new_part(DecodeChunk("r", "d0", text="ab", token_ids=(1,), logprobs=(lp[1],)))
    sent.new_part(DecodeChunk("r", "d0", text="cd", token_ids=(2, 3), logprobs=(lp[2], lp[3])))
    sent.restart()
    parts = [sent.new_part(DecodeChunk("r", "d1", text=t, token_ids=ids,
                                       logprobs=tuple(lp[i] for i in ids)))
             for t, ids in (("a", (1,)), ("bc", (2,)), ("def", (3, 4)), ("g", (5,)))]
    assert [(p.text, p.token_ids) for p in parts] == [("", ()), ("", ()), ("ef", (4,)),
                                                      ("g", (5,))]
    assert parts[2].logprobs == (lp[4],) and parts[3].logprobs == (lp[5],)
    assert (sent.text, sent.token_ids) == ("abcdefg", [1, 2, 3, 4, 5])
    sent.restart()
    with pytest.raises(ReplayDiverged, match="text differs at offset 0"):
        sent.new_part(DecodeChunk("r", "d2", text="aX", token_ids=(1,)))


def test_admission_sheds_above_the_bound() -> None:
    adm = Admission(3, retry_after_s=2)
    slot = adm.acquire(2)
    with pytest.raises(APIError) as info:
        adm.acquire(2)
    assert info.value.status == 429 and info.value.headers == {"Retry-After": "2"}
    slot.release()
    slot.release()  # idempotent
    adm.acquire(3)
    assert adm.active == 3 and adm.shed == 1


# ---- request preparation --------------------------------------------------------------
@pytest.fixture(scope="module")
def ctx() -> ModelContext:
    return ModelContext.load(tiny_model(), max_model_len=64)


def _completion(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": tiny_model(), "prompt": "hi", **kw})


def test_completion_choices_cover_prompts_times_n(ctx: ModelContext) -> None:
    limits = ServingLimits(max_model_len=64)
    job = prepare_completion(_completion(prompt=["a", "b"], n=2, seed=5, temperature=0.5),
                             ctx, limits)
    assert len(job.choices) == 4 and job.n == 2
    assert [c.params.seed for c in job.choices] == [5, 6, 5, 6]
    assert job.prompt_tokens == sum(len(c.prompt_token_ids) for c in job.choices[::2])
    assert job.choices[0].prompt_token_ids == tuple(ctx.tokenizer.encode("a", True))
    stamped = job.accepted_at(12.5)  # every choice carries when the router got the request
    assert [c.accepted for c in stamped.choices] == [12.5] * 4
    assert [c.accepted for c in job.choices] == [0.0] * 4
    assert [replace(c, accepted=0.0) for c in stamped.choices] == list(job.choices)


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 64}, "max_tokens"),          # prompt + max_tokens > context
    ({"prompt": [[1], [2]], "n": 3}, "n"),       # more choices than allowed
    ({"suffix": "!"}, "suffix"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt": []}, "prompt"),
    ({"top_k": -2}, "top_k"),
])
def test_completion_refusals_name_the_field(ctx: ModelContext, fields: dict[str, Any],
                                            param: str) -> None:
    limits = ServingLimits(max_model_len=64, max_choices=4, max_n=4, max_prompts=2)
    with pytest.raises(APIError) as info:
        prepare_completion(_completion(**fields), ctx, limits)
    assert info.value.status == 400 and info.value.param == param


def test_chat_defaults_max_tokens_to_the_remaining_context(ctx: ModelContext) -> None:
    req = ChatCompletionRequest.model_validate(
        {"model": tiny_model(), "messages": [{"role": "user", "content": "hi"}],
         "logprobs": True, "top_logprobs": 2})
    job = prepare_chat(req, ctx, ServingLimits(max_model_len=64))
    (choice,) = job.choices
    assert len(choice.prompt_token_ids) + choice.params.max_tokens == 64
    assert job.top_logprobs == 2 and choice.params.logprobs == 2


# ---- hostile input ----------------------------------------------------------------------
@pytest.mark.parametrize("body, says", [
    (b'{"prompt": "\\ud800"}', "surrogate"),                      # lone surrogate escape
    (b'{"messages": [{"role": "user", "content": "a\\udc80"}]}', "surrogate"),
    (b'{"logit_bias": {"\\udfff": 1}}', "surrogate"),             # ... in a key
    (b'{"temperature": NaN}', "NaN"),
    (b'{"logit_bias": {"5": -Infinity}}', "Infinity"),
    (b'{"temperature": 1e400}', "float range"),                  # overflows to inf
    (b'{"seed": ' + b"9" * 5000 + b"}", "malformed"),             # too long for int()
    (b'{"prompt": "caf\xe9"}', "UTF-8"),                          # Latin-1, not UTF-8
    ('{"prompt": "x"}'.encode("utf-16"), "UTF-8"),
    (b"\xef\xbb\xbf{}", "malformed"),                             # a byte-order mark
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested"),
    (b"[1, 2]", "JSON object"),
])
def test_hostile_json_bodies_are_refused_with_400(body: bytes, says: str) -> None:
    with pytest.raises(APIError) as info:
        parse_json_object(body)
    assert info.value.status == 400 and says in info.value.message, info.value.message


def test_json_bodies_keep_surrogate_pairs_and_big_finite_numbers() -> None:
    body = parse_json_object(b'{"prompt": "\\ud83d\\ude00", "seed": 18446744073709551616, '
                             b'"top_p": 1e308}')
    assert body == {"prompt": "\U0001f600", "seed": 2**64, "top_p": 1e308}


@pytest.fixture(scope="module")
def http(ctx: ModelContext) -> Any:
    from fastapi.testclient import TestClient

    # no decoder: every request here is refused or fails before one is asked
    no_decoder = SimpleNamespace(options=lambda **_: SimpleNamespace())
    no_links: Any = SimpleNamespace(attached=[])
    service = RouterService(ctx, ServingLimits(max_model_len=64), no_decoder, no_links)
    return TestClient(build_http_app(service), raise_server_exceptions=False)


@pytest.mark.parametrize("path, body, content_type, status", [
    ("/v1/completions", '{"model": "M", "prompt": "\\ud800"}', "application/json", 400),
    ("/v1/chat/completions", '{"model": "M", "messages": [{"role": "user", '
     '"content": "\\ud800"}]}', "application/json", 400),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "x"}', "application/json", 400),
    ("/v1/completions", '{"model": "M", "prompt": "x", "logit_bias": {"\\u00b2": 1}}',
     "application/json", 400),                                   # "²".isdigit() is True
    ("/v1/completions", '{"model": "M", "prompt": "x"}', "text/plain", 415),
    ("/v1/completions", '{"model": "M", "prompt": "x"}', "application/x-www-form-urlencoded",
     415),
    ("/v1/completions", '{"model": "' + "m" * 5000 + '", "prompt": "x"}', "application/json",
     404),
])
def test_http_refusals_carry_an_openai_error_body(http: Any, path: str, body: str,
                                                  content_type: str, status: int) -> None:
    resp = http.post(path, content=body.replace('"M"', f'"{tiny_model()}"'),
                     headers={"content-type": content_type})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert 0 < len(error["message"]) <= MAX_MESSAGE_CHARS + 3  # client values are cut


def test_a_server_fault_is_a_500_with_an_openai_error_body(
        http: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(_: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(RouterService, "open", lambda self, job: broken(job))
    resp = http.post("/v1/completions", json={"model": tiny_model(), "prompt": "hi"})
    assert resp.status_code == 500
    assert resp.json()["error"]["type"] == "server_error"


def test_undecodable_grpc_requests_are_invalid_argument(ctx: ModelContext) -> None:
    """The registered deserializers hand bytes that are no message to the servicer, which
    refuses them (a deserializer that raised would make gRPC answer UNKNOWN)."""
    import grpc

    from services.router import detserve_pb2 as pb
    from services.router.grpc_api import (
        Undecodable,
        add_CompletionsServicer_to_server,
        job_from_proto,
        status_code,
    )

    class Server:
        handlers: dict[str, Any] = {}

        def add_generic_rpc_handlers(self, _: Any) -> None:
            pass

        def add_registered_method_handlers(self, _: str, handlers: dict[str, Any]) -> None:
            self.handlers = handlers

    server = Server()
    add_CompletionsServicer_to_server(SimpleNamespace(Generate=None, Health=None), server)
    parse = server.handlers["Generate"].request_deserializer
    good = pb.GenerateRequest(prompt="hi", max_tokens=2)
    assert parse(good.SerializeToString()) == good
    for data in (b"\x12\x03a\xffb",          # prompt: invalid UTF-8
                 b"\x12\x03\xed\xa0\x80",    # prompt: an encoded surrogate
                 b"\x12\x7fab",              # prompt: longer than the message
                 b"\x30" + b"\xff" * 10):    # max_tokens: a varint of 11 bytes
        req = parse(data)
        assert isinstance(req, Undecodable)
        with pytest.raises(APIError) as info:
            job_from_proto(req, ctx, ServingLimits(max_model_len=64))
        assert status_code(info.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(server.handlers["Health"].request_deserializer(b"\xff"), Undecodable)


# ---- serve config ---------------------------------------------------------------------
def test_dispatch_paths_and_attached_links_parsed() -> None:
    from prometheus_client import generate_latest

    from benchmarks.bench_serving_overhead import _link_share, parse_dispatch
    from services.router.metrics import RouterMetrics

    m = RouterMetrics()
    m.dispatch.labels("link").inc(5)
    m.dispatch.labels("handle").inc(2)
    m.links.set(2)
    after = parse_dispatch(generate_latest(m.registry).decode())
    assert after == (5.0, 2.0, 2.0)
    assert _link_share((1.0, 2.0, 2.0), after) == 1.0  # the phase's sequences all by link
    assert parse_dispatch("") == (0.0, 0.0, 0.0)


def test_the_link_is_the_only_transport_and_no_arg_or_flag_turns_it_off() -> None:
    from services.console import build_parser

    with pytest.raises(ValueError, match="decoder_link"):
        default_serve_config(decoder_link=False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--no-decoder-link"])


def test_decode_request_affinity_is_its_prefix_keys_once_and_survives_pickling() -> None:
    import pickle

    prompt = tuple(range(3, 40))
    det = DecodeRequest("d", prompt, SamplingParams(is_deterministic=True, seed=1))
    assert det.affinity == tuple(prefix_keys(prompt)) and len(det.affinity) == 2
    assert det.affinity is det.affinity  # hashed once per request object
    assert pickle.loads(pickle.dumps(det)).affinity == det.affinity
    assert DecodeRequest("n", prompt, SamplingParams()).affinity == ()


def test_verifier_confine_is_an_optional_flag_and_picks_mps_or_a_green_context(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The verifier's lane takes the whole GPU unless asked to confine itself: then under MPS
    the thread percentage caps it (no green context), without MPS a green context does."""
    from services.cli import serve_config_from
    from services.console import build_parser
    from services.verifier.deployment import limit_sms

    assert "verifier_confine" not in default_serve_config()["applications"][0]["args"]
    with pytest.raises(ValueError, match="verifier_confine"):
        default_serve_config(verifier_confine=1)
    a = build_parser().parse_args(["serve", "--device", "cuda", "--verifier-confine"])
    assert serve_config_from(a, "redis://127.0.0.1:1/0")["applications"][0]["args"][
        "verifier_confine"] is True
    from services.app import _decoder, _verifier

    def bound(app: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        b = app._bound_deployment  # (Ray Serve's Application keeps its deployment's args)
        return b.init_kwargs, b.ray_actor_options

    for green in (False, True):  # decoder and verifier split the GPU; the flag reaches it
        args = default_serve_config(device="cuda", verifier_gpu_fraction=0.25,
                                    verifier_confine=green)["applications"][0]["args"]
        kwargs, options = bound(_verifier(args, 1.0))
        assert kwargs["sm_fraction"] == 0.25 and kwargs["confine"] is green
        assert options["num_gpus"] == 0.25
        assert _decoder(args, 1.0).ray_actor_options["num_gpus"] == 0.75
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "no-daemon"))
    # (set, so that the value limit_sms writes is undone after the test like this one)
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "not set by limit_sms")
    assert limit_sms("cuda:0", 0.5) is None  # time-sliced: the whole GPU
    assert callable(limit_sms("cuda:0", 0.5, confine=True))  # (CUDA untouched)
    assert limit_sms("cpu", 0.5, confine=True) is None
    assert limit_sms("cuda:0", 1.0, confine=True) is None
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))  # a daemon's pipe dir
    assert limit_sms("cuda:0", 0.25) is None  # MPS, not confined: the whole GPU, no cap
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "not set by limit_sms"
    assert limit_sms("cuda:0", 0.25, confine=True) is None
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


def test_fastpath_perturbation_is_an_optional_validated_arg() -> None:
    assert "fastpath_perturbation" not in default_serve_config()["applications"][0]["args"]
    args = default_serve_config(fastpath_perturbation=0.25)["applications"][0]["args"]
    assert args["fastpath_perturbation"] == 0.25 and list(args)[:-1] == list(DEFAULT_ARGS)
    for bad in (-0.1, 1.5, "x"):
        with pytest.raises(ValueError, match="fastpath_perturbation"):
            default_serve_config(fastpath_perturbation=bad)


def test_serve_command_builds_the_shared_config() -> None:
    from services.cli import serve_config_from
    from services.console import build_parser

    a = build_parser().parse_args(["serve", "--num-decoders", "2", "-W", "16", "-G", "4",
                                   "--fastpath-perturbation", "0.1", "--port", "8080"])
    config = serve_config_from(a, "redis://127.0.0.1:1/0")
    args = config["applications"][0]["args"]
    assert (args["num_decoders"], args["verify_window"], args["verify_group"]) == (2, 16, 4)
    assert args["fastpath_perturbation"] == 0.1 and args["redis_url"] == "redis://127.0.0.1:1/0"
    assert config["http_options"]["port"] == 8080 == args["http_port"]
    assert config == default_serve_config(http_host="0.0.0.0", **args)


def test_random_shape_models_load_everywhere_a_model_spec_goes() -> None:
    """``random:<shape>``: the engine, the verifier and the router all accept it (the router
    only needs the tokenizer); the same spec gives the same weights every time."""
    import torch

    from detserve.model.loader import load_model

    m1, tok, info = load_model("random:tiny")
    m2, _, _ = load_model("random:tiny")
    assert info.weights_hash == "random-seed0" and m1.config.vocab_size == 512
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters(), strict=True))
    ctx = ModelContext.load("random:tiny", 256)
    assert ctx.serves("random:tiny") and not ctx.serves("tiny")
    assert ctx.tokenizer.encode("t5 t6 t7", add_special_tokens=True) == [5, 6, 7]
    assert tok.decode([5, 6]) == ctx.tokenizer.decode([5, 6])
    with pytest.raises(ValueError, match="unknown shape"):
        load_model("random:llama9-1t")
    with pytest.raises(ValueError, match="random:<shape>"):
        load_model("not-a-model")


def test_serve_waits_for_a_signal_without_locking_in_the_handler() -> None:
    """`detserve serve` blocks in _wait_for_signal until SIGINT/SIGTERM. A burst of signals
    (Ctrl-C pressed while `timeout` forwards one too) must end it promptly: a handler that
    set a threading.Event could deadlock against the Event.wait it interrupted."""
    import signal
    import subprocess
    import sys

    code = ("from services.cli import _stop_signals, _wait_for_signal; r = _stop_signals(); "
            "print('ready', flush=True); print(_wait_for_signal(r, 0.05), flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for _ in range(50):
            proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0 and out.strip() == str(int(signal.SIGINT))
    finally:
        proc.kill()


@pytest.mark.parametrize("name", ["pipeline_lane_prefill", "lane_partial_windows"])
def test_scheduler_switch_reaches_the_decoders_engine(name: str) -> None:
    """On by default; ``detserve serve --no-pipeline-lane-prefill`` (or
    ``--no-lane-partial-windows``) turns it off in the app args, the decoder's settings and
    its engine config; anything but a bool is refused."""
    from services.cli import serve_config_from
    from services.console import build_parser
    from services.decoder.engine_factory import DecoderSettings

    parse = build_parser().parse_args
    on = serve_config_from(parse(["serve"]), "redis://127.0.0.1:1/0")["applications"][0]["args"]
    assert name not in on
    assert getattr(DecoderSettings.from_args(on).engine.scheduler, name) is True
    flag = "--no-" + name.replace("_", "-")
    off = serve_config_from(parse(["serve", flag]),
                            "redis://127.0.0.1:1/0")["applications"][0]["args"]
    assert off[name] is False
    assert getattr(DecoderSettings.from_args(off).engine.scheduler, name) is False
    for bad in (0, "no", None):
        with pytest.raises(ValueError, match=name):
            default_serve_config(**{name: bad})


@pytest.mark.parametrize("name", ["lane_bound_fraction", "parked_seq_headroom"])
def test_scheduler_fraction_reaches_the_decoders_engine(name: str) -> None:
    """``detserve serve --lane-bound-fraction F`` (the decoder engine's yield threshold) and
    ``--parked-seq-headroom F`` (the batch slots parked lane sequences lend) set the
    decoder engine's scheduler (default: the engine's); values outside [0, 1] or not
    numbers are refused."""
    from detserve.config import SchedulerConfig
    from services.cli import serve_config_from
    from services.console import build_parser
    from services.decoder.engine_factory import DecoderSettings

    parse = build_parser().parse_args
    plain = serve_config_from(parse(["serve"]), "redis://127.0.0.1:1/0")["applications"][0]["args"]
    assert name not in plain
    assert (getattr(DecoderSettings.from_args(plain).engine.scheduler, name)
            == getattr(SchedulerConfig, name))
    flag = "--" + name.replace("_", "-")
    set_ = serve_config_from(parse(["serve", flag, "0.6"]),
                             "redis://127.0.0.1:1/0")["applications"][0]["args"]
    assert set_[name] == 0.6
    assert getattr(DecoderSettings.from_args(set_).engine.scheduler, name) == 0.6
    for bad in (-0.1, 1.5, "half", None, True, float("nan")):
        with pytest.raises(ValueError, match=name):
            default_serve_config(**{name: bad})


@pytest.mark.parametrize(("name", "value", "default", "bad"), [
    ("prefill_batch_tokens", 256, None, (-1, 1 << 20, "many", None, True, 2.5)),
    ("lane_prefill_ahead", 3, 8, (-1, 1 << 20, "some", None, True, 2.5)),
    ("lane_prefill_lookahead", 4096, 32, (0, -1, 1 << 21, "all", None, True, 2.5)),
])
def test_scheduler_count_reaches_the_decoders_engine(name: str, value: int, default: int | None,
                                                     bad: tuple[object, ...]) -> None:
    """``detserve serve --prefill-batch-tokens N`` (how many new prompt tokens a decoder
    waits for; absent: the engine picks by device, 0 on CPU), ``--lane-prefill-ahead N``
    (queued deterministic prompts a lane pass's spare rows may take) and
    ``--lane-prefill-lookahead N`` (how far into the queue) set the decoder engine's
    scheduler; bad values are refused."""
    from services.cli import serve_config_from
    from services.console import build_parser
    from services.decoder.engine_factory import DecoderSettings

    parse = build_parser().parse_args
    plain = serve_config_from(parse(["serve"]), "redis://127.0.0.1:1/0")["applications"][0]["args"]
    assert name not in plain
    assert getattr(DecoderSettings.from_args(plain).engine.scheduler, name) == default
    flag = "--" + name.replace("_", "-")
    set_ = serve_config_from(parse(["serve", flag, str(value)]),
                             "redis://127.0.0.1:1/0")["applications"][0]["args"]
    assert set_[name] == value
    assert getattr(DecoderSettings.from_args(set_).engine.scheduler, name) == value
    for v in bad:
        with pytest.raises(ValueError, match=name):
            default_serve_config(**{name: v})


def test_switch_interval_reaches_the_decoder_settings() -> None:
    """``detserve serve --switch-interval S`` lands in the decoder's settings (0: Python's
    own); negative, huge or non-numeric values are refused."""
    from services.cli import serve_config_from
    from services.console import build_parser
    from services.decoder.engine_factory import DecoderSettings

    parse = build_parser().parse_args
    plain = serve_config_from(parse(["serve"]), "redis://127.0.0.1:1/0")["applications"][0]["args"]
    assert "switch_interval" not in plain
    assert DecoderSettings.from_args(plain).serve.switch_interval == 0
    set_ = serve_config_from(parse(["serve", "--switch-interval", "0.0005"]),
                             "redis://127.0.0.1:1/0")["applications"][0]["args"]
    assert DecoderSettings.from_args(set_).serve.switch_interval == 0.0005
    for bad in (-1e-3, 2.0, "fast", None, False):
        with pytest.raises(ValueError, match="switch_interval"):
            default_serve_config(switch_interval=bad)


def test_serve_mps_flag_starts_a_daemon_only_where_it_can(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Any, capsys: Any) -> None:
    """``detserve serve --mps``: refused off CUDA and without the MPS binaries (a clear
    message, nothing started); a daemon already running (its pipe directory exists) is
    used as it is."""
    from contextlib import ExitStack

    from services.cli import _start_mps
    from services.console import build_parser

    assert build_parser().parse_args(["serve", "--device", "cuda", "--mps"]).mps is True
    assert build_parser().parse_args(["serve"]).mps is False
    with ExitStack() as stack:
        with pytest.raises(SystemExit, match="needs --device cuda"):
            _start_mps(stack, "cpu")
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "none"))
        monkeypatch.setenv("PATH", str(tmp_path))  # (no nvidia-cuda-mps-control there)
        with pytest.raises(SystemExit, match="nvidia-cuda-mps-control"):
            _start_mps(stack, "cuda")
        assert not (tmp_path / "none").exists()
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))  # a running daemon's
        _start_mps(stack, "cuda")
        assert "already running" in capsys.readouterr().out


def test_serve_mps_daemon_sees_every_gpu_and_has_a_pipe_of_its_own(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The daemon ``--mps`` starts: launched without the server's ``CUDA_VISIBLE_DEVICES``
    (MPS clients number GPUs relative to the daemon's, Ray gives replicas host-wide ids),
    in a pipe directory of this server's own unless the user names one, and told to quit
    when the server stops. The daemon here is a script that records how it was run."""
    from contextlib import ExitStack

    from services.cli import _start_mps
    from services.verifier.deployment import MPS_PIPE_DEFAULT

    calls = tmp_path / "calls"
    fake = tmp_path / "nvidia-cuda-mps-control"
    fake.write_text(f'#!/bin/sh\necho "$* gpus=${{CUDA_VISIBLE_DEVICES-unset}} '
                    f'pipe=$CUDA_MPS_PIPE_DIRECTORY" >> {calls}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    with ExitStack() as stack:
        _start_mps(stack, "cuda")
        pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
        assert pipe != MPS_PIPE_DEFAULT and str(os.getpid()) in pipe and os.path.isdir(pipe)
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"  # the server's own is kept
    assert calls.read_text().splitlines() == [f"-d gpus=unset pipe={pipe}",
                                              f" gpus=unset pipe={pipe}"]
    assert not os.path.exists(pipe)
    # a pipe directory the user names is used as it is
    named = tmp_path / "named"
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(named))
    with ExitStack() as stack:
        _start_mps(stack, "cuda")
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(named) and named.is_dir()


def test_echo_prepares_prompt_logprobs_and_the_prompt_text(ctx: ModelContext) -> None:
    """``echo``: each choice's prompt text to send first (the string as given, or token ids
    decoded), and with ``logprobs`` the prompt's logprobs asked of the engine."""
    limits = ServingLimits(max_model_len=64, max_choices=4, max_n=4, max_prompts=2)
    job = prepare_completion(_completion(prompt=["ab", "cd"], n=2, echo=True, logprobs=2),
                             ctx, limits)
    assert job.echo == ("ab", "ab", "cd", "cd")
    assert {c.params.prompt_logprobs for c in job.choices} == {2}
    ids = prepare_completion(_completion(prompt=[5, 6], echo=True), ctx, limits)
    assert ids.echo == (ctx.tokenizer.decode([5, 6]),)
    plain = prepare_completion(_completion(echo=True), ctx, limits)
    assert plain.echo and plain.choices[0].params.prompt_logprobs is None
    assert prepare_completion(_completion(), ctx, limits).echo == ()
