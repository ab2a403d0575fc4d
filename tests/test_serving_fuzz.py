"""Hostile input at volume against a real cluster (Ray Serve, Redis, router, decoder,
verifier): at least 1,000 generated requests per API (HTTP /v1/completions, HTTP
/v1/chat/completions, gRPC Completions), sent concurrently.

Every answer is either a success or a refusal that says why: no HTTP status >= 500, every
HTTP 4xx with an OpenAI error body, every gRPC refusal INVALID_ARGUMENT or NOT_FOUND with
a message, every gRPC stream that starts ending with its Complete event. Afterwards the
server is healthy and a deterministic request gives the same tokens as before the
fuzzing. Each API's answers are counted by status and printed on one line.

Broken HTTP framing (raw byte streams that are no HTTP/1.1 request: hostile_framing) goes
to the same server: every answer is a 4xx with an OpenAI error body (uvicorn's own refusals
included: services.router.http_framing), or none where HTTP allows it (a stream cut short).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from hostile_framing import (
    HAND_PICKED,
    Stream,
    as_expected,
    classify,
    exchange,
    framing_stream,
)
from hostile_requests import (
    CHAT_BASE,
    CHAT_FIELDS,
    COMPLETION_BASE,
    COMPLETION_FIELDS,
    GrpcCase,
    HttpCase,
    grpc_case,
    http_case,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_cluster import Cluster, serving_cluster, tiny_model

from services.router import detserve_pb2 as pb
from services.router.limits import ServingLimits

pytestmark = pytest.mark.timeout(900)
MAX_MODEL_LEN = 128      # bounds the work of the generated requests that happen to be valid
MAX_BODY = 32 * 1024     # oversized bodies stay cheap to send
BATCH = 24               # requests sent at once, one Hypothesis example
EXAMPLES = 43            # examples per API: BATCH * EXAMPLES >= 1,000 requests
MIN_REQUESTS = 1000
CONCURRENCY = 12
LIMITS = ServingLimits(max_model_len=MAX_MODEL_LEN, max_outstanding=512, max_body_bytes=MAX_BODY)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
MODEL = tiny_model()     # the same path the cluster serves (the tiny model is cached)
GRPC_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
DETERMINISTIC = {"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0.8,
                 "seed": 11, "is_deterministic": True, "ignore_eos": True}
COUNTS: dict[str, Counter[str]] = {"completions": Counter(), "chat": Counter(),
                                   "grpc": Counter()}
FRAMING_BATCH, FRAMING_EXAMPLES = 16, 20   # generated broken-framing streams: 320
FRAMING: Counter[str] = Counter()
PROXY_FRAMING: Counter[str] = Counter()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with serving_cluster(num_decoders=1, num_verifiers=1, max_model_len=MAX_MODEL_LEN,
                         limits=LIMITS) as c:
        assert c.args["model"] == MODEL
        yield c


@pytest.fixture(scope="module")
def before(cluster: Cluster) -> tuple[list[int], list[int]]:
    """A deterministic request's tokens over HTTP and gRPC, before any fuzzing."""
    return _deterministic_tokens(cluster)


def _deterministic_tokens(cluster: Cluster) -> tuple[list[int], list[int]]:
    body = {"model": MODEL, **DETERMINISTIC}
    resp = httpx.post(cluster.base_url + "/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    http_ids = resp.json()["choices"][0]["token_ids"]
    req = pb.GenerateRequest(prompt=DETERMINISTIC["prompt"], max_tokens=16, temperature=0.8,
                             seed=11, is_deterministic=True, ignore_eos=True)
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        call = channel.unary_stream("/detserve.Completions/Generate",
                                    request_serializer=pb.GenerateRequest.SerializeToString,
                                    response_deserializer=pb.GenerateResponse.FromString)
        events = list(call(req, timeout=120))
    assert events[-1].WhichOneof("event") == "complete", events[-1]
    grpc_ids = [t for e in events if e.WhichOneof("event") == "chunk" for t in e.chunk.token_ids]
    assert len(http_ids) == 16 and grpc_ids == http_ids
    return http_ids, grpc_ids


# ---- HTTP ---------------------------------------------------------------------------------
def _http_answer(case: HttpCase, resp: httpx.Response) -> str:
    """The status as counted; raises AssertionError for an answer that breaks the contract."""
    what = f"{case.method} {case.path} {case.content_type!r} {case.body[:300]!r}"
    assert resp.status_code < 500, f"{resp.status_code} for {what}: {resp.text[:500]}"
    if resp.status_code >= 400:
        try:
            error = resp.json()["error"]
        except (ValueError, KeyError, TypeError) as e:
            raise AssertionError(f"no OpenAI error body for {what}: {resp.text[:500]}") from e
        assert set(error) >= {"message", "type", "param", "code"}, (what, error)
        assert isinstance(error["message"], str) and error["message"], (what, error)
    elif resp.is_redirect:  # a trailing slash: sent on to the path without it
        assert resp.headers["location"], what
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: {")]
        assert events and not any("error" in e for e in events), (what, resp.text[-500:])
    else:
        assert "choices" in resp.json(), (what, resp.text[:500])
    return str(resp.status_code)


async def _send_http(base: str, cases: list[HttpCase]) -> list[str]:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(client: httpx.AsyncClient, case: HttpCase) -> str:
        headers = {} if case.content_type is None else {"content-type": case.content_type}
        async with gate:
            resp = await client.request(case.method, case.path, content=case.body,
                                        headers=headers)
        return _http_answer(case, resp)

    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        return list(await asyncio.gather(*(one(client, c) for c in cases)))


def _http_fuzz(cluster: Cluster, api: str, cases: list[HttpCase]) -> None:
    COUNTS[api].update(asyncio.run(_send_http(cluster.http_url, cases)))


@FUZZ
@given(cases=st.lists(http_case("/v1/completions", COMPLETION_BASE, COMPLETION_FIELDS, MODEL,
                                MAX_BODY), min_size=BATCH, max_size=BATCH))
def test_hostile_completions(cluster: Cluster, before: Any, cases: list[HttpCase]) -> None:
    _http_fuzz(cluster, "completions", cases)


@FUZZ
@given(cases=st.lists(http_case("/v1/chat/completions", CHAT_BASE, CHAT_FIELDS, MODEL,
                                MAX_BODY), min_size=BATCH, max_size=BATCH))
def test_hostile_chat_completions(cluster: Cluster, before: Any, cases: list[HttpCase]) -> None:
    _http_fuzz(cluster, "chat", cases)


# ---- gRPC ---------------------------------------------------------------------------------
async def _send_grpc(address: str, cases: list[GrpcCase]) -> list[str]:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(channel: grpc.aio.Channel, case: GrpcCase) -> str:
        what = f"{case.method} {case.data[:300]!r}"
        async with gate:
            try:
                if case.method == "Health":
                    health = channel.unary_unary("/detserve.Completions/Health",
                                                 response_deserializer=pb.HealthResponse.FromString)
                    await health(case.data, timeout=60)
                    return "OK"
                generate = channel.unary_stream(
                    "/detserve.Completions/Generate",
                    response_deserializer=pb.GenerateResponse.FromString)
                events = [e async for e in generate(case.data, timeout=120)]
            except grpc.aio.AioRpcError as e:
                assert e.code() in GRPC_REFUSALS, f"{e.code()} for {what}: {e.details()}"
                assert e.details(), f"{e.code()} without a message for {what}"
                return e.code().name
        assert events and events[-1].WhichOneof("event") == "complete", (what, events[-1:])
        return "OK"

    async with grpc.aio.insecure_channel(address) as channel:
        return list(await asyncio.gather(*(one(channel, c) for c in cases)))


@FUZZ
@given(cases=st.lists(grpc_case(MODEL, MAX_BODY), min_size=BATCH, max_size=BATCH))
def test_hostile_grpc(cluster: Cluster, before: Any, cases: list[GrpcCase]) -> None:
    COUNTS["grpc"].update(asyncio.run(_send_grpc(cluster.grpc_address, cases)))


# ---- broken HTTP framing -------------------------------------------------------------------
def _framing(cluster: Cluster, streams: list[Stream], port: int | None = None) -> list[str]:
    """The answers to ``streams`` from the router's own HTTP server, or from ``port``."""
    host, router_port = cluster.http_url.removeprefix("http://").rsplit(":", 1)

    async def all_of() -> list[str]:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(stream: Stream) -> str:
            async with gate:
                answer = await exchange(host, port or int(router_port), stream)
            return classify(stream, answer)
        return list(await asyncio.gather(*(one(s) for s in streams)))
    answers = asyncio.run(all_of())
    (PROXY_FRAMING if port else FRAMING).update(answers)
    return answers


def _check_hand_picked(answers: list[str]) -> None:
    wrong = [(s.label, a) for s, a in zip(HAND_PICKED, answers, strict=True)
             if not as_expected(s, a)]
    assert not wrong, wrong


def test_hand_picked_broken_framing(cluster: Cluster, before: Any) -> None:
    _check_hand_picked(_framing(cluster, list(HAND_PICKED)))


def test_hand_picked_broken_framing_through_the_serve_proxy(cluster: Cluster,
                                                            before: Any) -> None:
    """What Kubernetes serves from: Ray Serve's HTTP proxy (locally the head's, on a port
    of its own) in front of the router, its uvicorn given the same protocol."""
    from ray.serve.context import _get_global_client

    port = _get_global_client().http_config.port
    assert not cluster.http_url.endswith(f":{port}")
    _check_hand_picked(_framing(cluster, list(HAND_PICKED), port))


@settings(FUZZ, max_examples=FRAMING_EXAMPLES)
@given(streams=st.lists(framing_stream(), min_size=FRAMING_BATCH, max_size=FRAMING_BATCH))
def test_generated_broken_framing(cluster: Cluster, before: Any, streams: list[Stream]) -> None:
    _framing(cluster, streams)


# ---- afterwards ---------------------------------------------------------------------------
def test_healthy_and_deterministic_after_fuzzing(cluster: Cluster,
                                                 before: tuple[list[int], list[int]],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        for api, counts in COUNTS.items():
            answers = ", ".join(f"{status}: {n}" for status, n in sorted(counts.items()))
            print(f"\nfuzzed {api}: {sum(counts.values())} requests ({answers})")
        for where, counts in (("", FRAMING), (" through the Serve proxy", PROXY_FRAMING)):
            answers = ", ".join(f"{status}: {n}" for status, n in sorted(counts.items()))
            print(f"\nbroken HTTP framing{where}: {sum(counts.values())} streams ({answers})")
    for api, counts in COUNTS.items():
        assert sum(counts.values()) >= MIN_REQUESTS, (api, counts)
        assert not any(s.isdigit() and int(s) >= 500 for s in counts), (api, counts)
    assert sum(FRAMING.values()) >= len(HAND_PICKED) + FRAMING_BATCH * FRAMING_EXAMPLES
    assert not any(s.isdigit() and int(s) >= 500 for s in FRAMING), FRAMING
    assert FRAMING["400"] > sum(FRAMING.values()) // 2, FRAMING
    health = httpx.get(cluster.http_url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    live = httpx.get(cluster.http_url + "/livez", timeout=30)
    assert live.status_code == 200 and live.json() == {"status": "alive"}, live.text
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        health_call = channel.unary_unary("/detserve.Completions/Health",
                                          request_serializer=pb.HealthRequest.SerializeToString,
                                          response_deserializer=pb.HealthResponse.FromString)
        assert health_call(pb.HealthRequest(), timeout=30).ready
    assert _deterministic_tokens(cluster) == before
