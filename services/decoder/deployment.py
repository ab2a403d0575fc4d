"""The ``Decoder`` Ray Serve deployment: one engine (model, KV pool, fast path) per replica.

Requests arrive over the replica's link (``services.decoder.link``): one gRPC stream per
router, requests in, chunks out, published in Redis. Ray Serve deploys, restarts and
health-checks the replicas; its handle calls carry only control (``stats``, ``profile``,
``request_timings``), never a request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from ray import serve

from services.cluster_auth import ClusterAuth
from services.decoder.channel import deliver_on_event_loops
from services.decoder.engine_factory import DecoderSettings, build_engine
from services.decoder.engine_loop import EngineLoop, RequestTiming
from services.decoder.link import LinkServer
from services.decoder.messages import ReplicaPin, ReplicaStats
from services.registry import Heartbeat, LinkRecord, Registry
from services.serve_config import DECODER

log = logging.getLogger(__name__)


def _replica_id() -> str:
    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a Serve replica (tests constructing the class directly)
        return f"local-{os.getpid()}"


@serve.deployment(name=DECODER, health_check_period_s=5, health_check_timeout_s=30,
                  graceful_shutdown_timeout_s=5,
                  logging_config={"enable_access_log": False})  # the router logs requests
class Decoder:
    async def __init__(self, args: Mapping[str, Any]) -> None:  # type: ignore[misc]
        self.settings = DecoderSettings.from_args(args)
        if self.settings.serve.switch_interval:  # this process is the replica's alone
            sys.setswitchinterval(self.settings.serve.switch_interval)
        self.replica = _replica_id()
        auth = ClusterAuth.from_env()  # before the engine: refuse to start without it
        engine, self._close = build_engine(self.settings, self.replica, auth)
        self._event_loop = asyncio.get_running_loop()
        self.loop = EngineLoop(engine, self.replica, deliver=deliver_on_event_loops,
                               stream_interval=self.settings.serve.stream_interval,
                               on_failure=self._engine_failed)
        self.loop.start()
        self.link: LinkServer | None = None
        self._link_beat: Heartbeat | None = None
        await self._start_link(auth)
        cfg = self.settings.engine
        log.info("decoder %s ready (%s, mode %s, link at %s)", self.replica, cfg.model,
                 cfg.mode, self.link and self.link.address)

    async def _start_link(self, auth: ClusterAuth) -> None:
        """Serve a link (``services.decoder.link``) and publish it in Redis: routers reach
        this replica only there, so a replica that cannot publish fails to start (Ray
        Serve tries again)."""
        import ray

        link = await LinkServer(self.loop, auth).start(ray.util.get_node_ip_address())
        try:
            record = LinkRecord(self.replica, link.address)
            self._link_beat = Heartbeat(Registry(self.settings.serve.redis_url), record).start()
        except BaseException:
            await link.stop()
            raise
        self.link = link

    def _engine_failed(self) -> None:
        """On the engine thread, once its step failed: withdraw the link (below)."""
        asyncio.run_coroutine_threadsafe(self.withdraw_link(), self._event_loop)

    async def withdraw_link(self) -> None:
        """Take the link out of the registry and close it: a replica whose engine failed
        answers every request at once with an error, so with the fewest outstanding tokens
        it would draw the routers' traffic until Ray Serve's health check replaces it.
        Routers whose link breaks route elsewhere."""
        beat, self._link_beat = self._link_beat, None
        if beat is not None:
            await asyncio.to_thread(beat.stop, True)
        link, self.link = self.link, None
        if link is not None:
            await link.stop(0)
            log.warning("decoder %s: engine failed, link withdrawn", self.replica)

    def ping(self) -> str:
        return self.replica

    def profile(self) -> Mapping[str, object]:
        return self.loop.determinism

    def stats(self, pin: ReplicaPin | None = None) -> ReplicaStats:
        """``pin``: only routes the call (to this replica)."""
        return ReplicaStats(self.replica, dict(self.loop.stats), self.loop.outstanding_tokens,
                            self.loop.num_streams, self.loop.healthy,
                            type(self.loop.engine.verifier).__name__,
                            self.link.submitted if self.link else 0,
                            bool(getattr(self.loop.engine.verifier, "ready", True)))

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
