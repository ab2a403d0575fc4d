"""Step an ``LLMEngine`` on a background thread and fan its outputs out to streams.

The engine is not thread-safe, so this thread is its only user: requests and aborts
arrive through an inbox, outputs leave through each request's ``sink``. All the chunks of
one step go out in one call of ``deliver`` (on this thread): by default it calls each
sink; the deployment hands the whole batch to its event loop in one wake-up instead of
one per request. With ``stream_interval`` N > 1 a stream's chunk waits until it carries
N new tokens (the first one and the last one go out at once), as vLLM's ``stream_interval``:
fewer messages per step when many streams are open. A step whose verification cannot
continue (``LaneUnavailable``: the verifier is lost and no other one can be had) ends the
deterministic streams with an error chunk ("verification unavailable: ...") and serves the
others on. Any other failing step is fatal: every open stream gets an error chunk and
``healthy`` turns False, so Ray Serve's health check restarts the replica.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from detserve.engine import LLMEngine
from detserve.outputs import Delta, RequestOutput
from detserve.verifier import LaneUnavailable
from services.decoder.channel import Deliver, Sink, deliver_each
from services.decoder.messages import DecodeChunk, DecodeRequest

log = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.5


@dataclass(frozen=True)
class _Add:
    request: DecodeRequest
    sink: Sink
    received: float = field(default_factory=time.monotonic)  # when submit() was called


@dataclass(frozen=True)
class RequestTiming:
    """Where a finished request's time to first token went, on the machine-wide monotonic
    clock (comparable across the processes of one machine): ``accepted`` when the router's
    HTTP handler got it and ``dispatched`` when the router sent it on (0: unknown),
    ``received`` when the decoder replica handed it to the loop,
    ``arrival`` when the engine took it (the next step boundary), ``first_token`` when its
    first token was committed."""

    request_id: str
    accepted: float
    dispatched: float
    received: float
    arrival: float
    first_token: float | None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass
class _Stream:
    request: DecodeRequest
    sink: Sink
    received: float
    sent_tokens: int = 0                             # tokens in the chunks sent so far
    held: Delta = field(default_factory=Delta)       # outputs' deltas not yet sent


class EngineLoop:
    def __init__(self, engine: LLMEngine, replica: str, deliver: Deliver = deliver_each,
                 stream_interval: int = 1, on_failure: Callable[[], object] | None = None
                 ) -> None:
        """``on_failure``: called on the engine thread once a failed step has failed every
        open stream (the deployment withdraws the replica's link with it)."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.engine = engine
        self.stream_interval = stream_interval
        self._deliver_batch = deliver
        self._pending: list[tuple[Sink, DecodeChunk]] = []  # this iteration's chunks
        self.replica = replica
        self.determinism = engine.determinism_profile()
        self._inbox: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stats: Mapping[str, float] = engine.stats()
        self._deliver_s = 0.0
        self._outstanding_tokens = 0
        # the latest finished requests' timings (``timings``), for benchmarks and debugging
        self._timings: deque[RequestTiming] = deque(maxlen=4096)
        self.healthy = True
        self._on_failure = on_failure
        self._thread = threading.Thread(target=self._run, name=f"engine-{replica}", daemon=True)

    # ---- any thread ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: DecodeRequest, sink: Sink) -> None:
        if self._stop.is_set() or not self.healthy:
            self._deliver_batch([(sink, DecodeChunk(
                request.request_id, self.replica, finished=True,
                error=f"decoder {self.replica} is not running", error_type="server_error"))])
            return
        self._inbox.put(_Add(request, sink))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def stats(self) -> Mapping[str, float]:
        """Engine counters after the latest step (a fresh dict each step: safe to read)."""
        return self._stats

    @property
    def outstanding_tokens(self) -> int:
        return self._outstanding_tokens

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def timings(self, since: float = 0.0) -> list[RequestTiming]:
        """Timings of the requests finished lately (at most 4,096) received at or after
        ``since`` (monotonic seconds)."""
        return [t for t in list(self._timings) if t.received >= since]

    # ---- engine thread --------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._flush()
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                lane_error = None
                try:
                    outputs = self.engine.step()
                except LaneUnavailable as e:
                    lane_error = f"verification unavailable: {e}"
                    log.warning("%s: %s", self.replica, lane_error)
                    outputs = self.engine.fail_lane(str(e))
                t = time.perf_counter()
                stats = self.engine.stats()  # a fresh dict each step
                stats["loop_deliver_seconds"] = self._deliver_s
                self._stats = stats
                for out in outputs:
                    self._deliver(out, lane_error)
                self._flush()
                self._forget([out.request_id for out in outputs if out.finished])
                # the engine thread's own work between steps (chunks, text, hand-off): the
                # GPU waits for it once it outlasts the step queued ahead
                self._deliver_s += time.perf_counter() - t
        except Exception as e:  # the engine's state is unknown now: fail everything
            log.exception("engine step failed on %s", self.replica)
            self.healthy = False
            self._fail_all(f"decoder {self.replica} failed: {type(e).__name__}: {e}")
            if self._on_failure is not None:
                try:
                    self._on_failure()
                except Exception:
                    log.exception("on_failure of %s failed", self.replica)
            return
        self._fail_all(f"decoder {self.replica} is shutting down")

    def _send(self, sink: Sink, chunk: DecodeChunk) -> None:
        self._pending.append((sink, chunk))

    def _flush(self) -> None:
        if self._pending:
            batch, self._pending = self._pending, []
            self._deliver_batch(batch)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._add(command.request, command.sink, command.received)
            else:
                self._abort(command.request_id)

    def _add(self, request: DecodeRequest, sink: Sink, received: float) -> None:
        rid = request.request_id
        try:
            self.engine.add_request(rid, None, request.params,
                                    prompt_token_ids=list(request.prompt_token_ids))
        except ValueError as e:
            self._send(sink, DecodeChunk(rid, self.replica, finished=True, error=str(e),
                                         error_type="invalid_request"))
            return
        self._streams[rid] = _Stream(request, sink, received)
        self._outstanding_tokens += request.cost_tokens

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._outstanding_tokens -= stream.request.cost_tokens
            self.engine.abort_request(request_id)

    def _deliver(self, out: RequestOutput, lane_error: str | None = None) -> None:
        """Send ``out``'s chunk; one that ended with ``"error"`` (``LLMEngine.fail_lane``)
        carries ``lane_error``."""
        stream = self._streams.get(out.request_id)
        if stream is None:  # aborted by its client
            return
        # the engine's deltas are forwarded; one held back joins the next chunk
        delta = stream.held.then(out.delta)
        sent = stream.sent_tokens
        if not out.finished and sent and len(out.token_ids) - sent < self.stream_interval:
            stream.held = delta
            return  # held: the next chunk carries these tokens too
        first = sent == 0  # (every output carries tokens or is the last)
        stream.held, stream.sent_tokens = Delta(), len(out.token_ids)
        determinism = self.determinism if out.finished and out.is_deterministic else None
        chunk = DecodeChunk(
            out.request_id, self.replica, text=delta.text, token_ids=delta.token_ids,
            logprobs=delta.logprobs,
            finished=out.finished, finish_reason=out.finish_reason,
            num_prompt_tokens=len(out.prompt_token_ids), num_output_tokens=len(out.token_ids),
            determinism=determinism,
            # counters ride on final chunks only (the router's health probe refreshes them
            # too): pickling them into every chunk costs decoder CPU on small machines
            engine_stats=self._stats if out.finished else {},
            prompt_logprobs=(tuple(out.prompt_logprobs)
                             if first and out.prompt_logprobs is not None else None))
        if out.finished:
            self._streams.pop(out.request_id)
            request = stream.request
            self._timings.append(RequestTiming(out.request_id, request.accepted,
                                               request.dispatched, stream.received,
                                               out.stats.arrival_time, out.stats.first_token_time))
            self._outstanding_tokens -= stream.request.cost_tokens
            if out.finish_reason == "abort":
                chunk = DecodeChunk(out.request_id, self.replica, finished=True,
                                    finish_reason="abort", error="request aborted by the engine",
                                    error_type="server_error", engine_stats=self._stats)
            elif out.finish_reason == "error":
                # its tokens so far went out before; the unverified ones never exist here
                chunk = DecodeChunk(out.request_id, self.replica, finished=True,
                                    finish_reason="error",
                                    error=lane_error or "verification unavailable",
                                    error_type="verifier_unavailable",
                                    engine_stats=self._stats)
        self._send(stream.sink, chunk)

    def _forget(self, request_ids: list[str]) -> None:
        """A remote verifier keeps finished requests' block tables until told."""
        drop = getattr(self.engine.verifier, "drop_requests", None)
        if drop is None or not request_ids:
            return
        try:
            drop(request_ids)
        except Exception:  # bookkeeping only: never fail requests over it
            log.warning("could not drop block tables of %d requests", len(request_ids),
                        exc_info=True)

    def _fail_all(self, message: str) -> None:
        for rid, stream in list(self._streams.items()):
            self._send(stream.sink, DecodeChunk(rid, self.replica, finished=True, error=message,
                                                error_type="server_error"))
        self._streams.clear()
        self._flush()
        self._outstanding_tokens = 0
