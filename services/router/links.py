"""This router's links to decoder replicas (``services.decoder.link``), and routing over them.

The hub reads the live links from the Redis registry every ``poll_s`` and keeps one stream
open to each. A request goes to the attached link whose replica has the fewest outstanding
tokens (prefix affinity first for deterministic requests, ``TokenLedger``), avoiding the
replicas that already failed it while another is attached; its chunks come back on that
stream with every other request's of the same engine step and are handed to the request's
queue.

A link that breaks (the replica died, or did not attach within ``attach_timeout_s``) gives
each of its requests ``LinkLost``, which the dispatcher turns into a failure or a
deterministic replay; its record is tried again only after ``retry_s``. While no link is
attached (a router that just started, replicas restarting) ``wait`` waits for one, for a
bounded time.

Redis only tells where links are: while it is away the hub keeps the links it has and
requests go on over them. When it comes back empty (``Registry.instance`` changed), the
links' heartbeats write them again within a third of their TTL; until ``relist_s`` has
passed the hub does not take a link that is missing from the listing for a withdrawn one.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc

from services.cluster_auth import ClusterAuth
from services.decoder import link_codec as codec
from services.decoder import link_pb2 as pb
from services.decoder.link import KEEPALIVE, METHOD
from services.decoder.messages import DecodeChunk, DecodeRequest
from services.registry import LinkRecord, Registry
from services.router.load_ledger import TokenLedger

log = logging.getLogger(__name__)


# what one message carries at most: frames, and prompt tokens over its submit frames (a
# token encodes in at most 10 bytes: a burst of long prompts stays far below the link's
# 64 MiB message limit; a frame larger than this still goes, alone)
MESSAGE_FRAMES = 256
MESSAGE_TOKENS = 1 << 20


@dataclass(frozen=True)
class LinkLost:
    """Put into a request's queue instead of its remaining chunks."""

    message: str


Item = DecodeChunk | LinkLost


def _tokens(frame: pb.RouterFrame) -> int:
    return len(frame.submit.prompt_token_ids) if frame.HasField("submit") else 0


class _Link:
    """One stream to one decoder replica; frames to send go through one writer task, which
    sends every frame queued by the time it runs as one message (a burst of requests costs
    one gRPC write, not one each)."""

    def __init__(self, hub: LinkHub, record: LinkRecord) -> None:
        self.hub = hub
        self.record = record
        self.attached = False
        self.listed = True           # still in the registry
        self._out: asyncio.Queue[pb.RouterFrame] = asyncio.Queue()
        self._write_error = ""       # why the writer stopped (it then ends the link)
        self._channel = hub.auth.aio_channel(record.address, options=KEEPALIVE)
        # a context of its own: no request's cancellation reaches the link
        self.task = asyncio.create_task(self._run(), context=contextvars.Context())

    def send(self, frame: pb.RouterFrame) -> None:
        self._out.put_nowait(frame)

    async def _run(self) -> None:
        error = "the link ended"
        handshake = self.hub.auth.handshake(self.record.address)
        call = self._channel.stream_stream(METHOD)(metadata=handshake.metadata)
        writer: asyncio.Task[None] | None = None
        try:
            first = await asyncio.wait_for(call.read(), self.hub.attach_timeout_s)
            if first is grpc.aio.EOF:
                raise ConnectionError("closed before it attached")
            if not handshake.verify(await call.initial_metadata()):
                raise ConnectionError("the server did not prove it holds the cluster secret")
            self.attached = True
            self.hub.attached_changed()
            writer = asyncio.create_task(self._write(call))
            while True:
                data = await call.read()
                if data is grpc.aio.EOF:
                    break
                self.hub.deliver(codec.decode_chunks(data))
        except asyncio.CancelledError:
            error = self._write_error or "closed by the router"
            raise
        except TimeoutError:
            error = f"not attached within {self.hub.attach_timeout_s:.0f} s"
        except Exception as e:  # grpc.aio.AioRpcError (died, refused), codec.FrameError
            error = f"{type(e).__name__}: {e}"
        finally:
            self.attached = False
            if writer is not None:
                writer.cancel()
            call.cancel()
            self.hub.lost(self, error)
            await self._channel.close()

    async def _write(self, call: Any) -> None:
        try:
            while True:
                frames = [await self._out.get()]
                tokens = _tokens(frames[0])
                while (not self._out.empty() and len(frames) < MESSAGE_FRAMES
                       and tokens < MESSAGE_TOKENS):
                    frames.append(self._out.get_nowait())
                    tokens += _tokens(frames[-1])
                await call.write(codec.encode_frames(frames))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the stream broke
            log.debug("link to %s: write failed: %s", self.record.replica, e)
            # end the link rather than leave it attached with no writer, where every
            # request sent over it would wait forever: its open requests fail over
            self._write_error = f"write failed: {type(e).__name__}: {e}"
            self.task.cancel()


class LinkHub:
    def __init__(self, redis_url: str, auth: ClusterAuth, *, poll_s: float = 1.0,
                 attach_timeout_s: float = 5.0, retry_s: float = 10.0,
                 relist_s: float = 3.0) -> None:
        self._registry = Registry(redis_url)
        self.auth = auth
        self.poll_s = poll_s
        self.attach_timeout_s = attach_timeout_s
        self.retry_s = retry_s
        self.relist_s = relist_s
        self._instance = ""                          # the registry's data generation
        self._relisting_until = 0.0                  # Redis came back empty: links re-register
        self._links: dict[str, _Link] = {}          # replica -> its link
        self._failed: dict[LinkRecord, float] = {}   # record -> when its link broke
        self.queues: dict[str, asyncio.Queue[Item]] = {}   # request -> its chunks
        self._link_of: dict[str, _Link] = {}                # request -> the link it went on
        self._ledger = TokenLedger()
        self._changed = asyncio.Event()              # set when a link attaches
        self._poller: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(
                self._poll(), context=contextvars.Context())

    def close(self) -> None:
        for task in [self._poller, *(link.task for link in self._links.values())]:
            if task is not None:
                task.cancel()

    @property
    def attached(self) -> list[str]:
        """Replicas with an attached link, in the registry's order."""
        return [r for r, link in self._links.items() if link.attached and link.listed]

    async def _poll(self) -> None:
        while True:
            try:
                self.refresh(await asyncio.to_thread(self._read_registry))
            except Exception as e:  # RedisError, a record that does not parse: links
                log.warning("cannot read decoder links: %s", e)  # already open stay in use
            await asyncio.sleep(self.poll_s)

    def _read_registry(self) -> list[LinkRecord]:
        instance = self._registry.instance()
        if self._instance and instance != self._instance:
            log.warning("Redis lost its data: waiting %.0f s for the links to re-register",
                        self.relist_s)
            self._relisting_until = time.monotonic() + self.relist_s
        self._instance = instance
        return self._registry.live_links()

    def refresh(self, records: list[LinkRecord]) -> None:
        """The registry's live links now: open the new ones, stop choosing the gone ones."""
        listed = {r.replica: r for r in records}
        now = time.monotonic()
        # a broken link's record is tried again after retry_s (a glitch, not a death: the
        # replica's heartbeat still renews it), and forgotten once Redis forgets it
        self._failed = {r: t for r, t in self._failed.items()
                        if listed.get(r.replica) == r and now - t < self.retry_s}
        relisting = now < self._relisting_until
        for replica, link in self._links.items():
            if not relisting or replica in listed:
                link.listed = listed.get(replica) == link.record
        for replica, record in listed.items():
            if replica not in self._links and record not in self._failed:
                self._links[replica] = _Link(self, record)
        self.attached_changed()  # a link listed again is a choice again

    def attached_changed(self) -> None:
        self._changed.set()

    def pick(self, request: DecodeRequest) -> str | None:
        """The replica whose link should take ``request``, or None when no link is up. A
        replay (``request.avoid``) goes to a replica that has not failed it, while one is
        attached."""
        candidates = self.attached
        others = [r for r in candidates if r not in request.avoid]
        if not candidates:
            return None
        return str(self._ledger.rank(others or candidates, request.affinity)[0])

    async def wait(self, request: DecodeRequest, timeout_s: float) -> str | None:
        """``pick``, waiting up to ``timeout_s`` for a link to attach if none is; a replay
        waits that long for a replica it has not failed on before taking one it has."""
        deadline = time.monotonic() + timeout_s
        while True:
            replica = self.pick(request)
            fresh = replica is not None and replica not in request.avoid
            remaining = deadline - time.monotonic()
            if fresh or remaining <= 0:
                return replica
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                pass

    def submit(self, request: DecodeRequest, replica: str) -> asyncio.Queue[Item]:
        """Send ``request`` over ``replica``'s link (from ``pick``); its chunks arrive in the
        queue returned, or ``LinkLost`` if the link breaks first. Raises ValueError if the
        request cannot be encoded (nothing is sent)."""
        frame = codec.encode_submit(request)
        link = self._links[replica]
        rid = request.request_id
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self.queues[rid] = queue
        self._link_of[rid] = link
        self._ledger.routed(rid, replica, request.cost_tokens, request.affinity)
        link.send(frame)
        return queue

    def deliver(self, chunks: list[DecodeChunk]) -> None:
        """A decoder's message into the queues of the requests still waiting for it."""
        for chunk in chunks:
            queue = self.queues.get(chunk.request_id)
            if queue is not None:
                queue.put_nowait(chunk)

    def release(self, request_id: str, abort: bool) -> None:
        """The request is over for the router; ``abort``: the decoder should end it too."""
        self.queues.pop(request_id, None)
        self._ledger.completed(request_id)
        link = self._link_of.pop(request_id, None)
        if link is not None and abort and link.attached:
            link.send(codec.encode_abort(request_id))

    def lost(self, link: _Link, error: str) -> None:
        replica = link.record.replica
        if self._links.get(replica) is link:
            del self._links[replica]
        self._ledger.forget(replica)
        self._failed[link.record] = time.monotonic()
        bound = [rid for rid, on in self._link_of.items() if on is link]
        log.warning("link to decoder %s lost (%d open requests): %s", replica, len(bound),
                    error)
        for rid in bound:
            queue = self.queues.get(rid)
            if queue is not None:
                queue.put_nowait(LinkLost(f"decoder {replica}: {error}"))
