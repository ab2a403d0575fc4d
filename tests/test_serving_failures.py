"""Failure behaviour of a running cluster: bad input (HTTP 4xx, gRPC INVALID_ARGUMENT)
leaves it healthy; overload answers 429 with Retry-After; a decoder that dies fails its
non-deterministic requests with a clear error and replays its deterministic ones."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
import ray
import torch
from serving_cluster import Cluster, G, W, serving_cluster

from detserve.llm import LLM
from detserve.params import SamplingParams
from services.router import detserve_pb2 as pb
from services.router import detserve_pb2_grpc as pb_grpc
from services.router.limits import ServingLimits

pytestmark = pytest.mark.timeout(600)
MAX_MODEL_LEN = 1024
MAX_BODY = 64 * 1024
LIMITS = ServingLimits(max_model_len=MAX_MODEL_LEN, max_outstanding=3, max_body_bytes=MAX_BODY)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with serving_cluster(num_decoders=2, num_verifiers=1, max_model_len=MAX_MODEL_LEN,
                         limits=LIMITS) as c:
        yield c


@pytest.fixture(scope="module")
def http(cluster: Cluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.http_url, timeout=60) as client:
        yield client


def _cmpl(**kw: Any) -> dict[str, Any]:
    return {"model": "MODEL", "prompt": "hello", "max_tokens": 4, **kw}


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            **kw}


C, CHAT = "/v1/completions", "/v1/chat/completions"
BAD_INPUTS: list[tuple[str, str, Any, int]] = [
    ("malformed json", C, '{"model": "x", "prompt": ', 400),
    ("json array body", C, "[1, 2, 3]", 400),
    ("empty body", C, "", 400),
    ("missing prompt", C, {"model": "MODEL", "max_tokens": 4}, 400),
    ("missing model", C, {"prompt": "hi"}, 400),
    ("prompt wrong type", C, _cmpl(prompt=123), 400),
    ("empty prompt", C, _cmpl(prompt=""), 400),
    ("prompt ids out of vocab", C, _cmpl(prompt=[1, 2, 10**9]), 400),
    ("over-long prompt", C, _cmpl(prompt=[5] * (MAX_MODEL_LEN + 10)), 400),
    ("prompt plus max_tokens too long", C, _cmpl(prompt=[5] * 600, max_tokens=600), 400),
    ("max_tokens wrong type", C, _cmpl(max_tokens="ten"), 400),
    ("max_tokens negative", C, _cmpl(max_tokens=-5), 400),
    ("max_tokens zero", C, _cmpl(max_tokens=0), 400),
    ("max_tokens huge", C, _cmpl(max_tokens=10**9), 400),
    ("temperature negative", C, _cmpl(temperature=-1.0), 400),
    ("temperature wrong type", C, _cmpl(temperature="hot"), 400),
    ("temperature NaN", C, '{"model": "MODEL", "prompt": "x", "temperature": NaN}', 400),
    ("top_p zero", C, _cmpl(top_p=0.0), 400),
    ("top_p above one", C, _cmpl(top_p=1.5), 400),
    ("seed negative", C, _cmpl(seed=-1), 400),
    ("seed wrong type", C, _cmpl(seed="abc"), 400),
    ("seed too large", C, _cmpl(seed=2**64), 400),
    ("n zero", C, _cmpl(n=0), 400),
    ("n too large", C, _cmpl(n=100), 400),
    ("logprobs too large", C, _cmpl(logprobs=50), 400),
    ("too many stop strings", C, _cmpl(stop=["a"] * 10), 400),
    ("is_deterministic wrong type", C, _cmpl(is_deterministic="yes"), 400),
    ("stream wrong type", C, _cmpl(stream="true"), 400),
    ("stream_options without stream", C, _cmpl(stream_options={"include_usage": True}), 400),
    ("unsupported suffix", C, _cmpl(suffix="!"), 400),
    ("prompt_logprobs via echo too many", C, _cmpl(echo=True, logprobs=21), 400),
    ("presence_penalty out of range", C, _cmpl(presence_penalty=2.5), 400),
    ("frequency_penalty wrong type", C, _cmpl(frequency_penalty="high"), 400),
    ("logit_bias key not a token id", C, _cmpl(logit_bias={"abc": 1.0}), 400),
    ("logit_bias token out of vocab", C, _cmpl(logit_bias={str(10**9): 1.0}), 400),
    ("logit_bias value out of range", C, _cmpl(logit_bias={"5": 101.0}), 400),
    ("logit_bias value wrong type", C, _cmpl(logit_bias={"5": "high"}), 400),
    ("unknown model", C, {**_cmpl(), "model": "gpt-nonexistent"}, 404),
    ("oversized body", C, _cmpl(prompt="x" * (MAX_BODY + 1)), 413),
    ("empty messages", CHAT, {"model": "MODEL", "messages": [], "max_tokens": 4}, 400),
    ("messages not a list", CHAT, {"model": "MODEL", "messages": "hi"}, 400),
    ("invalid role", CHAT, _chat(messages=[{"role": "wizard", "content": "hi"}]), 400),
    ("content wrong type", CHAT, _chat(messages=[{"role": "user", "content": 123}]), 400),
    ("top_logprobs without logprobs", CHAT, _chat(top_logprobs=3), 400),
    ("chat max_tokens negative", CHAT, _chat(max_tokens=-1), 400),
    ("unknown route", "/v1/nonexistent", _cmpl(), 404),
]


@pytest.mark.parametrize("name, path, body, status", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_refused(cluster: Cluster, http: httpx.Client, name: str, path: str,
                              body: Any, status: int) -> None:
    model = cluster.args["model"]
    if isinstance(body, dict):
        content = json.dumps({k: model if v == "MODEL" else v for k, v in body.items()})
    else:
        content = body.replace("MODEL", model)
    resp = http.post(path, content=content, headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


BAD_GRPC: list[tuple[str, dict[str, Any]]] = [
    ("no prompt", {}),
    ("prompt and token ids", {"prompt": "hi", "prompt_token_ids": [1, 2]}),
    ("max_tokens negative", {"prompt": "hi", "max_tokens": -1}),
    ("max_tokens huge", {"prompt": "hi", "max_tokens": 10**9}),
    ("temperature negative", {"prompt": "hi", "temperature": -1.0}),
    ("top_p above one", {"prompt": "hi", "top_p": 2.0}),
    ("token id out of vocab", {"prompt_token_ids": [10**9]}),
    ("seed negative", {"prompt": "hi", "seed": -5}),
    ("logprobs too large", {"prompt": "hi", "logprobs": 100}),
    ("logit_bias out of range", {"prompt": "hi", "logit_bias": {5: -250.0}}),
    ("logit_bias token out of vocab", {"prompt": "hi", "logit_bias": {10**9: 1.0}}),
    ("frequency_penalty out of range", {"prompt": "hi", "frequency_penalty": -3.0}),
    ("echo with messages", {"messages": [pb.ChatMessage(role="user", content="x")],
                            "echo": True}),
    ("invalid role", {"messages": [pb.ChatMessage(role="wizard", content="x")]}),
    ("request_id too long", {"prompt": "hi", "request_id": "r" * 500}),
]


@pytest.mark.parametrize("name, fields", BAD_GRPC, ids=[b[0] for b in BAD_GRPC])
def test_bad_grpc_fields_are_invalid_argument(cluster: Cluster, name: str,
                                              fields: dict[str, Any]) -> None:
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        stub = pb_grpc.CompletionsStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(**fields), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


def test_server_stays_healthy_after_bad_input(cluster: Cluster, http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    resp = http.post(C, json={"model": cluster.args["model"], "prompt": "hi", "max_tokens": 3})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1


async def _burst(cluster: Cluster, n: int) -> list[httpx.Response]:
    body = {"model": cluster.args["model"], "prompt": "load", "max_tokens": 200,
            "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=cluster.http_url, timeout=120) as client:
        return list(await asyncio.gather(*(client.post(C, json=body) for _ in range(n))))


def test_overload_answers_429_with_retry_after(cluster: Cluster, http: httpx.Client) -> None:
    responses = asyncio.run(_burst(cluster, 3 * LIMITS.max_outstanding))
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429}, codes
    shed = next(r for r in responses if r.status_code == 429)
    assert int(shed.headers["retry-after"]) >= 1
    assert shed.json()["error"]["type"] == "rate_limit_error"
    assert http.get("/health").status_code == 200


def _kill_decoders() -> int:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if "#Decoder#" in a["name"]]
    for name in names:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return len(names)


async def _stream(client: httpx.AsyncClient, body: dict[str, Any], started: asyncio.Event
                  ) -> list[dict[str, Any]]:
    events = []
    async with client.stream("POST", C, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                started.set()
    return events


async def _run_through_crash(cluster: Cluster, det: dict[str, Any], nondet: dict[str, Any]
                             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    async with httpx.AsyncClient(base_url=cluster.http_url, timeout=300) as client:
        started = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.create_task(_stream(client, b, e))
                 for b, e in zip((det, nondet), started, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        killed = await asyncio.to_thread(_kill_decoders)
        det_events, nondet_events = await asyncio.gather(*tasks)
    return det_events, nondet_events, killed


def test_decoder_death(cluster: Cluster, http: httpx.Client) -> None:
    model, prompt, max_tokens = cluster.args["model"], "Replay me", MAX_MODEL_LEN - 20
    base = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    det_events, nondet_events, killed = asyncio.run(
        _run_through_crash(cluster, {**base, "is_deterministic": True}, base))
    assert killed == 2
    # the non-deterministic stream ends with a clear error
    error = nondet_events[-1].get("error")
    assert error and "decoder" in error["message"] and error["type"] == "server_error"
    # the deterministic one was replayed elsewhere: complete and exactly the offline output
    assert not any("error" in e for e in det_events)
    ids = [t for e in det_events for c in e["choices"] for t in c["token_ids"]]
    text = "".join(c["text"] for e in det_events for c in e["choices"])
    llm = LLM(model, mode="lane_only", verify_window=W, verify_group=G,
              max_model_len=MAX_MODEL_LEN)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                    is_deterministic=True))[0]
    finally:
        torch.set_num_threads(threads)
    assert (text, ids) == (ref.text, ref.token_ids)
    metrics = http.get("/metrics").text
    assert "detserve:deterministic_replays_total 1.0" in metrics
    deadline = time.monotonic() + 60
    while http.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "decoders did not come back"
        time.sleep(1)
