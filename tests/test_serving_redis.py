"""Redis lost and back, on a running cluster (real Redis, real Ray Serve).

While Redis is away nothing a request needs is missing: the router keeps its decoder link,
the decoder its verifier stream. So streams open when Redis dies finish (the deterministic
one with exactly the offline lane's tokens: nothing unverified is released, though the
fast path is perturbed on purpose), new requests of both kinds are served, and /health
stays ready (200) all along, as a client would find. Redis then comes back EMPTY on the
same address: every decoder, verifier and link writes its record again, within a stated
bound, a verifier accepts the decoder's hello again (its epoch checked against the
restored registry), and deterministic output is the same as before the outage.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
import ray
import torch
from ray import serve
from serving_cluster import Cluster, G, W, serving_cluster

from detserve.llm import LLM
from detserve.params import SamplingParams
from services.cluster_auth import ClusterAuth
from services.registry import Registry
from services.router import detserve_pb2 as pb
from services.router import detserve_pb2_grpc as pb_grpc
from services.serve_config import APP_NAME, VERIFIER
from services.verifier import codec
from services.verifier import verifier_pb2_grpc as verifier_grpc

pytestmark = pytest.mark.timeout(600)
MAX_MODEL_LEN = 1024
PERTURBATION = 0.2
OUTAGE_S = 8.0       # Redis stays away this long: beyond a link's and a verifier's TTL (3 s)
STREAM_TIMEOUT_S = 120.0  # a stream open when Redis died ends within this (no hang)
RECOVERY_S = 5.0     # Redis back empty -> every record written again (heartbeats: 1 s)
PROBE_S = 2.0        # the router's health probe period (services.router.health)
UNAVAILABLE_S = 3 * PROBE_S  # requests would fail -> /health 503 within this
VERIFIER_START_S = 120.0  # Serve starts a replica for a killed verifier within this
LONG, SHORT = "Redis goes away while this streams", "After the outage"
LONG_TOKENS, SHORT_TOKENS = 600, 24


@pytest.fixture(scope="module", params=[False, True], ids=["colocated", "dedicated"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Every test runs against a co-located verifier (it maps the decoder's pool) and a
    dedicated one (another host: its own K/V, rows over gloo, groups made per stream)."""
    with serving_cluster(num_decoders=1, num_verifiers=1, max_model_len=MAX_MODEL_LEN,
                         fastpath_perturbation=PERTURBATION,
                         dedicated_verifiers=request.param) as c:
        yield c


def _verifier_info() -> dict[str, Any]:
    """The (only) verifier replica's counters, asked through Ray Serve (Redis may be away)."""
    from ray import serve

    return serve.get_deployment_handle(  # type: ignore[no-any-return]
        "Verifier", app_name="detserve").info.remote().result(timeout_s=30)


@pytest.fixture(scope="module")
def offline(cluster: Cluster) -> LLM:
    return LLM(cluster.args["model"], mode="lane_only", verify_window=W, verify_group=G,
               max_model_len=MAX_MODEL_LEN)


def reference(llm: LLM, prompt: str, max_tokens: int) -> list[int]:
    """The offline lane's tokens, single-threaded like a decoder replica."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, is_deterministic=True)
        return list(llm.generate([prompt], params)[0].token_ids)
    finally:
        torch.set_num_threads(threads)


def body(cluster: Cluster, prompt: str, max_tokens: int, deterministic: bool,
         **kw: Any) -> dict[str, Any]:
    return {"model": cluster.args["model"], "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "is_deterministic": deterministic, **kw}


async def _stream(client: httpx.AsyncClient, request: dict[str, Any],
                  started: asyncio.Event) -> list[tuple[float, dict[str, Any]]]:
    """(arrival time, event) of each SSE event."""
    events = []
    async with client.stream("POST", "/v1/completions", json=request) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append((time.monotonic(), json.loads(line[6:])))
                started.set()
    return events


async def _watch_health(client: httpx.AsyncClient, until: float) -> list[tuple[float, int]]:
    seen = []
    while time.monotonic() < until:
        resp = await client.get("/health")
        seen.append((time.monotonic(), resp.status_code))
        await asyncio.sleep(0.25)
    return seen


def _tokens(events: list[tuple[float, dict[str, Any]]]) -> list[int]:
    return [t for _, e in events for c in e.get("choices", []) for t in c["token_ids"]]


def _grpc_health(cluster: Cluster) -> pb.HealthResponse:
    with grpc.insecure_channel(cluster.grpc_address) as ch:
        reply: pb.HealthResponse = pb_grpc.CompletionsStub(ch).Health(pb.HealthRequest(),
                                                                      timeout=30)
        return reply


async def _kill_redis_under_streams(client: httpx.AsyncClient, cluster: Cluster
                                   ) -> tuple[list[asyncio.Task[Any]], float]:
    """Open a deterministic and a non-deterministic long stream, and once both have their
    first event kill Redis (SIGKILL). Returns the streams (deterministic first) and when
    Redis was killed."""
    started = [asyncio.Event(), asyncio.Event()]
    streams = [asyncio.create_task(_stream(client, body(cluster, LONG, LONG_TOKENS, d,
                                                        stream=True), e))
               for d, e in zip((True, False), started, strict=True)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    killed = time.monotonic()
    os.kill(cluster.redis.pid, signal.SIGKILL)
    return streams, killed


async def _through_outage(cluster: Cluster) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=cluster.http_url, timeout=STREAM_TIMEOUT_S) as client:
        streams, killed = await _kill_redis_under_streams(client, cluster)
        out["killed_at"] = killed
        health = asyncio.create_task(_watch_health(client, killed + OUTAGE_S))
        await asyncio.sleep(4.0)  # past the link's and the verifier's TTL
        assert not cluster.redis.running
        fresh = [await client.post("/v1/completions", json=body(cluster, SHORT, SHORT_TOKENS, d))
                 for d in (True, False)]
        out["grpc_health"] = await asyncio.to_thread(_grpc_health, cluster)
        out["det"], out["nondet"] = await asyncio.wait_for(asyncio.gather(*streams),
                                                           STREAM_TIMEOUT_S)
        out["health"] = await health
        out["fresh"] = fresh
        assert not cluster.redis.running, "Redis stayed away for the whole phase"
    return out


def test_streams_and_new_requests_are_served_while_redis_is_away(
        cluster: Cluster, offline: LLM) -> None:
    long_ref, short_ref = reference(offline, LONG, LONG_TOKENS), reference(offline, SHORT,
                                                                           SHORT_TOKENS)
    out = asyncio.run(_through_outage(cluster))
    det, nondet = out["det"], out["nondet"]
    # both streams were open when Redis died, and finished with no error
    assert det[-1][0] > out["killed_at"] and nondet[-1][0] > out["killed_at"]
    for events in (det, nondet):
        assert not any("error" in e for _, e in events), events[-1]
        assert events[-1][1]["choices"][0]["finish_reason"] == "length"
    assert len(_tokens(nondet)) == LONG_TOKENS
    assert _tokens(det) == long_ref, "a deterministic stream released an unverified token"
    # negative control: the fast path is perturbed, so unverified tokens would differ
    assert _tokens(nondet) != long_ref
    # new requests during the outage: served, the deterministic one exactly
    det_new, nondet_new = out["fresh"]
    assert det_new.status_code == 200 and nondet_new.status_code == 200, det_new.text
    assert det_new.json()["choices"][0]["token_ids"] == short_ref
    assert len(nondet_new.json()["choices"][0]["token_ids"]) == SHORT_TOKENS
    # requests succeed, so health says so: ready all along (HTTP and gRPC)
    statuses = [code for _, code in out["health"]]
    assert set(statuses) == {200}, statuses
    # watched all along: /health's answer changes at most once per probe period of the
    # router, so an answer at least every PROBE_S, from the kill to the outage's end, sees
    # any 503 it would give (a rate bound instead would fail on a slow machine)
    times = [out["killed_at"], *(t for t, _ in out["health"])]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) < PROBE_S, gaps
    assert times[-1] > out["killed_at"] + OUTAGE_S - PROBE_S, (times[-1], out["killed_at"])
    assert out["grpc_health"].ready, out["grpc_health"].status
    if cluster.args.get("dedicated_verifiers"):  # K/V moved, it was not mapped
        info = _verifier_info()
        assert info["kv_bytes_out"] > 0 and info["passes"] > 0, info
    after = sum(len(e["choices"][0]["token_ids"]) for t, e in det if t > out["killed_at"])
    print(f"\nredis away: the deterministic stream got {after} of {LONG_TOKENS} tokens after "
          f"the kill; both streams done {max(det[-1][0], nondet[-1][0]) - out['killed_at']:.2f}"
          " s "
          f"after it; {len(statuses)} health probes, all 200", flush=True)


def _recovered(registry: Registry) -> bool:
    links, verifiers = registry.live_links(), registry.live_verifiers()
    if len(links) != 1 or len(verifiers) != 1:
        return False
    record = registry.get_decoder(links[0].replica)
    return record is not None and registry.current_epoch(record.decoder_id) == record.epoch


def _hello_accepted(registry: Registry) -> bool:
    """A decoder's hello, as its verifier client would send it after losing its stream,
    is accepted: the epoch is checked against the restored registry."""
    record = registry.get_decoder(registry.live_links()[0].replica)
    assert record is not None
    address = registry.live_verifiers()[0].address
    auth = ClusterAuth.from_env()  # the cluster's secret (services.local put it here)
    with grpc.insecure_channel(address) as ch:
        replies = verifier_grpc.VerifierStub(ch).Verify(
            iter([codec.encode_hello(record)]), timeout=10,
            metadata=auth.handshake(address).metadata)
        try:
            return next(replies).WhichOneof("kind") == "ready"
        except grpc.RpcError:
            return False


def test_cluster_recovers_by_itself_when_redis_comes_back_empty(
        cluster: Cluster, offline: LLM) -> None:
    redis = cluster.redis
    redis.stop()   # the killed process's leftovers
    back = time.monotonic()
    redis.start()  # same port and password, no data
    registry = Registry(redis.url)
    try:
        while not _recovered(registry):
            assert time.monotonic() - back < RECOVERY_S, "records not written again in time"
            time.sleep(0.05)
        recovered_s = time.monotonic() - back
        assert _hello_accepted(registry)
        with httpx.Client(base_url=cluster.http_url, timeout=60) as client:
            health = client.get("/health")
            assert health.status_code == 200, health.text
            resp = client.post("/v1/completions",
                               json=body(cluster, SHORT, SHORT_TOKENS, True))
        served_s = time.monotonic() - back
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == reference(offline, SHORT, SHORT_TOKENS)
        print(f"\nredis back empty: records whole after {recovered_s:.2f} s, "
              f"deterministic request served {served_s:.2f} s after", flush=True)
    finally:
        registry.close()


def _verifier_actors() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if "#Verifier#" in a["name"]}


def _kill_verifiers() -> set[str]:
    names = _verifier_actors()
    for name in names:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return names


def _wait_verifier_replaced(killed: set[str], bound_s: float) -> None:
    """Until Serve runs a new verifier replica (started: its constructor done). It starts
    while Redis is away and registers once Redis is back: a timed bound after Redis comes
    back then measures that registration, not a replica's cold start."""
    since = time.monotonic()
    while True:
        verifier = serve.status().applications[APP_NAME].deployments[VERIFIER]
        running = sum(n for state, n in verifier.replica_states.items() if state == "RUNNING")
        if _verifier_actors() - killed and running >= 1:
            return
        assert time.monotonic() - since < bound_s, f"no new verifier replica: {verifier}"
        time.sleep(0.2)


def _wait_health(client: httpx.Client, status: int, since: float, bound_s: float
                 ) -> tuple[float, httpx.Response]:
    while True:
        resp = client.get("/health")
        if resp.status_code == status:
            return time.monotonic() - since, resp
        assert time.monotonic() - since < bound_s, f"/health still {resp.status_code}: {resp.text}"
        time.sleep(0.1)


def test_health_turns_unavailable_when_verification_cannot_continue(
        cluster: Cluster, offline: LLM) -> None:
    """Redis away AND the verifier lost: no decoder can find another verifier, so
    deterministic requests would fail: /health says so (503, ``no_verifier``) within
    ``UNAVAILABLE_S``, a deterministic request gets that 503 at once, and
    non-deterministic requests are still served; /livez answers 200 all the while. Redis back
    (empty): the restarted verifier registers, /health is ready again within
    ``RECOVERY_S`` + one probe period, and the decoder fails over to the new verifier (its
    hello checked against the restored registry) with the same deterministic output."""
    redis = cluster.redis
    with httpx.Client(base_url=cluster.http_url, timeout=60) as client:
        assert client.get("/health").status_code == 200
        os.kill(redis.pid, signal.SIGKILL)
        killed = _kill_verifiers()
        assert len(killed) == 1
        lost = time.monotonic()  # after the kill's own Ray calls: the bound is health's
        unavailable_s, health = _wait_health(client, 503, lost, UNAVAILABLE_S)
        error = health.json()["error"]
        assert error["code"] == "no_verifier" and "verif" in error["message"], error
        # not ready, yet alive: liveness asks nothing of Redis or the verifiers
        live = client.get("/livez")
        assert live.status_code == 200 and live.json() == {"status": "alive"}, live.text
        grpc_health = _grpc_health(cluster)
        assert not grpc_health.ready and "verifier" in grpc_health.status, grpc_health
        # a deterministic request ends at once with that error (the decoder's engine is not
        # stopped over it); a non-deterministic one is served
        resp = client.post("/v1/completions", json=body(cluster, SHORT, SHORT_TOKENS, True))
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_verifier"
        resp = client.post("/v1/completions", json=body(cluster, SHORT, SHORT_TOKENS, False))
        assert resp.status_code == 200, resp.text
        _wait_verifier_replaced(killed, VERIFIER_START_S)
        redis.stop()
        back = time.monotonic()
        redis.start()
        ready_s, _ = _wait_health(client, 200, back, RECOVERY_S + 2 * PROBE_S)
        assert _grpc_health(cluster).ready
        resp = client.post("/v1/completions", json=body(cluster, SHORT, SHORT_TOKENS, True))
        served_s = time.monotonic() - back
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == reference(offline, SHORT, SHORT_TOKENS)
        print(f"\nredis and verifier lost: /health 503 after {unavailable_s:.2f} s; redis back "
              f"empty: /health 200 after {ready_s:.2f} s, deterministic request served "
              f"{served_s:.2f} s after", flush=True)


FAILOVER_S = 30.0  # RemoteVerifier's failover_timeout_s: how long a decoder looks for another
LANE_LOST_S = FAILOVER_S + 15.0  # verifier lost, none to be had -> the stream's error within


async def _streams_through_lane_loss(cluster: Cluster) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=cluster.http_url, timeout=STREAM_TIMEOUT_S) as client:
        streams, out["lost_at"] = await _kill_redis_under_streams(client, cluster)
        assert len(await asyncio.to_thread(_kill_verifiers)) == 1
        out["det"], out["nondet"] = await asyncio.wait_for(asyncio.gather(*streams),
                                                           STREAM_TIMEOUT_S)
    return out


def test_lost_verification_ends_deterministic_streams_only(
        cluster: Cluster, offline: LLM) -> None:
    """Redis away AND the verifier killed while a deterministic and a non-deterministic
    stream run: the deterministic stream ends with a clear error (no_verifier,
    "verification unavailable") within ``LANE_LOST_S``, every token it got being the
    offline lane's; the non-deterministic one streams on to its last token, not waiting for
    the decoder's search for another verifier. Redis back:
    /health is ready again and deterministic output is the offline lane's."""
    long_ref = reference(offline, LONG, LONG_TOKENS)
    redis = cluster.redis
    try:
        out = asyncio.run(_streams_through_lane_loss(cluster))
    finally:
        redis.stop()
        redis.start()
    det, nondet = out["det"], out["nondet"]
    error = det[-1][1].get("error")
    assert error is not None and error["code"] == "no_verifier", det[-1]
    assert "verification unavailable" in error["message"], error
    ended_s = det[-1][0] - out["lost_at"]
    assert ended_s < LANE_LOST_S, f"the deterministic stream ended {ended_s:.1f} s after"
    got = _tokens(det)
    assert got == long_ref[:len(got)] and len(got) < LONG_TOKENS, "an unverified token"
    assert not any("error" in e for _, e in nondet), nondet[-1]
    assert nondet[-1][1]["choices"][0]["finish_reason"] == "length"
    assert len(_tokens(nondet)) == LONG_TOKENS
    # the decoder looks for another verifier off its engine thread: the other stream does
    # not wait for that search (it ends before the deterministic one's error)
    assert nondet[-1][0] < det[-1][0], "the non-deterministic stream waited for the search"
    with httpx.Client(base_url=cluster.http_url, timeout=60) as client:
        back = time.monotonic()
        ready_s, _ = _wait_health(client, 200, back, RECOVERY_S + 2 * PROBE_S + FAILOVER_S)
        resp = client.post("/v1/completions", json=body(cluster, SHORT, SHORT_TOKENS, True))
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == reference(offline, SHORT, SHORT_TOKENS)
    print(f"\nredis and verifier lost under load: deterministic stream ended with "
          f"no_verifier {ended_s:.2f} s after ({len(got)} verified tokens); the other one "
          f"streamed on to its {LONG_TOKENS} tokens; /health 200 {ready_s:.2f} s after Redis "
          "came back", flush=True)
