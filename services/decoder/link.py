"""A decoder replica's link: routers submit requests and read chunks over one gRPC stream.

The only way requests reach a decoder. A link is one long-lived bidirectional stream per
(router, decoder replica): the router writes ``submit`` and ``abort`` frames (each message
all it had queued), the replica writes everything its engine committed for that router's
requests since its previous message (``services.decoder.channel``), so a request costs
one frame each way and no Ray hop (a Ray Serve handle call costs two each way).

Routers find links in the Redis registry (``services.registry.LinkRecord``, kept alive by a
heartbeat); Ray Serve still deploys, restarts and health-checks the replicas. Messages are
protobuf (``proto/link.proto``, converted in ``services.decoder.link_codec``), and a link
answers only callers that present the cluster secret (``services.cluster_auth``): bytes
that are not a link message end that stream with INVALID_ARGUMENT, the server and every
other stream go on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from services.cluster_auth import ClusterAuth
from services.decoder import link_codec as codec
from services.decoder.channel import Channel, ChannelSink
from services.decoder.messages import DecodeChunk, DecodeRequest, coalesce_by_request

if TYPE_CHECKING:
    from services.decoder.engine_loop import EngineLoop

log = logging.getLogger(__name__)

SERVICE = "detserve.link.DecoderLink"
METHOD = f"/{SERVICE}/Open"
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


class LinkServer:
    """The link server of one replica, on the event loop that starts it."""

    def __init__(self, loop: EngineLoop, auth: ClusterAuth) -> None:
        self.engine_loop = loop
        self.auth = auth
        self.address = ""
        self.submitted = 0        # requests received over links
        self.messages = 0         # messages received over links (each a list of frames)
        self._server: grpc.aio.Server | None = None

    async def start(self, host: str, bind: str = "0.0.0.0") -> LinkServer:
        """Listen on a free port of ``bind``; ``address`` is ``host:port``."""
        gate = self.auth.gate()
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[gate.aio_interceptor()])
        handler = grpc.stream_stream_rpc_method_handler(self._open)  # bytes: link_codec
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Open": handler}),))
        port = self.auth.add_port(server, f"{bind}:0")
        self._server, self.address = server, f"{host}:{port}"
        gate.allow(self.address)  # the address routers find in the registry and dial
        await server.start()
        return self

    async def stop(self, grace_s: float | None = None) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)

    async def _open(self, messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[bytes]:
        channel = Channel()
        bad_frame: list[str] = []
        reader = asyncio.create_task(self._read(messages, channel, bad_frame))
        reader.add_done_callback(lambda _: channel.ready.set())
        try:
            yield codec.encode_chunks([])  # attached
            while not reader.done():
                await channel.ready.wait()
                batch = channel.take()
                if batch:
                    yield codec.encode_chunks(coalesce_by_request(batch))
            if bad_frame:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad_frame[0])
        finally:
            reader.cancel()
            for rid in list(channel.open):  # the router went away: so do its requests
                self.engine_loop.abort(rid)

    async def _read(self, messages: AsyncIterator[bytes], channel: Channel,
                    bad_frame: list[str]) -> None:
        sink = ChannelSink(asyncio.get_running_loop(), channel)
        async for data in messages:
            try:
                frames = codec.decode_frames(data)
            except codec.FrameError as e:
                log.warning("link: refused a malformed message: %s", e)
                bad_frame.append(f"malformed link message: {e}")
                return
            self.messages += 1
            for frame in frames:
                if isinstance(frame, DecodeRequest):
                    channel.open.add(frame.request_id)
                    self.submitted += 1
                    self.engine_loop.submit(frame, sink)
                elif isinstance(frame, codec.Refused):
                    sink(DecodeChunk(frame.request_id, self.engine_loop.replica, finished=True,
                                     error=frame.error, error_type="invalid_request"))
                elif frame.request_id in channel.open:
                    channel.open.discard(frame.request_id)
                    self.engine_loop.abort(frame.request_id)
