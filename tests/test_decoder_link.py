"""A decoder's link (services.decoder.link) and a router's hub of links (services.router.links),
without Ray: a real engine loop on a tiny model, a real gRPC server, a real Redis registry.

What it must show: requests submitted over a link come back complete and equal to the
engine's own output; an abort over the link ends the request in the engine; a link that
breaks fails its open requests (``LinkLost``) and stops being chosen; link messages are
typed protobuf, exact in both directions; bytes that are not a link message, or a submit
that is not a valid request, are refused and the server goes on serving; a caller without
the cluster secret is refused, and a router never attaches to a server that cannot prove
it holds the secret; TLS where a certificate is configured; with no link attached a
request fails with a 503 OpenAI error instead of hanging.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from detserve.engine import LLMEngine
from detserve.outputs import TokenLogprob
from detserve.params import SamplingParams
from services.cluster_auth import ClusterAuth, TlsFiles
from services.decoder import link_codec as codec
from services.decoder import link_pb2 as pb
from services.decoder.channel import deliver_on_event_loops
from services.decoder.engine_loop import EngineLoop
from services.decoder.link import KEEPALIVE, METHOD, SERVICE, LinkServer
from services.decoder.messages import DecodeChunk, DecodeRequest
from services.redis_server import EmbeddedRedis
from services.registry import Heartbeat, LinkRecord, Registry
from services.router import links
from services.router.links import Item, LinkHub, LinkLost
from tests.engine_utils import tiny_model

PROMPT = (5, 9, 17, 3, 44, 8, 21)
AUTH = ClusterAuth("test-cluster-secret-" + uuid.uuid4().hex)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as server:
        yield server.url


def _engine(model: str) -> LLMEngine:
    return LLMEngine.from_args(model, "nondeterministic", max_model_len=512)


def _request(rid: str, max_tokens: int) -> DecodeRequest:
    return DecodeRequest(rid, PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def _until(condition: Callable[[], object], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _drain(queue: asyncio.Queue[Item]) -> list[Item]:
    items: list[Item] = []
    while not items or (isinstance(items[-1], DecodeChunk) and not items[-1].finished):
        items.append(await asyncio.wait_for(queue.get(), 30))
        if isinstance(items[-1], LinkLost):
            break
    return items


def _tokens(items: list[Item]) -> list[int]:
    return [t for c in items if isinstance(c, DecodeChunk) for t in c.token_ids]


async def _impostor(address_host: str = "127.0.0.1") -> tuple[grpc.aio.Server, str]:
    """A link server that checks nothing and proves nothing (someone who wrote a record
    into Redis): it answers 'attached' to anyone."""
    async def open_(messages: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        yield codec.encode_chunks([])
        async for _ in messages:
            pytest.fail("a router sent frames to a server that did not prove the secret")

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {"Open": grpc.stream_stream_rpc_method_handler(open_)}),))
    port = server.add_insecure_port(f"{address_host}:0")
    await server.start()
    return server, f"{address_host}:{port}"


async def _scenario(redis_url: str, model: str) -> dict[str, object]:
    registry = Registry(redis_url, prefix="detserve")
    loop = EngineLoop(_engine(model), "rep-1", deliver=deliver_on_event_loops)
    loop.start()
    server = await LinkServer(loop, AUTH).start("127.0.0.1", bind="127.0.0.1")
    good = Heartbeat(registry, LinkRecord("rep-1", server.address), 3.0).start()
    # records the hub must never route to: a server of another cluster (it refuses the
    # hub's token), and one that proves nothing (it would take anyone's requests)
    foreign = await LinkServer(loop, ClusterAuth("another-clusters-secret-0")).start(
        "127.0.0.1", bind="127.0.0.1")
    impostor, impostor_address = await _impostor()
    forged = [LinkRecord("rep-foreign", foreign.address),
              LinkRecord("rep-impostor", impostor_address)]
    for record in forged:
        registry.register(record, 30.0)
    hub = LinkHub(redis_url, AUTH, poll_s=0.05, attach_timeout_s=5.0)
    hub.start()
    out: dict[str, object] = {}
    try:
        await _until(lambda: hub.attached == ["rep-1"])
        assert hub.pick(_request("x", 4)) == "rep-1"

        # 1. a complete request: every committed token, in order, finished
        items = await _drain(hub.submit(_request("r1", 12), "rep-1"))
        hub.release("r1", abort=False)
        chunks = [c for c in items if isinstance(c, DecodeChunk)]
        out["r1"] = _tokens(items)
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
        assert server.submitted == 1

        # 1b. a burst goes out coalesced, but in messages of at most MESSAGE_FRAMES frames
        links.MESSAGE_FRAMES, before = 2, server.messages
        try:
            queues = [hub.submit(_request(f"b{i}", 3), "rep-1") for i in range(5)]
            bursts = [await _drain(q) for q in queues]
        finally:
            links.MESSAGE_FRAMES = 256
        for i, items in enumerate(bursts):
            hub.release(f"b{i}", abort=False)
            assert isinstance(items[-1], DecodeChunk) and items[-1].finished
        assert server.submitted == 6 and server.messages - before == 3

        # 2. an abort over the link ends the request in the engine
        queue = hub.submit(_request("r2", 400), "rep-1")
        first = await asyncio.wait_for(queue.get(), 30)
        assert isinstance(first, DecodeChunk) and not first.finished
        committed = loop.stats["committed_tokens"]
        hub.release("r2", abort=True)
        await _until(lambda: loop.num_streams == 0)
        await asyncio.sleep(0.1)  # the loop publishes its stats after each step
        out["r2_tokens_after_abort"] = loop.stats["committed_tokens"] - committed

        # 3. the forged records were tried and refused, never attached
        await asyncio.sleep(0.3)
        assert hub.attached == ["rep-1"]
        assert all(record in hub._failed for record in forged)
        assert foreign.submitted == 0

        # 4. a request that cannot be encoded fails alone: nothing is sent, the link stays
        bad = DecodeRequest("bad", (2**70,), SamplingParams(max_tokens=3))
        with pytest.raises(ValueError, match="cannot be sent"):
            hub.submit(bad, "rep-1")
        items = await _drain(hub.submit(_request("after-bad", 5), "rep-1"))
        hub.release("after-bad", abort=False)
        out["after_bad"] = _tokens(items)

        # 5. the link breaks under an open request: LinkLost, and no link to pick
        queue = hub.submit(_request("r3", 400), "rep-1")
        await asyncio.wait_for(queue.get(), 30)
        await server.stop(None)
        items = await _drain(queue)
        out["r3_last"] = items[-1]
        hub.release("r3", abort=True)
        await _until(lambda: hub.attached == [])
        out["pick_after_loss"] = hub.pick(_request("x", 4))
        t0 = time.monotonic()
        out["wait_after_loss"] = await hub.wait(_request("x", 4), 0.3)
        out["waited_s"] = time.monotonic() - t0
    finally:
        hub.close()
        good.stop(deregister=True)
        for record in forged:
            registry.deregister(record)
        await server.stop(None)
        await foreign.stop(None)
        await impostor.stop(None)
        loop.stop()
    return out


def test_link_delivers_aborts_refuses_and_fails_over(redis_url: str) -> None:
    model = tiny_model()
    out = asyncio.run(_scenario(redis_url, model))
    engine = _engine(model)
    engine.add_request("ref", None, SamplingParams(max_tokens=12, ignore_eos=True),
                       prompt_token_ids=list(PROMPT))
    ref: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                ref = list(o.token_ids)
    assert out["r1"] == ref and len(ref) == 12
    assert out["r2_tokens_after_abort"] < 200, "the aborted request ran on"  # (asked 400)
    assert out["after_bad"] == ref[:5]
    lost = out["r3_last"]
    assert isinstance(lost, LinkLost) and "rep-1" in lost.message
    assert out["pick_after_loss"] is None
    assert out["wait_after_loss"] is None and 0.25 < out["waited_s"] < 5  # type: ignore[operator]


# ---- frames ---------------------------------------------------------------------------
def _every_option() -> SamplingParams:
    """Every field of SamplingParams off its default (the codec must carry each one)."""
    return SamplingParams(
        max_tokens=33, temperature=0.1 + 0.2, top_p=0.9, top_k=7, seed=2**63 - 1,
        is_deterministic=True, stop=("x", "\u00e9\u00e8"), stop_token_ids=(0, 2),
        ignore_eos=True, logprobs=3, prompt_logprobs=0, min_tokens=2,
        logit_bias={9: -100.0, 3: 0.1 + 0.2}, presence_penalty=-0.7,
        frequency_penalty=1.25, skip_special_tokens=False, output_kind="final_only")


def test_link_messages_round_trip_exactly_and_carry_every_sampling_field() -> None:
    params = _every_option()
    for f in dataclasses.fields(SamplingParams):
        if f.name not in codec.LOCAL_FIELDS:
            default = f.default_factory() if callable(f.default_factory) else f.default
            assert getattr(params, f.name) != default, f"the sample leaves {f.name} default"
    requests = [DecodeRequest("r-1", (1, 2, 2**40), params, accepted=12.5, dispatched=13.25,
                              avoid=("d-0", "d-1")),
                _request("r-2", 4),
                DecodeRequest("r-3", (4,), SamplingParams(logit_bias={}))]
    frames = [*(codec.encode_submit(r) for r in requests), codec.encode_abort("r-2")]
    back = codec.decode_frames(codec.encode_frames(frames))
    assert back == [*requests, codec.Abort("r-2")]
    assert [r.params.logit_bias for r in back[:3]] == [params.logit_bias, None, {}]  # type: ignore[union-attr]

    lp = TokenLogprob(6, -0.123456789012345, {6: -0.12, 3: -2.5, 9: -1e-300})
    chunks = [DecodeChunk("r-1", "d-0", text="h\u00e9", token_ids=(7, 3), logprobs=(lp, lp),
                          finished=True, finish_reason="stop", num_prompt_tokens=4,
                          num_output_tokens=2,
                          determinism={"fingerprint": "f00d", "verify_window": 8},
                          engine_stats={"rollbacks": 3.0, "x": 0.1 + 0.2},
                          prompt_logprobs=(None, lp)),
              DecodeChunk("r-2", "d-0", logprobs=()),
              DecodeChunk("r-3", "d-1", finished=True, error="no", error_type="server_error")]
    decoded = codec.decode_chunks(codec.encode_chunks(chunks))
    assert decoded == chunks
    assert list(decoded[0].logprobs[0].top) == [6, 3, 9], "top order is kept"  # type: ignore[index]
    assert decoded[1].logprobs == () and decoded[1].prompt_logprobs is None


class _Payload:
    """Unpickling this creates ``path``: what a pickled frame could make a decoder do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def test_bytes_that_are_not_a_link_message_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    bad = [b"\xff\xff\xff", pickle.dumps(_Payload(marker)),
           pickle.dumps([("submit", _request("old", 2))]),
           pb.RouterFrames(frames=[pb.RouterFrame()]).SerializeToString(),  # no kind
           pb.RouterFrames(frames=[pb.RouterFrame(abort="")]).SerializeToString(),
           pb.RouterFrames(frames=[pb.RouterFrame(abort="x" * 300)]).SerializeToString(),
           pb.Chunk(request_id="r", text="t").SerializeToString()]  # another message
    for data in bad:
        with pytest.raises(codec.FrameError):
            codec.decode_frames(data)
    assert not marker.exists()
    invalid = pb.RouterFrame(submit=pb.Submit(request_id="neg", prompt_token_ids=[1],
                                              params=pb.Sampling(max_tokens=4,
                                                                 temperature=-1.0,
                                                                 top_p=1.0)))
    empty = pb.RouterFrame(submit=pb.Submit(request_id="empty", params=pb.Sampling(
        max_tokens=4, top_p=1.0, output_kind="cumulative")))
    refused = codec.decode_frames(codec.encode_frames([invalid, empty]))
    assert [type(r) for r in refused] == [codec.Refused, codec.Refused]
    assert "temperature" in refused[0].error and "no tokens" in refused[1].error  # type: ignore[union-attr]


async def _raw_link(address: str, metadata: Any, messages: list[bytes], finished: int = 1
                    ) -> tuple[list[DecodeChunk], grpc.StatusCode | None]:
    """Open a link by hand and send ``messages``; read until the server ends the call, or
    (after its first message: attached) until ``finished`` requests have finished. Returns
    the chunks and the call's status (None: not ended by the server)."""
    channel = grpc.aio.insecure_channel(address, options=KEEPALIVE)
    outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
    for m in messages:
        outbox.put_nowait(m)

    async def frames() -> AsyncIterator[bytes]:
        while (m := await outbox.get()) is not None:
            yield m

    chunks: list[DecodeChunk] = []
    code: grpc.StatusCode | None = None
    call = channel.stream_stream(METHOD)(frames(), metadata=metadata)

    async def read() -> None:
        async for data in call:
            chunks.extend(codec.decode_chunks(data))
            if sum(c.finished for c in chunks) >= finished:
                return

    try:
        await asyncio.wait_for(read(), 30)
    except grpc.aio.AioRpcError as e:
        code = e.code()
    finally:
        outbox.put_nowait(None)
        call.cancel()
        await channel.close()
    return chunks, code


@asynccontextmanager
async def _attached_link(redis_url: str, model: str, replica: str, auth: ClusterAuth
                         ) -> AsyncIterator[tuple[LinkServer, LinkHub]]:
    """A decoder's link server, registered, and a router's hub attached to it; all stopped
    on the way out."""
    loop = EngineLoop(_engine(model), replica, deliver=deliver_on_event_loops)
    loop.start()
    server = await LinkServer(loop, auth).start("127.0.0.1", bind="127.0.0.1")
    registry = Registry(redis_url, prefix="detserve")
    beat = Heartbeat(registry, LinkRecord(replica, server.address), 3.0).start()
    hub = LinkHub(redis_url, auth, poll_s=0.05, attach_timeout_s=5.0)
    hub.start()
    try:
        await _until(lambda: hub.attached == [replica])
        yield server, hub
    finally:
        hub.close()
        beat.stop(deregister=True)
        await server.stop(None)
        loop.stop()


async def _hostile_callers(redis_url: str, model: str) -> dict[str, object]:
    out: dict[str, object] = {}
    submit = codec.encode_frames([codec.encode_submit(_request("ok", 3))])
    async with _attached_link(redis_url, model, "rep-h", AUTH) as (server, hub):
        used = AUTH.handshake(server.address).metadata
        callers = {
            "none": (),
            "forged": (("x-detserve-auth", f"{int(time.time())}.{'0' * 32}.{'f' * 64}"),),
            "foreign": ClusterAuth("another-clusters-secret-0").handshake(
                server.address).metadata,
            "other address": AUTH.handshake("10.0.0.1:1").metadata,
            "used": used,
        }
        out["used first"] = await _raw_link(server.address, used, [], finished=0)
        for name, metadata in callers.items():
            out[name] = await _raw_link(server.address, metadata, [submit])
        fresh = lambda: AUTH.handshake(server.address).metadata  # noqa: E731
        out["malformed"] = await _raw_link(server.address, fresh(), [b"\xff\xff\xff"])
        out["pickle"] = await _raw_link(server.address, fresh(),
                                        [pickle.dumps([("submit", _request("p", 2))])])
        invalid = pb.RouterFrame(submit=pb.Submit(
            request_id="neg", prompt_token_ids=[1],
            params=pb.Sampling(max_tokens=4, temperature=-1.0, top_p=1.0)))
        out["invalid then valid"] = await _raw_link(
            server.address, fresh(),
            [codec.encode_frames([invalid]), codec.encode_frames([
                codec.encode_submit(_request("valid", 4))])], finished=2)
        out["submitted"] = server.submitted
        # the router's own link was never disturbed
        items = await _drain(hub.submit(_request("after", 4), "rep-h"))
        hub.release("after", abort=False)
        out["after"] = _tokens(items)
    return out


def test_hostile_link_callers_are_refused_and_the_server_keeps_serving(redis_url: str) -> None:
    out = asyncio.run(_hostile_callers(redis_url, tiny_model()))
    chunks, code = out["used first"]  # type: ignore[misc]
    assert code is None and chunks == []  # attached: a valid token, once
    for name in ("none", "forged", "foreign", "other address", "used"):
        chunks, code = out[name]  # type: ignore[misc]
        assert code == grpc.StatusCode.UNAUTHENTICATED and chunks == [], name
    for name in ("malformed", "pickle"):
        chunks, code = out[name]  # type: ignore[misc]
        assert code == grpc.StatusCode.INVALID_ARGUMENT and chunks == [], name
    chunks, code = out["invalid then valid"]  # type: ignore[misc]
    neg = [c for c in chunks if c.request_id == "neg"]
    assert len(neg) == 1 and neg[0].error_type == "invalid_request"
    assert "temperature" in (neg[0].error or "")
    assert sum(len(c.token_ids) for c in chunks if c.request_id == "valid") == 4
    assert out["submitted"] == 1  # only "valid": nothing from the refused callers
    assert len(out["after"]) == 4  # type: ignore[arg-type]


async def _idle_link(model: str, keepalive_ms: int, idle_s: float) -> list[DecodeChunk]:
    """Open a link, leave it without data for ``idle_s`` while the client pings every
    ``keepalive_ms`` (as an idle router's link does every 10 s), then submit requests."""
    loop = EngineLoop(_engine(model), "rep-idle", deliver=deliver_on_event_loops)
    loop.start()
    server = await LinkServer(loop, AUTH).start("127.0.0.1", bind="127.0.0.1")
    options = [(k, v) for k, v in KEEPALIVE if k != "grpc.keepalive_time_ms"]
    channel = grpc.aio.insecure_channel(server.address,
                                        options=[*options, ("grpc.keepalive_time_ms", keepalive_ms)])
    outbox: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def frames() -> AsyncIterator[bytes]:
        while (frame := await outbox.get()) is not None:
            yield frame

    try:
        handshake = AUTH.handshake(server.address)
        call = channel.stream_stream(METHOD)(frames(), metadata=handshake.metadata)
        it = call.__aiter__()
        assert codec.decode_chunks(await it.__anext__()) == []  # attached
        assert handshake.verify(await call.initial_metadata())  # by the real server
        await asyncio.sleep(idle_s)  # idle: only the client's keepalive pings go by
        # one message, the frames a router had queued: both requests run
        outbox.put_nowait(codec.encode_frames([codec.encode_submit(_request("late", 6)),
                                               codec.encode_submit(_request("also", 3))]))
        chunks: list[DecodeChunk] = []
        while sum(c.finished for c in chunks) < 2:
            chunks += codec.decode_chunks(await asyncio.wait_for(it.__anext__(), 30))
        outbox.put_nowait(None)
        return chunks
    finally:
        await channel.close()
        await server.stop(0)
        loop.stop()


def test_an_idle_link_survives_the_routers_keepalive_pings() -> None:
    """A link with no data for a while still carries the next request: the link server
    accepts the router's keepalive pings however often they come. (A gRPC server's default
    policy answers a third ping within 5 minutes without data with GOAWAY "too_many_pings"
    and closes the connection: idle routers' links died after ~30 s, and this test failed
    with UNAVAILABLE "Too many pings" before the server's ping policy was set.) The pings
    come every second here, every 10 s in the cluster."""
    chunks = asyncio.run(_idle_link(tiny_model(), keepalive_ms=1000, idle_s=6.0))
    tokens = {rid: sum(len(c.token_ids) for c in chunks if c.request_id == rid)
              for rid in ("late", "also")}
    assert tokens == {"late": 6, "also": 3}
    assert all(any(c.finished for c in chunks if c.request_id == rid) for rid in ("late", "also"))


# ---- TLS ------------------------------------------------------------------------------
def _self_signed(tmp: Path, name: str) -> TlsFiles:
    crypto = pytest.importorskip("cryptography")
    del crypto
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
    (tmp / "cert.pem").write_bytes(pem)
    (tmp / "key.pem").write_bytes(key_pem)
    return TlsFiles(pem, key_pem, pem, name)


async def _tls_link(redis_url: str, model: str, auth: ClusterAuth) -> dict[str, object]:
    out: dict[str, object] = {}
    async with _attached_link(redis_url, model, "rep-tls", auth) as (server, hub):
        items = await _drain(hub.submit(_request("tls", 5), "rep-tls"))
        hub.release("tls", abort=False)
        out["tokens"] = _tokens(items)
        # a caller holding the secret but speaking plaintext gets no answer
        out["plain"] = await _raw_link(server.address,
                                       auth.handshake(server.address).metadata, [], finished=0)
    return out


def test_links_serve_tls_where_a_certificate_is_configured(redis_url: str,
                                                            tmp_path: Path) -> None:
    tls = _self_signed(tmp_path, "detserve-internal")
    env = {"DETSERVE_CLUSTER_SECRET": AUTH.secret,
           "DETSERVE_TLS_CERT": str(tmp_path / "cert.pem"),
           "DETSERVE_TLS_KEY": str(tmp_path / "key.pem")}
    auth = ClusterAuth.from_env(env)
    assert auth.tls == tls
    with pytest.raises(ValueError, match="both"):
        ClusterAuth.from_env({**env, "DETSERVE_TLS_KEY": ""})
    with pytest.raises(RuntimeError, match="no cluster secret"):
        ClusterAuth.from_env({})
    out = asyncio.run(_tls_link(redis_url, tiny_model(), auth))
    assert len(out["tokens"]) == 5  # type: ignore[arg-type]
    chunks, code = out["plain"]  # type: ignore[misc]
    assert chunks == [] and code == grpc.StatusCode.UNAVAILABLE


# ---- a replica whose engine failed ------------------------------------------------------
async def _failing_engine(redis_url: str, model: str) -> dict[str, object]:
    """A replica (the ``Decoder`` deployment's code, without Serve) whose engine step
    fails: the open request gets an error chunk, and the replica withdraws its link (out of
    the registry, closed), so routers stop choosing a replica that would fail everything
    at once until Ray Serve replaces it. Control: before the failure a request completes."""
    from services.decoder.deployment import Decoder

    registry = Registry(redis_url, prefix="detserve")
    engine = _engine(model)
    decoder = object.__new__(Decoder.func_or_class)  # type: ignore[attr-defined]
    decoder.replica, decoder._close = "rep-f", lambda: None
    decoder._event_loop = asyncio.get_running_loop()
    decoder.loop = EngineLoop(engine, "rep-f", deliver=deliver_on_event_loops,
                              on_failure=decoder._engine_failed)
    decoder.loop.start()
    decoder.link = await LinkServer(decoder.loop, AUTH).start("127.0.0.1", bind="127.0.0.1")
    record = LinkRecord("rep-f", decoder.link.address)
    decoder._link_beat = Heartbeat(registry, record, 3.0).start()
    hub = LinkHub(redis_url, AUTH, poll_s=0.05, attach_timeout_s=5.0)
    hub.start()
    out: dict[str, object] = {}
    try:
        await _until(lambda: hub.attached == ["rep-f"])
        items = await _drain(hub.submit(_request("ok", 4), "rep-f"))
        hub.release("ok", abort=False)
        out["ok"] = items[-1]

        def boom() -> None:
            raise RuntimeError("injected step failure")

        engine.step = boom  # type: ignore[method-assign]
        items = await _drain(hub.submit(_request("doomed", 4), "rep-f"))
        hub.release("doomed", abort=False)
        out["doomed"] = items[-1]
        await _until(lambda: hub.attached == [] and not registry.live_links())
        out["link"] = decoder.link
        out["pick"] = hub.pick(_request("x", 4))
    finally:
        hub.close()
        await decoder.withdraw_link()
        decoder.loop.stop()
    return out


def test_a_replica_whose_engine_failed_withdraws_its_link(redis_url: str) -> None:
    out = asyncio.run(_failing_engine(redis_url, tiny_model()))
    ok, doomed = out["ok"], out["doomed"]
    assert isinstance(ok, DecodeChunk) and ok.finished and ok.error is None
    assert isinstance(doomed, DecodeChunk) and doomed.error_type == "server_error"
    assert "injected step failure" in (doomed.error or "")
    assert out["link"] is None and out["pick"] is None


# ---- no link attached -------------------------------------------------------------------
def test_without_a_link_a_request_fails_with_a_503_instead_of_hanging(redis_url: str) -> None:
    """A router whose registry lists no link (start-up, every replica restarting) waits a
    bounded time for one, then answers 503 with an OpenAI error body. Control: the same
    router answers once a link is attached."""
    from fastapi.testclient import TestClient
    from test_serving_router import FakeDecoder, hello

    from services.router.http_app import build_http_app
    from services.router.limits import ServingLimits
    from services.router.model_context import ModelContext
    from services.router.service import RouterService

    model = tiny_model()
    ctx = ModelContext.load(model, max_model_len=128)
    prefix = f"nolink{uuid.uuid4().hex[:6]}"
    hub = LinkHub(redis_url, AUTH, poll_s=0.05)
    hub._registry = Registry(redis_url, prefix=prefix)  # an empty registry
    service = RouterService(ctx, ServingLimits(max_model_len=128), FakeDecoder(hello), hub)
    service.dispatcher.link_wait_s = 0.5
    body = {"model": ctx.model_id, "prompt": "hi", "max_tokens": 2}
    with TestClient(build_http_app(service)) as client:
        client.portal.call(hub.start)  # type: ignore[union-attr]
        t0 = time.monotonic()
        resp = client.post("/v1/completions", json=body)
        waited = time.monotonic() - t0
        assert resp.status_code == 503, resp.text
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert "no decoder link" in error["message"] and 0.4 < waited < 10
        stream = client.post("/v1/completions", json={**body, "stream": True})
        assert stream.status_code == 503 and "no decoder link" in stream.json()["error"]["message"]
        assert 'detserve:request_failures_total{type="unavailable"} 2.0' in \
            client.get("/metrics").text

        loop = EngineLoop(_engine(model), "rep-late", deliver=deliver_on_event_loops)
        loop.start()

        async def start_link() -> LinkServer:
            return await LinkServer(loop, AUTH).start("127.0.0.1", bind="127.0.0.1")

        server = client.portal.call(start_link)  # type: ignore[union-attr]
        beat = Heartbeat(hub._registry, LinkRecord("rep-late", server.address), 3.0).start()
        try:
            service.dispatcher.link_wait_s = 20.0  # the link attaches while it waits
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 2
        finally:
            beat.stop(deregister=True)
            client.portal.call(server.stop, None)  # type: ignore[union-attr]
            hub.close()
            loop.stop()
