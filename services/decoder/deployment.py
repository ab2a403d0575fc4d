"""The ``Decoder`` Ray Serve deployment: one engine (model, KV pool, fast path) per replica.

``generate`` is an async generator (call it through a handle with ``stream=True``): one
``DecodeChunk`` (sent as ``to_wire`` data) per engine step that committed tokens, the last
one ``finished``; or, with a router's channel id, the chunks go out on that router's
``channel`` stream. When the caller goes away (client disconnect, router cancel) the
request is aborted in the engine.

Routers normally use neither: each replica also serves a link (``services.decoder.link``),
one gRPC stream per router carrying requests in and chunks out, published in Redis;
``generate`` and ``channel`` serve routers without a link (starting up, ``decoder_link``
off, no Redis).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import redis
from ray import serve

from services.decoder.channel import (
    Channel,
    ChannelSink,
    deliver_on_event_loops,
)
from services.decoder.engine_factory import DecoderSettings, build_engine
from services.decoder.engine_loop import EngineLoop, RequestTiming
from services.decoder.link import LinkServer
from services.decoder.messages import (
    ChannelOpen,
    DecodeChunk,
    DecodeRequest,
    ReplicaPin,
    ReplicaStats,
    coalesce,
    coalesce_by_request,
)
from services.registry import Heartbeat, LinkRecord, Registry
from services.serve_config import DECODER

log = logging.getLogger(__name__)
# how long the finished chunks of a router that has not attached its channel wait for it
STALE_CHANNEL_S = 300.0


def _replica_id() -> str:
    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a Serve replica (tests constructing the class directly)
        return f"local-{os.getpid()}"


@dataclass(frozen=True)
class _QueueSink:
    """A stream's queue, fed on its event loop (``deliver_on_event_loops``)."""

    event_loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[DecodeChunk]

    def __call__(self, chunk: DecodeChunk) -> None:
        self.queue.put_nowait(chunk)


@serve.deployment(name=DECODER, health_check_period_s=5, health_check_timeout_s=30,
                  graceful_shutdown_timeout_s=5,
                  logging_config={"enable_access_log": False})  # the router logs requests
class Decoder:
    async def __init__(self, args: Mapping[str, Any]) -> None:  # type: ignore[misc]
        self.settings = DecoderSettings.from_args(args)
        if self.settings.serve.switch_interval:  # this process is the replica's alone
            sys.setswitchinterval(self.settings.serve.switch_interval)
        self.replica = _replica_id()
        engine, self._close = build_engine(self.settings, self.replica)
        self._event_loop = asyncio.get_running_loop()
        self.loop = EngineLoop(engine, self.replica, deliver=deliver_on_event_loops,
                               stream_interval=self.settings.serve.stream_interval,
                               on_failure=self._engine_failed)
        self._channels: dict[str, Channel] = {}
        self.loop.start()
        self.link: LinkServer | None = None
        self._link_beat: Heartbeat | None = None
        if self.settings.serve.decoder_link:
            await self._start_link()
        cfg = self.settings.engine
        log.info("decoder %s ready (%s, mode %s, link %s)", self.replica, cfg.model,
                 cfg.mode, self.link.address if self.link else "off")

    async def _start_link(self) -> None:
        """Serve a link (``services.decoder.link``) and publish it in Redis; without Redis
        the replica still serves through Ray Serve calls."""
        import ray

        link = await LinkServer(self.loop).start(ray.util.get_node_ip_address())
        try:
            record = LinkRecord(self.replica, link.address, link.token)
            self._link_beat = Heartbeat(Registry(self.settings.serve.redis_url), record).start()
        except redis.RedisError as e:
            log.warning("decoder %s: link not published (%s); Ray Serve calls only",
                        self.replica, e)
            await link.stop()
            return
        self.link = link

    def _engine_failed(self) -> None:
        """On the engine thread, once its step failed: withdraw the link (below)."""
        asyncio.run_coroutine_threadsafe(self.withdraw_link(), self._event_loop)

    async def withdraw_link(self) -> None:
        """Take the link out of the registry and close it: a replica whose engine failed
        answers every request at once with an error, so with the fewest outstanding tokens
        it would draw the routers' traffic until Ray Serve's health check replaces it.
        Routers whose link breaks route elsewhere; Ray Serve calls still reach the replica
        (refused with an error) until then."""
        beat, self._link_beat = self._link_beat, None
        if beat is not None:
            await asyncio.to_thread(beat.stop, True)
        link, self.link = self.link, None
        if link is not None:
            await link.stop(0)
            log.warning("decoder %s: engine failed, link withdrawn", self.replica)

    async def generate(self, request: DecodeRequest, channel: str | None = None
                       ) -> AsyncIterator[tuple[Any, ...]]:
        """The request's chunks as ``DecodeChunk.to_wire`` data; or, with ``channel``, only
        this replica's id first, the chunks going out on that router's channel, and the
        call ending when the request has (its last chunk is on the channel by then)."""
        if channel is not None:
            async for item in self._generate_on_channel(request, channel):
                yield item
            return
        chunks: asyncio.Queue[DecodeChunk] = asyncio.Queue()
        self.loop.submit(request, _QueueSink(asyncio.get_running_loop(), chunks))
        finished = False
        try:
            while not finished:
                # every chunk still queued goes out in one message: when Ray's streaming
                # falls behind the engine, it sends fewer, larger chunks instead of a backlog
                batch = [await chunks.get()]
                while not batch[-1].finished and not chunks.empty():
                    batch.append(chunks.get_nowait())
                for chunk in coalesce(batch):
                    finished = chunk.finished
                    yield chunk.to_wire()
        finally:
            if not finished:
                self.loop.abort(request.request_id)

    def _channel(self, channel_id: str) -> Channel:
        """Router ``channel_id``'s channel here, created by whichever comes first: a request
        sent with it, or the router attaching."""
        channel = self._channels.get(channel_id)
        if channel is None:
            self._drop_stale_channels()
            channel = self._channels[channel_id] = Channel()
        return channel

    async def _generate_on_channel(self, request: DecodeRequest, channel_id: str
                                   ) -> AsyncIterator[tuple[Any, ...]]:
        channel = self._channel(channel_id)
        done = channel.done[request.request_id] = asyncio.Event()
        self.loop.submit(request, ChannelSink(asyncio.get_running_loop(), channel))
        try:
            yield (self.replica,)
            await done.wait()
        finally:
            if not done.is_set():
                channel.done.pop(request.request_id, None)
                self.loop.abort(request.request_id)
            self._forget_channel(channel_id)

    async def channel(self, open_: ChannelOpen) -> AsyncIterator[list[tuple[Any, ...]]]:
        """Router channel ``open_.channel``'s chunks of every request it sent here: each
        item is everything that arrived since the previous one. First item: empty (the
        channel is attached). Ends when the caller cancels it; its open requests abort."""
        channel = self._channel(open_.channel)
        channel.attached = True
        try:
            yield []
            while True:
                await channel.ready.wait()
                yield [c.to_wire() for c in coalesce_by_request(channel.take())]
        finally:
            channel.attached = False
            for rid in list(channel.done):
                self.loop.abort(rid)
            self._forget_channel(open_.channel)

    def _forget_channel(self, channel_id: str) -> None:
        """Drop a channel nobody needs: not attached, no open request, and nothing waiting
        to go out. A short request can finish before its router attaches (the router
        opens the channel only once the request's call has named this replica): its
        chunks wait here for the router, which attaches right after."""
        channel = self._channels.get(channel_id)
        if channel is not None and not channel.attached and not channel.done \
                and not channel.pending:
            del self._channels[channel_id]

    def _drop_stale_channels(self) -> None:
        """Chunks kept for a router that never attached (it went away) go after
        ``STALE_CHANNEL_S``."""
        horizon = time.monotonic() - STALE_CHANNEL_S
        for channel_id, channel in list(self._channels.items()):
            if not channel.attached and not channel.done and channel.last_put < horizon:
                del self._channels[channel_id]

    def ping(self) -> str:
        return self.replica

    def profile(self) -> Mapping[str, object]:
        return self.loop.determinism

    def stats(self, pin: ReplicaPin | None = None) -> ReplicaStats:
        """``pin``: only routes the call (to this replica)."""
        return ReplicaStats(self.replica, dict(self.loop.stats), self.loop.outstanding_tokens,
                            self.loop.num_streams, self.loop.healthy,
                            type(self.loop.engine.verifier).__name__,
                            self.link.submitted if self.link else 0)

    def request_timings(self, since: float = 0.0) -> list[RequestTiming]:
        """Where finished requests' time to first token went in this replica (see
        ``RequestTiming``): benchmarks split a served TTFT with it."""
        return self.loop.timings(since)

    def record_routing_stats(self) -> dict[str, Any]:
        return {"outstanding_tokens": self.loop.outstanding_tokens}

    def check_health(self) -> None:
        if not self.loop.healthy:
            raise RuntimeError(f"decoder {self.replica}: engine loop failed")

    def __del__(self) -> None:
        beat = getattr(self, "_link_beat", None)
        if beat is not None:  # routers stop choosing this replica's link
            beat.stop(deregister=True)
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
            self._close()
