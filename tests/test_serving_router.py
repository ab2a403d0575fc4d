"""The router's HTTP layer without Ray: fake decoders behind the real FastAPI app
(readiness, SSE framing, fan-in of choices, decoder failures and deterministic replay).
The decoders answer over a fake of the router's links (``services.router.links``); the
real links run in test_decoder_link.py and the cluster tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from serving_cluster import tiny_model

from services.decoder.messages import DecodeChunk, DecodeRequest, ReplicaStats
from services.router.http_app import build_http_app
from services.router.limits import ServingLimits
from services.router.links import Item, LinkHub
from services.router.model_context import ModelContext
from services.router.service import RouterService

Script = Callable[[DecodeRequest, int], list[DecodeChunk]]


class _Call:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.remote = fn


class FakeDecoder:
    """The decoders' Ray Serve handle (health probes: ``stats``) and their links, one
    replica "fake" answering each request with ``script(request, attempt)``;
    ``healthy=False`` makes ``stats`` fail like a deployment without replicas."""

    def __init__(self, script: Script, healthy: bool = True) -> None:
        self.script = script
        self.healthy = healthy
        self.requests: list[DecodeRequest] = []
        self.aborted: list[str] = []
        self.stats = _Call(self._stats)
        self.link_up = True         # its link is attached
        self.verifier_ready = True  # it has a verifier stream

    async def _stats(self) -> ReplicaStats:
        if not self.healthy:
            raise TimeoutError("no replica")
        return ReplicaStats("fake", {"rollbacks": 3.0}, 0, 0, True, "InProcessVerifier",
                            verifier_ready=self.verifier_ready)

    # ---- what the dispatcher uses of a ``LinkHub`` -----------------------------------
    @property
    def attached(self) -> list[str]:
        return ["fake"] if self.link_up else []

    async def wait(self, request: DecodeRequest, timeout_s: float) -> str | None:
        return "fake"

    def submit(self, request: DecodeRequest, replica: str) -> asyncio.Queue[Item]:
        self.requests.append(request)
        _, replay, attempt = request.request_id.rpartition("-replay")
        queue: asyncio.Queue[Item] = asyncio.Queue()
        for chunk in self.script(request, int(attempt) if replay else 0):
            queue.put_nowait(chunk)
        return queue

    def release(self, request_id: str, abort: bool) -> None:
        if abort:
            self.aborted.append(request_id)

    def close(self) -> None:
        pass


def hello(request: DecodeRequest, attempt: int) -> list[DecodeChunk]:
    rid, n = request.request_id, len(request.prompt_token_ids)
    det = {"fingerprint": "f00d"} if request.is_deterministic else None
    return [DecodeChunk(rid, "fake", text="Hel", token_ids=(1,), num_prompt_tokens=n,
                        num_output_tokens=1),
            DecodeChunk(rid, "fake", text="lo", token_ids=(2,), finished=True,
                        finish_reason="length", num_prompt_tokens=n, num_output_tokens=2,
                        determinism=det)]


def crash_once(request: DecodeRequest, attempt: int) -> list[DecodeChunk]:
    first = hello(request, attempt)[0]
    crash = DecodeChunk(request.request_id, "fake", finished=True, error="replica died",
                        error_type="server_error")
    return [first, crash] if attempt == 0 else hello(request, attempt)


@pytest.fixture(scope="module")
def ctx() -> ModelContext:
    return ModelContext.load(tiny_model(), max_model_len=128)


def client_for(ctx: ModelContext, decoder: FakeDecoder) -> tuple[TestClient, RouterService]:
    links: Any = decoder  # the fake is its own links
    service = RouterService(ctx, ServingLimits(max_model_len=128), decoder, links)
    return TestClient(build_http_app(service)), service


def _body(ctx: ModelContext, **kw: Any) -> dict[str, Any]:
    return {"model": ctx.model_id, "prompt": "hi", "max_tokens": 2, **kw}


def _events(text: str) -> list[Any]:
    lines = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def test_not_ready_without_decoders(ctx: ModelContext) -> None:
    client, _ = client_for(ctx, FakeDecoder(hello, healthy=False))
    health = client.get("/health")
    assert health.status_code == 503 and "no replica" in health.json()["error"]["message"]
    resp = client.post("/v1/completions", json=_body(ctx))
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_decoder_ready"


def test_health_tells_what_a_request_would_meet(ctx: ModelContext) -> None:
    """/health answers 503 with an OpenAI error body as soon as requests would fail (no
    decoder link attached; a decoder without a verifier stream, for deterministic
    requests), and 200 again once they would succeed."""
    decoder = FakeDecoder(hello)
    client, service = client_for(ctx, decoder)
    assert client.get("/health").status_code == 200
    decoder.link_up = False
    health = client.get("/health")
    assert health.status_code == 503, health.text
    error = health.json()["error"]
    assert error["type"] == "service_unavailable" and "link" in error["message"]
    decoder.link_up, decoder.verifier_ready = True, False
    asyncio.run(service.health.probe())  # the next background probe
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "no_verifier"
    assert health.json()["status"] == "unavailable"
    # a deterministic request is refused the same way; a non-deterministic one is served
    refused = client.post("/v1/completions", json=_body(ctx, is_deterministic=True))
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_verifier"
    assert client.post("/v1/completions", json=_body(ctx)).status_code == 200
    decoder.verifier_ready = True
    asyncio.run(service.health.probe())
    assert client.get("/health").json() == {"status": "ok", "decoders_ready": 1}


def test_completion_and_metrics(ctx: ModelContext) -> None:
    client, _ = client_for(ctx, FakeDecoder(hello))
    body = client.post("/v1/completions", json=_body(ctx, is_deterministic=True)).json()
    assert body["choices"][0]["text"] == "Hello" and body["choices"][0]["token_ids"] == [1, 2]
    assert body["system_fingerprint"] == "f00d" and body["usage"]["completion_tokens"] == 2
    metrics = client.get("/metrics").text
    assert 'detserve:rollbacks_total{replica="fake"} 3.0' in metrics
    assert "detserve:generation_tokens_total 2.0" in metrics


def test_chat_stream_framing(ctx: ModelContext) -> None:
    client, _ = client_for(ctx, FakeDecoder(hello))
    resp = client.post("/v1/chat/completions", json={
        "model": ctx.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "stream": True, "stream_options": {"include_usage": True}})
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = _events(resp.text)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 2
    deltas = [e["choices"][0]["delta"] for e in events[:-2]]
    assert deltas[0]["role"] == "assistant" and "role" not in deltas[1]
    assert "".join(d["content"] for d in deltas) == "Hello"
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_n_choices_fan_in(ctx: ModelContext) -> None:
    decoder = FakeDecoder(hello)
    client, _ = client_for(ctx, decoder)
    body = client.post("/v1/completions", json=_body(ctx, n=3, seed=1)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [r.params.seed for r in decoder.requests] == [1, 2, 3]
    assert body["usage"]["completion_tokens"] == 6


def test_decoder_failure_is_a_clear_error(ctx: ModelContext) -> None:
    client, _ = client_for(ctx, FakeDecoder(crash_once))
    resp = client.post("/v1/completions", json=_body(ctx))
    assert resp.status_code == 502 and "replica died" in resp.json()["error"]["message"]
    events = _events(client.post("/v1/completions", json=_body(ctx, stream=True)).text)
    assert events[0]["choices"][0]["text"] == "Hel"
    assert events[1]["error"]["code"] == "decoder_failed" and events[2] == "[DONE]"


def test_deterministic_request_is_replayed(ctx: ModelContext) -> None:
    decoder = FakeDecoder(crash_once)
    client, service = client_for(ctx, decoder)
    events = _events(client.post("/v1/completions",
                                 json=_body(ctx, stream=True, is_deterministic=True)).text)
    texts = [e["choices"][0]["text"] for e in events if isinstance(e, dict)]
    ids = [t for e in events if isinstance(e, dict) for t in e["choices"][0]["token_ids"]]
    assert ("".join(texts), ids) == ("Hello", [1, 2])   # "Hel" was not sent twice
    assert decoder.requests[1].request_id.endswith("-replay1")
    assert decoder.requests[0].avoid == () and decoder.requests[1].avoid == ("fake",)
    assert service.admission.active == 0


def test_a_replay_is_routed_away_from_the_replica_that_failed_it() -> None:
    """``LinkHub.pick``: a replayed request (``DecodeRequest.avoid``) goes to another
    replica even when the one that failed it has the fewest outstanding tokens (a replica
    whose engine failed answers at once), and to it only when no other is attached;
    ``wait`` waits for one it has not failed on before taking it."""
    from types import SimpleNamespace

    from detserve.params import SamplingParams
    from services.cluster_auth import ClusterAuth

    hub = LinkHub("redis://127.0.0.1:1/0", ClusterAuth("a-test-cluster-secret"))
    link = SimpleNamespace(attached=True, listed=True)
    hub._links = {"broken": link, "busy": link}  # type: ignore[dict-item]
    hub._ledger.routed("other", "busy", 5000)  # busy: 5,000 tokens out

    def request(avoid: tuple[str, ...]) -> DecodeRequest:
        return DecodeRequest("r", (1, 2, 3), SamplingParams(max_tokens=4), avoid=avoid)

    assert hub.pick(request(())) == "broken"  # least tokens first
    assert hub.pick(request(("broken",))) == "busy"
    del hub._links["busy"]
    assert hub.pick(request(("broken",))) == "broken"  # the only one left
    assert asyncio.run(hub.wait(request(("broken",)), 0.2)) == "broken"
