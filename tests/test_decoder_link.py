"""A decoder's link (services.decoder.link) and a router's hub of links (services.router.links),
without Ray: a real engine loop on a tiny model, a real gRPC server, a real Redis registry.

What it must show: requests submitted over a link come back complete and equal to the
engine's own output; an abort over the link ends the request in the engine; a link whose
token is wrong is never used; a link that breaks fails its open requests (``ChannelLost``)
and stops being chosen, so the dispatcher falls back to Ray Serve calls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from detserve.engine import LLMEngine
from detserve.params import SamplingParams
from services.decoder.channel import deliver_on_event_loops
from services.decoder.engine_loop import EngineLoop
from services.decoder.link import LinkServer
from services.decoder.messages import DecodeChunk, DecodeRequest
from services.redis_server import EmbeddedRedis
from services.registry import Heartbeat, LinkRecord, Registry
from services.router import links
from services.router.channels import ChannelLost, Item
from services.router.links import LinkHub
from tests.engine_utils import tiny_model

PROMPT = (5, 9, 17, 3, 44, 8, 21)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as server:
        yield server.url


def _engine(model: str) -> LLMEngine:
    return LLMEngine.from_args(model, "nondeterministic", max_model_len=512)


def _request(rid: str, max_tokens: int) -> DecodeRequest:
    return DecodeRequest(rid, PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def _until(condition: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _drain(queue: asyncio.Queue[Item]) -> list[Item]:
    items: list[Item] = []
    while not items or (isinstance(items[-1], DecodeChunk) and not items[-1].finished):
        items.append(await asyncio.wait_for(queue.get(), 30))
        if isinstance(items[-1], ChannelLost):
            break
    return items


async def _scenario(redis_url: str, model: str) -> dict[str, object]:
    registry = Registry(redis_url, prefix="detserve")
    loop = EngineLoop(_engine(model), "rep-1", deliver=deliver_on_event_loops)
    loop.start()
    server = await LinkServer(loop).start("127.0.0.1", bind="127.0.0.1")
    good = Heartbeat(registry, LinkRecord("rep-1", server.address, server.token), 3.0).start()
    # a record whose token is wrong: the hub must never route to it
    forged = LinkRecord("rep-forged", server.address, "not-the-token")
    registry.register(forged, 30.0)
    hub = LinkHub(redis_url, poll_s=0.05, attach_timeout_s=5.0)
    hub.start()
    out: dict[str, object] = {}
    try:
        await _until(lambda: hub.attached == ["rep-1"])
        assert hub.pick(_request("x", 4)) == "rep-1"

        # 1. a complete request: every committed token, in order, finished
        items = await _drain(hub.submit(_request("r1", 12), "rep-1"))
        hub.release("r1", abort=False)
        chunks = [c for c in items if isinstance(c, DecodeChunk)]
        out["r1"] = [t for c in chunks for t in c.token_ids]
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

        # 3. the forged record was tried and refused, never attached
        await asyncio.sleep(0.3)
        assert hub.attached == ["rep-1"]
        assert forged in hub._failed

        # 4. the link breaks under an open request: ChannelLost, and no link to pick
        queue = hub.submit(_request("r3", 400), "rep-1")
        await asyncio.wait_for(queue.get(), 30)
        await server.stop(None)
        items = await _drain(queue)
        out["r3_last"] = items[-1]
        hub.release("r3", abort=True)
        await _until(lambda: hub.attached == [])
        out["pick_after_loss"] = hub.pick(_request("x", 4))
    finally:
        hub.close()
        good.stop(deregister=True)
        registry.deregister(forged)
        await server.stop(None)
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
    lost = out["r3_last"]
    assert isinstance(lost, ChannelLost) and "rep-1" in lost.message
    assert out["pick_after_loss"] is None


async def _idle_link(model: str, keepalive_ms: int, idle_s: float) -> list[DecodeChunk]:
    """Open a link, leave it without data for ``idle_s`` while the client pings every
    ``keepalive_ms`` (as an idle router's link does every 10 s), then submit a request."""
    import grpc

    from services.decoder.link import KEEPALIVE, METHOD, SUBMIT, TOKEN_KEY, dumps, loads

    loop = EngineLoop(_engine(model), "rep-idle", deliver=deliver_on_event_loops)
    loop.start()
    server = await LinkServer(loop).start("127.0.0.1", bind="127.0.0.1")
    options = [(k, v) for k, v in KEEPALIVE if k != "grpc.keepalive_time_ms"]
    channel = grpc.aio.insecure_channel(server.address,
                                        options=[*options, ("grpc.keepalive_time_ms", keepalive_ms)])
    outbox: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def frames():  # type: ignore[no-untyped-def]
        while (frame := await outbox.get()) is not None:
            yield frame

    try:
        call = channel.stream_stream(METHOD)(frames(), metadata=((TOKEN_KEY, server.token),))
        it = call.__aiter__()
        assert loads(await it.__anext__()) == []  # attached
        await asyncio.sleep(idle_s)  # idle: only the client's keepalive pings go by
        outbox.put_nowait(dumps((SUBMIT, _request("bare", 6))))  # not a list: skipped
        # one message, the frames a router had queued: both requests run
        outbox.put_nowait(dumps([(SUBMIT, _request("late", 6)), (SUBMIT, _request("also", 3))]))
        chunks: list[DecodeChunk] = []
        while sum(c.finished for c in chunks) < 2:
            wires = loads(await asyncio.wait_for(it.__anext__(), 30))
            chunks += [DecodeChunk.from_wire(w) for w in wires]
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
              for rid in ("late", "also", "bare")}
    assert tokens == {"late": 6, "also": 3, "bare": 0}
    assert all(any(c.finished for c in chunks if c.request_id == rid) for rid in ("late", "also"))


async def _unpicklable_frame(redis_url: str, model: str) -> dict[str, object]:
    """A frame the writer cannot send (it does not pickle) ends the link, not the writer
    alone: the request fails over with ChannelLost, the link is dropped, and once the hub
    attaches it again a request completes over it."""
    registry = Registry(redis_url, prefix="detserve")
    loop = EngineLoop(_engine(model), "rep-w", deliver=deliver_on_event_loops)
    loop.start()
    server = await LinkServer(loop).start("127.0.0.1", bind="127.0.0.1")
    beat = Heartbeat(registry, LinkRecord("rep-w", server.address, server.token), 3.0).start()
    hub = LinkHub(redis_url, poll_s=0.05, attach_timeout_s=5.0, retry_s=0.5)
    hub.start()
    out: dict[str, object] = {}
    try:
        await _until(lambda: hub.attached == ["rep-w"])
        bad = DecodeRequest("bad", (lambda: 0,), SamplingParams(max_tokens=3))  # type: ignore[arg-type]
        items = await _drain(hub.submit(bad, "rep-w"))
        hub.release("bad", abort=False)
        out["bad_last"] = items[-1]
        out["attached_after"] = list(hub.attached)
        await _until(lambda: hub.attached == ["rep-w"])  # attached again
        items = await _drain(hub.submit(_request("good", 5), "rep-w"))
        hub.release("good", abort=False)
        out["good"] = [t for c in items if isinstance(c, DecodeChunk) for t in c.token_ids]
    finally:
        hub.close()
        beat.stop(deregister=True)
        await server.stop(None)
        loop.stop()
    return out


def test_a_frame_that_cannot_be_sent_ends_the_link(redis_url: str) -> None:
    out = asyncio.run(_unpicklable_frame(redis_url, tiny_model()))
    lost = out["bad_last"]
    assert isinstance(lost, ChannelLost) and "write failed" in lost.message, lost
    assert out["attached_after"] == [], "the link stayed attached without a writer"
    assert len(out["good"]) == 5  # type: ignore[arg-type]


async def _failing_engine(redis_url: str, model: str) -> dict[str, object]:
    """A replica (the ``Decoder`` deployment's code, without Serve) whose engine step
    fails: the open request gets an error chunk, and the replica withdraws its link (out of
    the registry, closed), so routers stop choosing a replica that would fail everything
    at once until Ray Serve replaces it. Control: before the failure a request completes."""
    from services.decoder.deployment import Decoder

    registry = Registry(redis_url, prefix="detserve")
    engine = _engine(model)
    decoder = object.__new__(Decoder.func_or_class)  # type: ignore[attr-defined]
    decoder.replica, decoder._channels, decoder._close = "rep-f", {}, lambda: None
    decoder._event_loop = asyncio.get_running_loop()
    decoder.loop = EngineLoop(engine, "rep-f", deliver=deliver_on_event_loops,
                              on_failure=decoder._engine_failed)
    decoder.loop.start()
    decoder.link = await LinkServer(decoder.loop).start("127.0.0.1", bind="127.0.0.1")
    record = LinkRecord("rep-f", decoder.link.address, decoder.link.token)
    decoder._link_beat = Heartbeat(registry, record, 3.0).start()
    hub = LinkHub(redis_url, poll_s=0.05, attach_timeout_s=5.0)
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
