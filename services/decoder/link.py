"""A decoder replica's link: routers submit requests and read chunks over one gRPC stream.

Through Ray Serve every request costs two handle calls' worth of hops (the router's call to
the replica, and the replica's answers back through a Serve stream): about 3.5 ms each way
on a GPU host (docs/benchmarks/gpu/README.md). A link is one long-lived bidirectional
stream per (router, decoder replica): the router writes ``submit`` and ``abort`` frames
(each message a list of them: whatever it had queued), the replica writes everything its
engine committed for that router's requests since the previous frame
(``services.decoder.channel``), so a request costs one frame each way.

Routers find links in the Redis registry (``services.registry.LinkRecord``, kept alive by a
heartbeat); Ray Serve still deploys, restarts and health-checks the replicas, and a router
without a live link falls back to handle calls. Frames are pickled: both ends are this
cluster's own processes (Ray pickles the same objects between them), and a link answers
only a caller that presents the token published with its record.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import secrets
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from services.decoder.channel import Channel, ChannelSink
from services.decoder.messages import DecodeRequest, coalesce_by_request

if TYPE_CHECKING:
    from services.decoder.engine_loop import EngineLoop

log = logging.getLogger(__name__)

SERVICE = "detserve.DecoderLink"
METHOD = f"/{SERVICE}/Open"
TOKEN_KEY = "x-detserve-link-token"
SUBMIT, ABORT = "submit", "abort"
# both ends: notice a peer that went away without closing (a host lost) within ~20 s
KEEPALIVE = (("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 10_000),
             ("grpc.keepalive_permit_without_calls", 1),
             ("grpc.http2.max_pings_without_data", 0),
             ("grpc.max_receive_message_length", 64 << 20))
# the link server: take those pings however often they come while no data flows (gRPC's
# default answers the third ping within 5 minutes without data with GOAWAY
# "too_many_pings", which closed idle routers' links after ~30 s)
SERVER_OPTIONS = (*KEEPALIVE, ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
                  ("grpc.http2.max_ping_strikes", 0))


def dumps(frame: Any) -> bytes:
    return pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)  # noqa: S301 (a frame from a peer holding the link's token)


class LinkServer:
    """The link server of one replica, on the event loop that starts it."""

    def __init__(self, loop: EngineLoop) -> None:
        self.engine_loop = loop
        self.token = secrets.token_hex(16)
        self.address = ""
        self.submitted = 0        # requests received over links
        self.messages = 0         # messages received over links (each a list of frames)
        self._server: grpc.aio.Server | None = None

    async def start(self, host: str, bind: str = "0.0.0.0") -> LinkServer:
        """Listen on a free port of ``bind``; ``address`` is ``host:port``."""
        server = grpc.aio.server(options=SERVER_OPTIONS)
        handler = grpc.stream_stream_rpc_method_handler(self._open)  # raw bytes both ways
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Open": handler}),))
        port = server.add_insecure_port(f"{bind}:0")
        await server.start()
        self._server, self.address = server, f"{host}:{port}"
        return self

    async def stop(self, grace_s: float | None = None) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)

    async def _open(self, frames: AsyncIterator[bytes], context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[bytes]:
        metadata = dict(context.invocation_metadata() or ())
        if not secrets.compare_digest(str(metadata.get(TOKEN_KEY, "")), self.token):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "bad or missing link token")
        channel = Channel()
        reader = asyncio.create_task(self._read(frames, channel))
        reader.add_done_callback(lambda _: channel.ready.set())
        try:
            yield dumps([])  # attached
            while not reader.done():
                await channel.ready.wait()
                batch = channel.take()
                if batch:
                    yield dumps([c.to_wire() for c in coalesce_by_request(batch)])
        finally:
            reader.cancel()
            for rid in list(channel.done):  # the router went away: so do its requests
                self.engine_loop.abort(rid)

    async def _read(self, frames: AsyncIterator[bytes], channel: Channel) -> None:
        sink = ChannelSink(asyncio.get_running_loop(), channel)
        async for data in frames:
            message = loads(data)  # the frames a router had queued: [(kind, payload), ...]
            self.messages += 1
            if not isinstance(message, list):
                log.warning("link: a message that is not a list of frames: %r", type(message))
                continue
            for frame in message:
                kind, payload = frame if isinstance(frame, tuple) and len(frame) == 2 \
                    else (frame, None)
                if kind == SUBMIT and isinstance(payload, DecodeRequest):
                    channel.done[payload.request_id] = asyncio.Event()
                    self.submitted += 1
                    self.engine_loop.submit(payload, sink)
                elif kind == ABORT and channel.done.pop(str(payload), None) is not None:
                    self.engine_loop.abort(str(payload))
                elif kind not in (SUBMIT, ABORT):
                    log.warning("link: unknown frame %r", kind)
