"""Would a request succeed now? What ``/health`` and the gRPC Health service answer.

A background probe through the decoder handle says whether a decoder is ready: each probe
is one ``stats()`` call routed to some replica (Ray, not Redis); its answer also refreshes
the engine counters of /metrics while no request is running. Requests ask
``ensure_ready`` so that a router that has not probed yet (just started) does not refuse
them. ``status`` adds what this router alone knows and a request needs: a decoder link
attached (``LinkHub``), and, on each decoder seen lately, a verifier stream open or one
it could fail over to (remote verification: deterministic requests fail without one; they
are refused with the same 503, ``verification_refusal``).

Redis is not asked: a router serves over the links it holds while Redis is away, so the
answer stays ready then, and turns unavailable only once requests would fail.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from services.decoder.messages import ReplicaStats
from services.router.errors import APIError, unavailable
from services.router.links import LinkHub
from services.router.metrics import RouterMetrics, watch_loop_lag

log = logging.getLogger(__name__)


class DecoderHealth:
    def __init__(self, decoder: Any, metrics: RouterMetrics, links: LinkHub | None = None, *,
                 period_s: float = 2.0, timeout_s: float = 5.0) -> None:
        self._decoder = decoder
        self._metrics = metrics
        self._links = links
        self._verifying: dict[str, tuple[float, bool]] = {}  # replica -> (when, has a verifier)
        self.period_s = period_s
        self.timeout_s = timeout_s
        self._seen: dict[str, float] = {}   # healthy replica -> last answer (monotonic)
        self._last_ok = float("-inf")
        self.last_error = "not probed yet"
        self._task: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        return time.monotonic() - self._last_ok < 3 * self.period_s

    @property
    def decoders_ready(self) -> int:
        """Replicas that answered recently (probes hit random replicas: a lower bound)."""
        horizon = time.monotonic() - 5 * self.period_s
        return sum(t >= horizon for t in self._seen.values()) if self.ready else 0

    def start(self) -> None:
        """Start probing, and watching the router's event loop (``watch_loop_lag``)."""
        if self._task is None:
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._run())
            self._lag_task = loop.create_task(watch_loop_lag(self._metrics.loop_lag.observe))

    def stop(self) -> None:
        for task in (self._task, self._lag_task):
            if task is not None:
                task.cancel()

    async def ensure_ready(self) -> bool:
        return self.ready or await self.probe()

    async def status(self) -> APIError | None:
        """None when a request would be served now, else the 503 it would meet (why)."""
        if not await self.ensure_ready():
            return unavailable(f"no decoder is ready ({self.last_error})")
        if self._links is not None and not self._links.attached:
            return unavailable("no decoder link is attached: requests would wait for one")
        return self.verification_refusal()

    def verification_refusal(self) -> APIError | None:
        """The 503 a deterministic request meets while a decoder seen lately can neither
        use nor find a verifier (it would stop its engine rather than release an
        unverified token), else None."""
        horizon = time.monotonic() - 5 * self.period_s
        lacking = sorted(r for r, (t, ok) in self._verifying.items() if t >= horizon and not ok)
        if lacking:
            return APIError(503, f"decoder {lacking[0]} has no verifier to turn to: "
                            "deterministic requests cannot be verified now",
                            type="service_unavailable", code="no_verifier")
        return None

    async def probe(self) -> bool:
        try:
            stats: ReplicaStats = await asyncio.wait_for(
                self._decoder.stats.remote(), self.timeout_s)  # type: ignore[arg-type]
        except Exception as e:  # timeout, replica died, no replica
            self.last_error = f"{type(e).__name__}: {e}"
            return False
        self._metrics.engines.update(stats.replica, stats.engine)
        now = time.monotonic()
        self._verifying[stats.replica] = (now, stats.verifier_ready)
        if not stats.healthy:
            self.last_error = f"decoder {stats.replica} is unhealthy"
            self._seen.pop(stats.replica, None)
            return False
        self._seen[stats.replica] = self._last_ok = now
        return True

    async def _run(self) -> None:
        while True:
            ok = await self.probe()
            if not ok:
                log.warning("no decoder ready: %s", self.last_error)
            await asyncio.sleep(self.period_s)
