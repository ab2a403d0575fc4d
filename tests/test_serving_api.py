"""The served API against a real cluster (2 decoders, 2 verifiers, fast-path perturbation
on), through the unmodified ``openai`` client, raw HTTP and the generated gRPC client.

Deterministic responses must equal the offline engine's ``lane_only`` output bit for bit,
alone and under concurrent load; non-deterministic ones must show the perturbation."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import openai
import pytest
import torch
from serving_cluster import MAX_MODEL_LEN, Cluster, G, W, serving_cluster

from detserve.llm import LLM
from detserve.outputs import RequestOutput
from detserve.params import SamplingParams
from services.router import detserve_pb2 as pb
from services.router import detserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(600)
PERTURBATION = 0.2
PROMPTS = ["The quick brown fox", "Numbers like 12, 345 and 6789 appear",
           "A deterministic server returns the same tokens for the same request",
           "café naïve Über", "def f(x): return x ** 2. " * 3, "Tokens are committed"]
MAX_TOKENS = [12, 20, 9, 16, 24, 14]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with serving_cluster(num_decoders=2, num_verifiers=2,
                         fastpath_perturbation=PERTURBATION) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def offline(cluster: Cluster) -> LLM:
    return LLM(cluster.args["model"], mode="lane_only", verify_window=W, verify_group=G,
               max_model_len=MAX_MODEL_LEN)


def reference(llm: LLM, prompt: str, **params: Any) -> RequestOutput:
    """Offline lane_only output, single-threaded like a decoder replica."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return llm.generate([prompt], SamplingParams(is_deterministic=True, **params))[0]
    finally:
        torch.set_num_threads(threads)


def signature(choice: Any) -> tuple[str, list[int], list[float]]:
    lps = choice.logprobs.token_logprobs if choice.logprobs else []
    return choice.text, list(choice.token_ids), list(lps)


def det_body(**kw: Any) -> dict[str, Any]:
    return {"is_deterministic": True, **kw}


def test_models_and_health(cluster: Cluster, client: openai.OpenAI, model_id: str) -> None:
    assert model_id == cluster.args["model"]
    health = httpx.get(cluster.http_url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_decoders_verify_remotely(cluster: Cluster) -> None:
    from ray import serve

    from services.registry import Registry

    assert len(Registry(cluster.args["redis_url"]).live_verifiers()) == 2
    decoder = serve.get_deployment_handle("Decoder", app_name="detserve")
    stats = [decoder.stats.remote().result(timeout_s=30) for _ in range(4)]
    assert {s.verifier for s in stats} == {"RemoteVerifier"}


def test_completion_matches_offline_lane_only(client: openai.OpenAI, model_id: str,
                                              offline: LLM) -> None:
    ref = reference(offline, PROMPTS[0], max_tokens=12, logprobs=0)
    resp = client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=12,
                                     temperature=0, logprobs=0, extra_body=det_body())
    (choice,) = resp.choices
    assert signature(choice) == (ref.text, ref.token_ids, [lp.logprob for lp in ref.logprobs or ()])
    assert resp.usage is not None and resp.usage.completion_tokens == len(ref.token_ids)
    profile = (resp.model_extra or {})["determinism"]
    assert resp.system_fingerprint == profile["fingerprint"]
    assert (profile["verify_window"], profile["verify_group"], profile["tp_size"]) == (W, G, 1)
    assert profile["weights_sha256"] == offline.engine.model_info.weights_hash
    for key in ("dtype", "kernels", "device", "mode"):
        assert key in profile


def test_streaming_equals_non_streaming(client: openai.OpenAI, model_id: str) -> None:
    whole = client.completions.create(model=model_id, prompt=PROMPTS[2], max_tokens=20,
                                      temperature=0, logprobs=0, extra_body=det_body()).choices[0]
    text, ids, lps, usage, final = "", [], [], None, None
    for chunk in client.completions.create(model=model_id, prompt=PROMPTS[2], max_tokens=20,
                                           temperature=0, logprobs=0, extra_body=det_body(),
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            ids += getattr(c, "token_ids")  # noqa: B009 (our extension field)
            lps += (c.logprobs.token_logprobs or []) if c.logprobs else []
            final = c.finish_reason or final
    assert (text, ids, lps) == signature(whole)
    assert final == whole.finish_reason
    assert usage is not None and usage.completion_tokens == len(ids)


def test_chat_matches_offline(client: openai.OpenAI, model_id: str, offline: LLM) -> None:
    messages: list[Any] = [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "What is a lane?"}]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = offline.chat(messages, SamplingParams(max_tokens=10, is_deterministic=True))[0]
    finally:
        torch.set_num_threads(threads)
    resp = client.chat.completions.create(model=model_id, messages=messages, max_tokens=10,
                                          temperature=0, extra_body=det_body())
    assert resp.choices[0].message.content == ref.text
    assert (resp.choices[0].model_extra or {})["token_ids"] == ref.token_ids
    chunks = client.chat.completions.create(model=model_id, messages=messages, max_tokens=10,
                                            temperature=0, stream=True, extra_body=det_body())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, model_id: str,
                                         offline: LLM) -> None:
    def sample(seed: int) -> list[int]:
        choice = client.completions.create(model=model_id, prompt=PROMPTS[1], max_tokens=16,
                                           temperature=0.9, top_p=0.95, seed=seed,
                                           extra_body=det_body()).choices[0]
        return list(getattr(choice, "token_ids"))  # noqa: B009

    ref = reference(offline, PROMPTS[1], max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    assert sample(7) == sample(7) == ref.token_ids
    assert sample(8) != ref.token_ids


async def _burst(cluster: Cluster, model_id: str) -> tuple[list[Any], list[Any]]:
    """>= 16 concurrent requests of varied lengths: deterministic ones (each prompt twice)
    interleaved with non-deterministic greedy ones."""
    client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)
    jobs: list[tuple[str, int]] = []
    for i in range(2 * len(PROMPTS)):
        jobs.append(("det", i % len(PROMPTS)))
        jobs.append(("nondet", i % len(PROMPTS)))
    random.Random(0).shuffle(jobs)

    async def one(kind: str, i: int) -> Any:
        extra = det_body() if kind == "det" else {}
        resp = await client.completions.create(
            model=model_id, prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i], temperature=0,
            logprobs=0, extra_body=extra)
        return kind, i, resp.choices[0]

    results = await asyncio.gather(*(one(k, i) for k, i in jobs))
    await client.close()
    det = [(i, c) for k, i, c in results if k == "det"]
    nondet = [(i, c) for k, i, c in results if k == "nondet"]
    return det, nondet


def test_determinism_under_concurrent_load(cluster: Cluster, client: openai.OpenAI,
                                           model_id: str, offline: LLM) -> None:
    refs = {i: reference(offline, p, max_tokens=MAX_TOKENS[i], logprobs=0)
            for i, p in enumerate(PROMPTS)}
    expected = {i: (r.text, r.token_ids, [lp.logprob for lp in r.logprobs or ()])
                for i, r in refs.items()}
    alone = client.completions.create(model=model_id, prompt=PROMPTS[4], max_tokens=MAX_TOKENS[4],
                                      temperature=0, logprobs=0, extra_body=det_body())
    assert signature(alone.choices[0]) == expected[4]
    det, nondet = asyncio.run(_burst(cluster, model_id))
    assert len(det) + len(nondet) >= 16
    for i, choice in det:
        assert signature(choice) == expected[i], f"deterministic prompt {i} drifted"
    # negative control: the injected fast-path faults do show in non-deterministic output
    differing = sum(signature(c)[1] != expected[i][1] for i, c in nondet)
    assert differing >= len(nondet) // 2, f"only {differing}/{len(nondet)} changed"


def test_requests_reach_decoders_over_their_links(cluster: Cluster) -> None:
    """After the tests above (16+ concurrent requests among them), both decoder replicas
    got requests over their links (services.decoder.link), and the router counted as
    link dispatches exactly the requests the decoders received that way."""
    import ray
    from ray import serve

    from services.decoder.messages import ReplicaPin
    from services.registry import Registry

    assert len(Registry(cluster.args["redis_url"]).live_links()) == 2
    handle = serve.get_deployment_handle("Decoder", app_name="detserve")
    replicas = [a["name"].rsplit("#", 1)[1] for a in ray.util.list_named_actors(all_namespaces=True)
                if "#Decoder#" in a["name"]]
    received = [handle.stats.remote(ReplicaPin(r)).result(timeout_s=30).link_requests
                for r in replicas]
    assert len(received) == 2 and min(received) > 0, received
    text = httpx.get(cluster.http_url + "/metrics").text
    links = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith('detserve:router_dispatch_total{path="link"}'))
    assert links == sum(received)


def test_metrics_report_dvr_counters(cluster: Cluster) -> None:
    text = httpx.get(cluster.http_url + "/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "num_requests_running", "num_requests_waiting",
                 "prompt_tokens_total", "generation_tokens_total", "rollbacks_total",
                 "recomputed_tokens_total", "verify_passes_total", "lane_padding_rows_total",
                 "lane_padding_fraction", "partial_windows_total",
                 "lane_ahead_admissions_total", "parked_admissions_total"):
        assert f"detserve:{name}" in text, name
    values = _sum_samples(text)
    assert values["detserve:verify_passes_total"] > 0
    assert values["detserve:rollbacks_total"] > 0  # perturbation caught by the lane
    # the router watches its own event loop: a running server has observed wake-ups
    from benchmarks.bench_serving_overhead import parse_router_lag

    count, total, on_time = parse_router_lag(text)
    assert count > 0 and total >= 0 and 0 <= on_time <= count


def _sum_samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_grpc_generate_matches_http(cluster: Cluster, client: openai.OpenAI,
                                    model_id: str) -> None:
    http = client.completions.create(model=model_id, prompt=PROMPTS[3], max_tokens=16,
                                     temperature=0, logprobs=0, extra_body=det_body())
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        stub = pb_grpc.CompletionsStub(channel)
        assert stub.Health(pb.HealthRequest()).ready
        req = pb.GenerateRequest(request_id="grpc-1", prompt=PROMPTS[3], max_tokens=16,
                                 temperature=0.0, is_deterministic=True, logprobs=0)
        events = list(stub.Generate(req))
    assert all(e.request_id == "grpc-1" for e in events)
    chunks = [e.chunk for e in events if e.WhichOneof("event") == "chunk"]
    assert events[-1].WhichOneof("event") == "complete"
    done = events[-1].complete
    ids = [t for c in chunks for t in c.token_ids]
    lps = [lp.logprob for c in chunks for lp in c.logprobs]
    assert (done.text, ids, lps) == signature(http.choices[0])
    assert "".join(c.text for c in chunks) == done.text
    assert done.determinism.fingerprint == http.system_fingerprint
    assert done.usage.completion_tokens == len(ids)


def test_logit_bias_over_http_and_grpc_equals_offline(cluster: Cluster, client: openai.OpenAI,
                                                      model_id: str, offline: LLM) -> None:
    """OpenAI's ``logit_bias`` (token ids as string keys): a deterministic request that bans
    the tokens its unbiased output starts with equals the offline engine given the same
    bias, over HTTP and over gRPC (``map<int64, double>``)."""
    unbiased = reference(offline, PROMPTS[5], max_tokens=10)
    bias = {t: -100.0 for t in unbiased.token_ids[:3]}
    ref = reference(offline, PROMPTS[5], max_tokens=10, logit_bias=bias)
    assert not set(bias) & set(ref.token_ids) and ref.token_ids != unbiased.token_ids
    http = client.completions.create(model=model_id, prompt=PROMPTS[5], max_tokens=10,
                                     temperature=0, logit_bias={str(t): b for t, b in bias.items()},
                                     extra_body=det_body())
    assert list(http.choices[0].token_ids) == ref.token_ids
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        req = pb.GenerateRequest(prompt=PROMPTS[5], max_tokens=10, temperature=0.0,
                                 is_deterministic=True, logit_bias=bias)
        events = list(pb_grpc.CompletionsStub(channel).Generate(req, timeout=120))
    ids = [t for e in events if e.WhichOneof("event") == "chunk" for t in e.chunk.token_ids]
    assert ids == ref.token_ids


def test_penalties_over_http_and_grpc_equal_offline(cluster: Cluster, client: openai.OpenAI,
                                                    model_id: str, offline: LLM) -> None:
    """OpenAI's presence and frequency penalties: a deterministic request with them equals
    the offline engine given the same penalties, over HTTP and over gRPC; without them the
    output differs (control)."""
    pen = {"presence_penalty": -1.0, "frequency_penalty": 0.3}  # rewards repeats: they show
    ref = reference(offline, PROMPTS[4], max_tokens=14, **pen)
    assert ref.token_ids != reference(offline, PROMPTS[4], max_tokens=14).token_ids
    http = client.completions.create(model=model_id, prompt=PROMPTS[4], max_tokens=14,
                                     temperature=0, extra_body=det_body(), **pen)
    assert list(http.choices[0].token_ids) == ref.token_ids
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        req = pb.GenerateRequest(prompt=PROMPTS[4], max_tokens=14, temperature=0.0,
                                 is_deterministic=True, **pen)
        events = list(pb_grpc.CompletionsStub(channel).Generate(req, timeout=120))
    ids = [t for e in events if e.WhichOneof("event") == "chunk" for t in e.chunk.token_ids]
    assert ids == ref.token_ids


def test_echo_with_logprobs_scores_the_prompt_deterministically(
        cluster: Cluster, client: openai.OpenAI, model_id: str, offline: LLM) -> None:
    """Loglikelihood scoring as evaluation harnesses do it (``echo``, ``logprobs``,
    ``max_tokens`` 1): the text starts with the prompt, the logprobs list every prompt token
    (the first without a logprob) then the output's, and a deterministic request's prompt
    logprobs equal the offline engine's bit for bit, streamed or not."""
    prompt = PROMPTS[2]
    ref = reference(offline, prompt, max_tokens=1, logprobs=1, prompt_logprobs=1)
    assert ref.prompt_logprobs is not None
    n = len(ref.prompt_token_ids)
    expected = [None] + [lp.logprob for lp in ref.prompt_logprobs[1:] if lp is not None]
    resp = client.completions.create(model=model_id, prompt=prompt, max_tokens=1,
                                     temperature=0, logprobs=1, echo=True,
                                     extra_body=det_body())
    choice = resp.choices[0]
    assert choice.text.startswith(prompt) and choice.logprobs is not None
    lps = choice.logprobs
    assert len(lps.tokens) == n + 1 and lps.top_logprobs[0] is None  # type: ignore[index]
    assert lps.token_logprobs[:n] == expected  # type: ignore[index]
    assert lps.token_logprobs[n] == ref.logprobs[0].logprob  # type: ignore[index]
    stream = list(client.completions.create(model=model_id, prompt=prompt, max_tokens=1,
                                            temperature=0, logprobs=1, echo=True, stream=True,
                                            extra_body=det_body()))
    first = next(c for c in stream if c.choices)
    assert first.choices[0].text.startswith(prompt)
    streamed = [v for c in stream for ch in c.choices if ch.logprobs
                for v in ch.logprobs.token_logprobs or []]
    assert streamed == lps.token_logprobs
    plain = client.completions.create(model=model_id, prompt=prompt, max_tokens=3,
                                      temperature=0, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        req = pb.GenerateRequest(prompt=prompt, max_tokens=1, temperature=0.0, logprobs=1,
                                 is_deterministic=True, echo=True)
        events = list(pb_grpc.CompletionsStub(channel).Generate(req, timeout=120))
    chunks = [e.chunk for e in events if e.WhichOneof("event") == "chunk"]
    assert chunks[0].text.startswith(prompt) and events[-1].complete.text.startswith(prompt)
    assert [lp.logprob for lp in chunks[0].prompt_logprobs] == expected[1:]
    assert not any(c.prompt_logprobs for c in chunks[1:])


def _decoder_stats() -> dict[str, tuple[int, float]]:
    """(open streams, committed tokens) of every decoder replica (calls pinned to each)."""
    import ray
    from ray import serve

    from services.decoder.messages import ReplicaPin

    handle = serve.get_deployment_handle("Decoder", app_name="detserve")
    replicas = [a["name"].rsplit("#", 1)[1] for a in ray.util.list_named_actors(all_namespaces=True)
                if "#Decoder#" in a["name"]]
    seen: dict[str, tuple[int, float]] = {}
    for replica in replicas:
        stats = handle.stats.remote(ReplicaPin(replica)).result(timeout_s=30)
        assert stats.replica == replica
        seen[replica] = (stats.num_streams, stats.engine.get("committed_tokens", 0.0))
    return seen


async def _stream_tokens(client: httpx.AsyncClient, body: dict[str, Any],
                         started: asyncio.Event, leave_when: asyncio.Event | None = None
                         ) -> tuple[int, bool]:
    """Tokens received and whether an error event came. ``started`` is set at the first
    event; with ``leave_when``, the client disconnects once that is set."""
    tokens, error = 0, False
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            error |= "error" in event
            tokens += sum(len(c.get("token_ids") or []) for c in event.get("choices", []))
            started.set()
            if leave_when is not None and leave_when.is_set():
                break  # leaves the stream: the connection closes
    return tokens, error


def test_client_disconnect_aborts_the_request_in_the_decoder(cluster: Cluster) -> None:
    """Chunks come through the router's link to each decoder (or its channel, before the
    links attach), not through the request's own call. A client that goes away must still
    end its request in the engine (it finishes
    with far fewer tokens committed than it asked for; with the decoder's abort removed the
    request runs to max_tokens and this fails), and only its request: the requests sharing
    the channels complete. The leaving request opened its replica's channel: the channel
    runs in a context of its own, since Ray Serve cancels the calls a cancelled request
    made (without that, the abort-removed run above still saw the request end after a
    few tokens: the channel had been cancelled with its opener)."""
    max_tokens = MAX_MODEL_LEN - 32
    body = {"model": cluster.args["model"], "prompt": "keep going", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}

    async def run(det: bool) -> tuple[tuple[int, bool], list[tuple[int, bool]]]:
        b = {**body, "is_deterministic": det}
        async with httpx.AsyncClient(base_url=cluster.http_url, timeout=120) as client:
            first, others_started = asyncio.Event(), [asyncio.Event() for _ in range(3)]
            all_started = asyncio.Event()
            leaver = asyncio.create_task(_stream_tokens(client, b, first, all_started))
            await asyncio.wait_for(first.wait(), 60)
            # equal costs: least-outstanding-tokens routing puts one of them beside the leaver
            others = [asyncio.create_task(_stream_tokens(client, b, e)) for e in others_started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in others_started)), 60)
            all_started.set()
            return await leaver, list(await asyncio.gather(*others))

    for det in (False, True):
        before = _decoder_stats()
        assert len(before) == cluster.args["num_decoders"] == 2
        (left, left_error), others = asyncio.run(run(det))
        assert others == [(max_tokens, False)] * 3, others
        assert left < max_tokens and not left_error
        deadline = time.monotonic() + 60
        after = _decoder_stats()
        while any(n for n, _ in after.values()):
            assert time.monotonic() < deadline, "a request is still open in a decoder"
            after = _decoder_stats()
        committed = sum(after[r][1] - before.get(r, (0, 0.0))[1] for r in after)
        assert committed < 4 * max_tokens, f"{committed} tokens: the request ran on"
