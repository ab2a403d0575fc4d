"""One router's chunks on a decoder replica, gathered between wake-ups of an event loop.

The engine thread puts each step's chunks into the channels of the routers that sent the
requests (``ChannelSink``, delivered on the sink's event loop); the router's link
(``services.decoder.link``) takes everything gathered since its last send as one message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.decoder.messages import DecodeChunk

log = logging.getLogger(__name__)
Sink = Callable[[DecodeChunk], object]
Deliver = Callable[[list[tuple[Sink, DecodeChunk]]], object]


def deliver_each(batch: list[tuple[Sink, DecodeChunk]]) -> None:
    """Call each chunk's sink (on the caller's thread)."""
    for sink, chunk in batch:
        sink(chunk)


class Channel:
    def __init__(self) -> None:
        self.pending: list[DecodeChunk] = []
        self.ready = asyncio.Event()
        self.open: set[str] = set()  # requests without their last chunk yet

    def put(self, chunk: DecodeChunk) -> None:
        self.pending.append(chunk)
        self.ready.set()
        if chunk.finished:
            self.open.discard(chunk.request_id)

    def take(self) -> list[DecodeChunk]:
        """Everything gathered since the last call."""
        self.ready.clear()
        batch, self.pending = self.pending, []
        return batch


@dataclass(frozen=True)
class ChannelSink:
    """A request's sink: its chunks go into ``channel`` on ``event_loop``."""

    event_loop: asyncio.AbstractEventLoop
    channel: Channel

    def __call__(self, chunk: DecodeChunk) -> None:
        self.channel.put(chunk)


def deliver_on_event_loops(batch: list[tuple[Any, DecodeChunk]]) -> None:
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
