"""Prometheus metrics of the router, vLLM-style names under the ``detserve:`` prefix.

Latencies, request and token counts are measured here, per sequence. Decode-verify-rollback
counters (rollbacks, recomputed tokens, verify passes, lane padding...) are the engines'
own: each decoder chunk carries its replica's latest ``LLMEngine.stats()``, and they are
exported per replica, so a scrape sums them across the cluster.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Mapping

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "detserve:"
# engine stats() key -> help text; exported as detserve:<key>_total{replica=...}
ENGINE_COUNTERS = {
    "rollbacks": "verify windows with at least one rejected candidate",
    "tokens_rolled_back": "fast-path candidates rejected by the lane",
    "recomputed_tokens": "tokens computed again (rolled back or preempted)",
    "verify_passes": "fixed-shape lane passes",
    "windows": "verify windows submitted",
    "lane_rows": "lane rows computed (including padding)",
    "lane_padding_rows": "padding rows in lane passes",
    "lane_prefill_rows": "prompt rows computed in the lane",
    "partial_windows": "partial windows (candidates of a sequence mid-window) verified "
                       "in a lane pass's spare rows",
    "lane_ahead_admissions": "deterministic prompts admitted ahead of the queue into a lane "
                             "pass's spare rows",
    "parked_admissions": "sequences admitted into the batch slots of lane-parked sequences",
    "committed_tokens": "tokens committed to finished requests",
    "fast_tokens": "tokens produced by the fast path",
    "fast_passes": "fast-path batches",
    "preemptions": "requests preempted for KV space",
    "perturbed_tokens": "fast-path tokens corrupted by fault injection",
    "steps": "engine steps",
}
# how a request's determinism was decided (``services.router.prepare``): the body's field,
# the request header, the model's deterministic name, or the server's default
DETERMINISM_SOURCES = ("field", "header", "alias", "default")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0, 120.0)


class EngineCounters(Collector):
    """Latest engine counters of every decoder replica seen."""

    def __init__(self) -> None:
        self._latest: dict[str, Mapping[str, float]] = {}

    def update(self, replica: str, stats: Mapping[str, float]) -> None:
        if stats:
            self._latest[replica] = stats

    def collect(self) -> Iterator[Metric]:
        for key, doc in ENGINE_COUNTERS.items():
            family = CounterMetricFamily(PREFIX + key, doc, labels=["replica"])
            for replica, stats in sorted(self._latest.items()):
                family.add_metric([replica], float(stats.get(key, 0.0)))
            yield family
        rows = sum(s.get("lane_rows", 0.0) for s in self._latest.values())
        pad = sum(s.get("lane_padding_rows", 0.0) for s in self._latest.values())
        yield GaugeMetricFamily(PREFIX + "lane_padding_fraction",
                                "padding rows / lane rows over all decoders",
                                value=pad / rows if rows else 0.0)


_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


async def watch_loop_lag(observe: Callable[[float], object], period_s: float = 0.01) -> None:
    """Pass ``observe`` forever how late (seconds) each ``period_s`` sleep of the running
    loop wakes up."""
    while True:
        t = time.monotonic()
        await asyncio.sleep(period_s)
        observe(max(0.0, time.monotonic() - t - period_s))


class RouterMetrics:
    def __init__(self) -> None:
        # a registry per router instance (no process-global metrics); the *_created series
        # would only add noise to counter sums
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()
        r, det = self.registry, ["deterministic"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "time to first token",
                              det, registry=r, buckets=_LATENCY_BUCKETS)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "time between committed chunks, per token", det, registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "end-to-end latency",
                             det, registry=r, buckets=_LATENCY_BUCKETS)
        self.running = Gauge(PREFIX + "num_requests_running",
                             "sequences producing tokens", registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting",
                             "admitted sequences without a token yet", registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prefill tokens", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "generated tokens",
                                         registry=r)
        self.success = Counter(PREFIX + "request_success", "finished sequences",
                               ["finished_reason"], registry=r)
        self.failures = Counter(PREFIX + "request_failures", "failed requests by error type",
                                ["type"], registry=r)
        # requests (not choices) by whether they are deterministic and what decided it; the
        # series that can occur start at 0 (the deterministic name cannot opt out)
        self.determinism = Counter(PREFIX + "determinism_requests",
                                   "requests by determinism and how it was asked for",
                                   ["deterministic", "source"], registry=r)
        for source in DETERMINISM_SOURCES:
            for on in ("true", "false") if source != "alias" else ("true",):
                self.determinism.labels(on, source)
        self.replays = Counter(PREFIX + "deterministic_replays",
                               "deterministic sequences replayed on another decoder", registry=r)
        # how sequences reached their decoder: "link" (the decoder's gRPC link,
        # services.decoder.link, the only path)
        self.dispatch = Counter(PREFIX + "router_dispatch", "sequences sent to a decoder",
                                ["path"], registry=r)
        self.links = Gauge(PREFIX + "router_decoder_links",
                           "decoder links this router has attached", registry=r)
        # how late a periodic wake-up of the router's event loop ran (``watch_loop_lag``): a
        # loop busy writing streams delays every request waiting for it
        self.loop_lag = Histogram(PREFIX + "router_event_loop_lag_seconds",
                                  "lateness of the router event loop's periodic 10 ms wake-up",
                                  registry=r, buckets=_LAG_BUCKETS)
        self.engines = EngineCounters()
        r.register(self.engines)

    def count_request(self, deterministic: bool, source: str) -> None:
        """One valid request, counted before admission; ``source``: one of
        DETERMINISM_SOURCES."""
        self.determinism.labels("true" if deterministic else "false", source).inc()

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


class SequenceTimer:
    """Latency and token accounting of one sequence; ``close`` exactly once."""

    def __init__(self, metrics: RouterMetrics, deterministic: bool, prompt_tokens: int) -> None:
        self._m = metrics
        self._label = "true" if deterministic else "false"
        self._prompt_tokens = prompt_tokens
        self._start = self._last = time.monotonic()
        self._started = False
        self._closed = False
        metrics.waiting.inc()

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if not self._started:
            self._started = True
            self._m.ttft.labels(self._label).observe(now - self._start)
            self._m.waiting.dec()
            self._m.running.inc()
        else:
            per_token = (now - self._last) / n
            for _ in range(n):
                self._m.itl.labels(self._label).observe(per_token)
        self._last = now
        self._m.generation_tokens.inc(n)

    def finish(self, reason: str) -> None:
        self._m.e2e.labels(self._label).observe(time.monotonic() - self._start)
        self._m.success.labels(reason).inc()
        self._m.prompt_tokens.inc(self._prompt_tokens)
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        (self._m.running if self._started else self._m.waiting).dec()
