"""Determinism for clients that cannot send ``is_deterministic`` (issue 38), without Ray: the
model's deterministic name, the ``X-Detserve-Deterministic`` header (gRPC: metadata), the
server's default, the default seed, the metrics split by how determinism was asked, the
tokenizer routes an evaluation harness uses, and the serve options behind them."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from serving_cluster import tiny_model
from test_serving_router import FakeDecoder, hello

from services.cli import _args, serve_config_from
from services.router import detserve_pb2 as pb
from services.router.errors import APIError
from services.router.grpc_api import DETERMINISM_METADATA, job_from_proto
from services.router.http_app import build_http_app
from services.router.limits import ServingLimits
from services.router.model_context import ModelContext
from services.router.prepare import (
    DEFAULT_SEED,
    DETERMINISM_HEADER,
    prepare_chat,
    prepare_completion,
)
from services.router.schemas import ChatCompletionRequest, CompletionRequest
from services.router.service import RouterService
from services.serve_config import default_serve_config

LIMITS = ServingLimits(max_model_len=128)


@pytest.fixture(scope="module")
def ctx() -> ModelContext:
    return ModelContext.load(tiny_model(), max_model_len=128)


def _completion(model: str, **kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": model, "prompt": "hi", "max_tokens": 2,
                                             **kw})


def _serve(ctx: ModelContext) -> tuple[TestClient, FakeDecoder, RouterService]:
    decoder = FakeDecoder(hello)
    links: Any = decoder  # the fake is its own links
    service = RouterService(ctx, LIMITS, decoder, links)
    return TestClient(build_http_app(service)), decoder, service


# ---- how determinism is decided -------------------------------------------------------
def test_deterministic_name_is_listed_and_served(ctx: ModelContext) -> None:
    assert ctx.deterministic_id == ctx.model_id + ":deterministic"
    client, decoder, _ = _serve(ctx)
    cards = client.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [ctx.model_id, ctx.deterministic_id]
    assert [c["deterministic"] for c in cards] == [False, True]
    assert cards[1]["parent"] == ctx.model_id and cards[0]["parent"] is None
    resp = client.post("/v1/completions", json={"model": ctx.deterministic_id, "prompt": "hi",
                                                "max_tokens": 2, "n": 2, "temperature": 1.0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["model"] == ctx.deterministic_id          # the name the client sent
    assert body["system_fingerprint"] == "f00d" == body["determinism"]["fingerprint"]
    assert [r.params.is_deterministic for r in decoder.requests] == [True, True]
    # the default seed, one per choice: the choices differ and stay reproducible
    assert [r.params.seed for r in decoder.requests] == [DEFAULT_SEED, DEFAULT_SEED + 1]
    plain = client.post("/v1/completions", json={"model": ctx.model_id, "prompt": "hi",
                                                 "max_tokens": 2})
    assert plain.json()["system_fingerprint"] is None     # control: the fast path
    assert decoder.requests[-1].params.is_deterministic is False
    assert decoder.requests[-1].params.seed is None       # the engine picks one


@pytest.mark.parametrize("fields, header, default, expected", [
    ({}, None, False, (False, "default")),
    ({}, None, True, (True, "default")),
    ({"is_deterministic": False}, None, True, (False, "field")),   # opting out
    ({"is_deterministic": True}, None, False, (True, "field")),
    ({}, True, False, (True, "header")),
    ({}, False, True, (False, "header")),
    ({"alias": True}, None, False, (True, "alias")),
    ({"alias": True}, True, False, (True, "header")),              # asks that agree
    ({"alias": True, "is_deterministic": True}, None, False, (True, "field")),
])
def test_determinism_sources(ctx: ModelContext, fields: dict[str, Any], header: bool | None,
                             default: bool, expected: tuple[bool, str]) -> None:
    served = replace(ctx, deterministic_by_default=default)
    fields = dict(fields)
    model = served.deterministic_id if fields.pop("alias", False) else served.model_id
    job = prepare_completion(_completion(model, **fields), served, LIMITS, header)
    assert (job.is_deterministic, job.determinism_source) == expected
    assert all(c.params.is_deterministic is expected[0] for c in job.choices)
    chat = prepare_chat(ChatCompletionRequest.model_validate(
        {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}),
        served, LIMITS, header)
    assert (chat.is_deterministic, chat.determinism_source) == expected


@pytest.mark.parametrize("fields, header", [
    ({"is_deterministic": False, "alias": True}, None),
    ({"alias": True}, False),
    ({"is_deterministic": True}, False),
])
def test_contradictory_asks_are_refused(ctx: ModelContext, fields: dict[str, Any],
                                        header: bool | None) -> None:
    fields = dict(fields)
    model = ctx.deterministic_id if fields.pop("alias", False) else ctx.model_id
    with pytest.raises(APIError) as info:
        prepare_completion(_completion(model, **fields), ctx, LIMITS, header)
    assert info.value.status == 400 and info.value.code == "determinism_conflict"
    assert "contradictory determinism" in info.value.message


def test_seeds_of_choices(ctx: ModelContext) -> None:
    def seeds(**kw: Any) -> list[int | None]:
        job = prepare_completion(_completion(ctx.model_id, n=3, **kw), ctx, LIMITS)
        return [c.params.seed for c in job.choices]

    assert seeds(is_deterministic=True) == [0, 1, 2]
    assert seeds(is_deterministic=True, seed=41) == [41, 42, 43]
    assert seeds(seed=2**63 - 2) == [2**63 - 2, 2**63 - 1, 0]  # wraps, stays valid
    assert seeds() == [None, None, None]  # fast path, no seed: the engine draws each


def test_header_over_http(ctx: ModelContext) -> None:
    client, decoder, service = _serve(replace(ctx, deterministic_by_default=True))
    body = {"model": ctx.model_id, "prompt": "hi", "max_tokens": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert decoder.requests[-1].params.is_deterministic is True        # server default
    off = client.post("/v1/completions", json=body, headers={DETERMINISM_HEADER: "false"})
    assert off.status_code == 200 and decoder.requests[-1].params.is_deterministic is False
    chat = client.post("/v1/chat/completions", headers={DETERMINISM_HEADER.lower(): "TRUE"},
                       json={"model": ctx.model_id, "max_tokens": 2, "stream": True,
                             "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and decoder.requests[-1].params.is_deterministic is True
    assert '"system_fingerprint":"f00d"' in chat.text                   # the last chunk
    bad = client.post("/v1/completions", json=body, headers={DETERMINISM_HEADER: "yes please"})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == DETERMINISM_HEADER
    conflict = client.post("/v1/completions", json={**body, "is_deterministic": True},
                           headers={DETERMINISM_HEADER: "false"})
    assert conflict.status_code == 400
    assert conflict.json()["error"]["code"] == "determinism_conflict"
    # requests split by how determinism was asked for (refused ones are not counted)
    metrics = client.get("/metrics").text
    for line in ('detserve:determinism_requests_total{deterministic="true",source="default"} 1.0',
                 'detserve:determinism_requests_total{deterministic="false",source="header"} 1.0',
                 'detserve:determinism_requests_total{deterministic="true",source="header"} 1.0',
                 'detserve:determinism_requests_total{deterministic="true",source="alias"} 0.0',
                 'detserve:determinism_requests_total{deterministic="false",source="field"} 0.0'):
        assert line in metrics, line


def test_served_names_are_configurable(ctx: ModelContext) -> None:
    args = {"model": tiny_model(), "max_model_len": 128, "served_model_name": "tiny",
            "deterministic_model_name": "tiny-exact", "deterministic_by_default": True}
    named = ModelContext.from_args(args)
    assert (named.model_id, named.deterministic_id) == ("tiny", "tiny-exact")
    assert named.deterministic_by_default
    assert named.serves("tiny") and named.serves("tiny-exact") and named.serves(tiny_model())
    assert not named.serves("tiny:deterministic")
    with pytest.raises(ValueError, match="must differ"):
        ModelContext.load(tiny_model(), 128, served_name="a", deterministic_name="a")


# ---- gRPC -----------------------------------------------------------------------------
def test_grpc_matches_http(ctx: ModelContext) -> None:
    def job(metadata: tuple[tuple[str, str], ...] = (), served: ModelContext = ctx,
            **fields: Any) -> Any:
        return job_from_proto(pb.GenerateRequest(prompt="hi", max_tokens=2, **fields), served,
                              LIMITS, metadata)

    assert job().is_deterministic is False                      # unset: the default
    assert job(served=replace(ctx, deterministic_by_default=True)).is_deterministic is True
    opted_out = job(served=replace(ctx, deterministic_by_default=True), is_deterministic=False)
    assert (opted_out.is_deterministic, opted_out.determinism_source) == (False, "field")
    alias = job(model=ctx.deterministic_id)
    assert (alias.is_deterministic, alias.determinism_source) == (True, "alias")
    assert [c.params.seed for c in alias.choices] == [DEFAULT_SEED]
    meta = job(((DETERMINISM_METADATA, "true"),))
    assert (meta.is_deterministic, meta.determinism_source) == (True, "header")
    with pytest.raises(APIError) as info:
        job(((DETERMINISM_METADATA, "false"),), model=ctx.deterministic_id)
    assert info.value.code == "determinism_conflict"


# ---- the tokenizer over HTTP (what an evaluation harness counts tokens with) ----------
def test_tokenizer_routes(ctx: ModelContext) -> None:
    client, _, _ = _serve(ctx)
    text = "Deterministic serving"
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    got = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == 128
    strs = client.post("/tokenize", json={"model": ctx.deterministic_id, "prompt": text,
                                          "return_token_strs": True}).json()["token_strs"]
    assert strs == [ctx.token_text(t) for t in ids]
    back = client.post("/detokenize", json={"tokens": ids}).json()
    assert back == {"prompt": ctx.tokenizer.decode(ids, skip_special_tokens=False)}
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == ctx.tokenizer.special_tokens.get("eos_token")
    assert info["model_max_length"] == 128
    assert client.post("/tokenize", json={"prompt": "a", "messages": []}).status_code == 400
    assert client.post("/tokenize", json={"prompt": 5}).status_code == 400
    assert client.post("/detokenize", json={"tokens": [-1]}).status_code == 400
    assert client.post("/tokenize", json={"model": "other", "prompt": "a"}).status_code == 404


# ---- the serve options ----------------------------------------------------------------
def test_serve_options() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    _args(parser)
    a = parser.parse_args(["--served-model-name", "sm", "--deterministic-model-name", "sm-det",
                           "--deterministic-by-default"])
    args = serve_config_from(a, "redis://127.0.0.1:1/0")["applications"][0]["args"]
    assert (args["served_model_name"], args["deterministic_model_name"],
            args["deterministic_by_default"]) == ("sm", "sm-det", True)
    plain = serve_config_from(parser.parse_args([]), "redis://127.0.0.1:1/0")
    assert not {"served_model_name", "deterministic_model_name",
                "deterministic_by_default"} & set(plain["applications"][0]["args"])
    for bad in ({"served_model_name": "a b"}, {"deterministic_model_name": ""},
                {"deterministic_model_name": "smollm2"}, {"deterministic_by_default": "yes"}):
        with pytest.raises(ValueError):
            default_serve_config(**bad)
