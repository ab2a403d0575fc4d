"""The ``Decoder`` Ray Serve deployment: one engine (model, KV pool, fast path) per replica.

``generate`` is an async generator (call it through a handle with ``stream=True``): one
``DecodeChunk`` (sent as ``to_wire`` data) per engine step that committed tokens, the last
one ``finished``; or, with a router's channel id, the chunks go out on that router's
``channel`` stream. When the caller goes away (client disconnect, router cancel) the
request is aborted in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from ray import serve

from detserve.serve_config import DECODER
from services.decoder.engine_factory import DecoderSettings, build_engine
from services.decoder.engine_loop import EngineLoop, RequestTiming, deliver_each
from services.decoder.messages import (
    ChannelOpen,
    DecodeChunk,
    DecodeRequest,
    ReplicaPin,
    ReplicaStats,
    coalesce,
    coalesce_by_request,
)

log = logging.getLogger(__name__)


def _replica_id() -> str:
    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a Serve replica (tests constructing the class directly)
        return f"local-{os.getpid()}"


class _Channel:
    """One router's chunks on this replica, sent as one message per wake-up of the event
    loop (``Decoder.channel``) instead of one stream item per request and step."""

    def __init__(self) -> None:
        self.pending: list[DecodeChunk] = []
        self.ready = asyncio.Event()
        self.attached = False
        self.done: dict[str, asyncio.Event] = {}  # open requests: set by their last chunk

    def put(self, chunk: DecodeChunk) -> None:
        self.pending.append(chunk)
        self.ready.set()
        if chunk.finished:
            event = self.done.pop(chunk.request_id, None)
            if event is not None:
                event.set()


@dataclass(frozen=True)
class _ChannelSink:
    event_loop: asyncio.AbstractEventLoop
    channel: _Channel

    def __call__(self, chunk: DecodeChunk) -> None:
        self.channel.put(chunk)


@dataclass(frozen=True)
class _QueueSink:
    """A stream's queue, fed on its event loop (``_deliver_on_event_loops``)."""

    event_loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[DecodeChunk]

    def __call__(self, chunk: DecodeChunk) -> None:
        self.queue.put_nowait(chunk)


def _deliver_on_event_loops(batch: list[tuple[Any, DecodeChunk]]) -> None:
    """One engine step's chunks: one wake-up of each event loop they go to (not one per
    request: with many streams the per-call cross-thread wake-ups cost the engine thread
    time it needs for the next step)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, DecodeChunk]]] = {}
    for sink, chunk in batch:
        by_loop.setdefault(sink.event_loop, []).append((sink, chunk))
    for event_loop, items in by_loop.items():
        try:
            event_loop.call_soon_threadsafe(deliver_each, items)
        except RuntimeError:  # that loop is closed: the replica is going away, and its
            log.debug("dropped %d chunks for a closed event loop", len(items))  # streams


@serve.deployment(name=DECODER, health_check_period_s=5, health_check_timeout_s=30,
                  graceful_shutdown_timeout_s=5,
                  logging_config={"enable_access_log": False})  # the router logs requests
class Decoder:
    def __init__(self, args: Mapping[str, Any]) -> None:
        self.settings = DecoderSettings.from_args(args)
        if self.settings.switch_interval:  # this process is the replica's alone
            sys.setswitchinterval(self.settings.switch_interval)
        self.replica = _replica_id()
        engine, self._close = build_engine(self.settings, self.replica)
        self.loop = EngineLoop(engine, self.replica, deliver=_deliver_on_event_loops,
                               stream_interval=self.settings.stream_interval)
        self._channels: dict[str, _Channel] = {}
        self.loop.start()
        log.info("decoder %s ready (%s, mode %s)", self.replica, self.settings.model,
                 self.settings.mode)

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

    def _channel(self, channel_id: str) -> _Channel:
        """Router ``channel_id``'s channel here, created by whichever comes first: a request
        sent with it, or the router attaching."""
        channel = self._channels.get(channel_id)
        if channel is None:
            channel = self._channels[channel_id] = _Channel()
        return channel

    async def _generate_on_channel(self, request: DecodeRequest, channel_id: str
                                   ) -> AsyncIterator[tuple[Any, ...]]:
        channel = self._channel(channel_id)
        done = channel.done[request.request_id] = asyncio.Event()
        self.loop.submit(request, _ChannelSink(asyncio.get_running_loop(), channel))
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
                channel.ready.clear()
                batch, channel.pending = channel.pending, []
                yield [c.to_wire() for c in coalesce_by_request(batch)]
        finally:
            channel.attached = False
            for rid in list(channel.done):
                self.loop.abort(rid)
            self._forget_channel(open_.channel)

    def _forget_channel(self, channel_id: str) -> None:
        channel = self._channels.get(channel_id)
        if channel is not None and not channel.attached and not channel.done:
            del self._channels[channel_id]

    def ping(self) -> str:
        return self.replica

    def profile(self) -> Mapping[str, object]:
        return self.loop.determinism

    def stats(self, pin: ReplicaPin | None = None) -> ReplicaStats:
        """``pin``: only routes the call (to this replica)."""
        return ReplicaStats(self.replica, dict(self.loop.stats), self.loop.outstanding_tokens,
                            self.loop.num_streams, self.loop.healthy,
                            type(self.loop.engine.verifier).__name__)

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
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
            self._close()
