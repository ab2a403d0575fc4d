"""Is any decoder ready? A background probe through the decoder handle.

Each probe is one ``stats()`` call routed to some replica; its answer also refreshes the
engine counters of /metrics while no request is running. Requests ask ``ensure_ready``
so that a router that has not probed yet (just started) does not refuse them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from services.decoder.messages import ReplicaStats
from services.router.metrics import RouterMetrics, watch_loop_lag

log = logging.getLogger(__name__)


class DecoderHealth:
    def __init__(self, decoder: Any, metrics: RouterMetrics, *, period_s: float = 2.0,
                 timeout_s: float = 5.0) -> None:
        self._decoder = decoder
        self._metrics = metrics
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

    async def probe(self) -> bool:
        try:
            stats: ReplicaStats = await asyncio.wait_for(
                self._decoder.stats.remote(), self.timeout_s)  # type: ignore[arg-type]
        except Exception as e:  # timeout, replica died, no replica
            self.last_error = f"{type(e).__name__}: {e}"
            return False
        self._metrics.engines.update(stats.replica, stats.engine)
        if not stats.healthy:
            self.last_error = f"decoder {stats.replica} is unhealthy"
            self._seen.pop(stats.replica, None)
            return False
        now = time.monotonic()
        self._seen[stats.replica] = self._last_ok = now
        return True

    async def _run(self) -> None:
        while True:
            ok = await self.probe()
            if not ok:
                log.warning("no decoder ready: %s", self.last_error)
            await asyncio.sleep(self.period_s)
