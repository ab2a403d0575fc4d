"""The router's request path, shared by the HTTP and gRPC front ends.

``open`` checks readiness and admission for a prepared ``Job`` and starts its events;
errors before the first event (bad request found by the engine, no decoder, overload)
raise ``APIError`` so the front end can answer with a status code instead of a broken
stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from services.router.admission import Admission, Slot
from services.router.dispatch import ChoiceEvent, DecoderFailure, Dispatcher, VerificationLost
from services.router.errors import APIError, unavailable
from services.router.health import DecoderHealth
from services.router.limits import ServingLimits
from services.router.links import LinkHub
from services.router.metrics import RouterMetrics
from services.router.model_context import ModelContext
from services.router.prepare import Job


def decoder_failed(e: DecoderFailure) -> APIError:
    if isinstance(e, VerificationLost):  # as /health says meanwhile (``health``)
        return APIError(503, str(e), type="service_unavailable", code="no_verifier")
    return APIError(502, str(e), type="server_error", code="decoder_failed")


class OpenStream:
    """A job's events with its first one already received; ``close`` frees its slot."""

    def __init__(self, first: ChoiceEvent, rest: AsyncIterator[ChoiceEvent], slot: Slot) -> None:
        self._first: ChoiceEvent | None = first
        self._rest = rest
        self._slot = slot

    def __aiter__(self) -> AsyncIterator[ChoiceEvent]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[ChoiceEvent]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        async for event in self._rest:
            yield event

    async def close(self) -> None:
        self._slot.release()
        await self._rest.aclose()  # type: ignore[attr-defined]


class RouterService:
    def __init__(self, ctx: ModelContext, limits: ServingLimits, decoder: Any,
                 links: LinkHub) -> None:
        """``decoder``: a Ray Serve handle to the decoders, for health probes only;
        ``links``: the decoders' links, which carry every request."""
        self.ctx = ctx
        self.limits = limits
        self.metrics = RouterMetrics()
        self.metrics.links.set_function(lambda: len(links.attached))
        self.admission = Admission(limits.max_outstanding, limits.retry_after_s)
        self.dispatcher = Dispatcher(links, self.metrics)
        self.health = DecoderHealth(decoder, self.metrics, links)

    async def open(self, job: Job) -> OpenStream:
        """Raises APIError: 503 no decoder ready (or, for a deterministic job, no verifier),
        429 overloaded, 4xx/502 from the decoder."""
        self.metrics.count_request(job.is_deterministic, job.determinism_source)
        if not await self.health.ensure_ready():
            self.metrics.failures.labels("unavailable").inc()
            raise unavailable(f"no decoder is ready ({self.health.last_error})")
        refusal = self.health.verification_refusal() if job.is_deterministic else None
        if refusal is not None:  # refused here, not by stopping a decoder's engine
            self.metrics.failures.labels("unavailable").inc()
            raise refusal
        try:
            slot = self.admission.acquire(len(job.choices))
        except APIError:
            self.metrics.failures.labels("overloaded").inc()
            raise
        events = self.dispatcher.run(job)
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            slot.release()
            raise decoder_failed(DecoderFailure("no output")) from None
        except BaseException as e:
            slot.release()
            await events.aclose()  # type: ignore[attr-defined]
            if isinstance(e, DecoderFailure):
                self.metrics.failures.labels("decoder_failed").inc()
                raise decoder_failed(e) from e
            if isinstance(e, APIError) and e.status == 503:  # no decoder link in time
                self.metrics.failures.labels("unavailable").inc()
            raise
        return OpenStream(first, events, slot)
