"""This router's output channels: one stream per decoder replica for all its requests.

Without them every request is a Ray Serve stream of its own, so a decoder running B
requests sends B stream items per engine step, and Ray's per-item work (serializing, its
futures, the gRPC write) competes with the engine thread for the decoder's GIL. With a
channel, a request's ``generate`` call only says which replica took it (and ends when the
request does, so routing still counts its tokens until then); its chunks, with every other
request's of that step, come in one item of the replica's channel.

A channel is opened by a ``ChannelOpen`` call that the request router sends to that replica
only (``LeastTokensRouter``). When it fails (the replica died, or did not attach within
``attach_timeout_s``), every request bound to it gets ``ChannelLost``; the next request
routed there opens it again.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from services.decoder.messages import ChannelOpen, DecodeChunk

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChannelLost:
    """Put into a request's queue instead of its remaining chunks."""

    message: str


Item = DecodeChunk | ChannelLost


def deliver_wires(queues: dict[str, asyncio.Queue[Item]], wires: list[Any]) -> None:
    """A decoder's message (``DecodeChunk.to_wire`` data of several requests) into the
    queues of the requests still waiting for it."""
    for wire in wires:
        queue = queues.get(wire[0])  # wire[0]: the request id
        if queue is not None:
            queue.put_nowait(DecodeChunk.from_wire(wire))


class ChannelHub:
    def __init__(self, decoder: Any, attach_timeout_s: float = 10.0) -> None:
        """``decoder``: a streaming handle (``options(stream=True)``) to the decoders."""
        self.id = f"router-{uuid.uuid4().hex}"
        self._decoder = decoder
        self.attach_timeout_s = attach_timeout_s
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        self._replica_of: dict[str, str] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}

    def register(self, request_id: str) -> asyncio.Queue[Item]:
        """Before the request is sent: its chunks may arrive before ``bind``."""
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def bind(self, request_id: str, replica: str) -> None:
        """The request runs on ``replica``: make sure its channel is open."""
        self._replica_of[request_id] = replica
        if replica not in self._readers:
            # a fresh context: Ray Serve cancels the calls a request made when that request
            # is cancelled (its client left), and the channel serves every request
            self._readers[replica] = asyncio.create_task(self._read(replica),
                                                         context=contextvars.Context())

    def is_open(self, request_id: str, queue: asyncio.Queue[Item]) -> bool:
        """Is the request that registered ``queue`` still waiting for chunks?"""
        return self._queues.get(request_id) is queue

    def release(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._replica_of.pop(request_id, None)

    def close(self) -> None:
        for task in self._readers.values():
            task.cancel()

    async def _read(self, replica: str) -> None:
        stream = self._decoder.channel.remote(ChannelOpen(self.id, replica))
        error = "the channel ended"
        try:
            await asyncio.wait_for(stream.__anext__(), self.attach_timeout_s)
            async for batch in stream:
                deliver_wires(self._queues, batch)
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except TimeoutError:
            stream.cancel()
            error = f"no channel to decoder {replica} within {self.attach_timeout_s:.0f} s"
        except Exception as e:  # the replica died (RayError) or the stream broke
            error = f"{type(e).__name__}: {e}"
        finally:
            del self._readers[replica]
        log.warning("channel to decoder %s lost: %s", replica, error)
        for request_id, rep in list(self._replica_of.items()):
            queue = self._queues.get(request_id)
            if rep == replica and queue is not None:
                queue.put_nowait(ChannelLost(f"decoder {replica}: {error}"))
