"""The verifier interface: lane passes in, decisions out.

The engine never runs lane passes itself; it submits them to a ``Verifier`` and applies
the results it polls. ``InProcessVerifier`` runs them on the engine's own runner (sharing
its KV pool); the serving layer provides one that talks to a verifier actor over gRPC.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from detserve.distributed import TensorParallelError
from detserve.executor.runner import LaneLaunch, ModelRunner
from detserve.lane import LanePass, LaneResult


class LaneUnavailable(RuntimeError):
    """Raised by a verifier's ``submit`` or ``poll``: verification cannot continue (no
    verifier can be had), and every pass in flight is dropped. The engine's deterministic
    requests must be failed (``LLMEngine.fail_lane``); later passes may be submitted
    again (they fail the same way until a verifier is back)."""


class Verifier(Protocol):
    @property
    def stream_ordered(self) -> bool:
        """A pass submitted now runs after everything already queued on the engine's
        device stream (in-process verifiers); else the engine reads its batch in flight
        first."""

    @property
    def shares_device(self) -> bool:
        """Passes run on the engine's device, competing with its fast path (the engine
        then gives a step to a pass most sequences wait on); False: on a device of their
        own."""

    def submit(self, lane_pass: LanePass) -> None:
        """Queue a pass. Must not block on other passes' results."""

    def poll(self, wait: bool = False) -> list[LaneResult]:
        """Results that are ready; with ``wait``, block until at least one is (if any is
        in flight)."""

    def in_flight(self) -> int:
        """Passes being verified now (the engine yields decode steps to them)."""

    def close(self) -> None: ...


class InProcessVerifier:
    """Lane passes on the engine's own runner, thread and stream (CPU, and CUDA at TP>1,
    where every rank must queue both groups' collectives from one thread). ``submit``
    queues a pass behind the fast path's kernels without waiting for it; ``poll`` decides
    the passes whose results are back, in submission order. On CPU a pass has run when
    ``submit`` returns, so the same step's poll decides it (runs reproducible step by
    step); on CUDA the host plans and queues the next steps while the pass runs."""

    stream_ordered = True
    shares_device = True

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._queued: deque[LaneLaunch] = deque()

    def submit(self, lane_pass: LanePass) -> None:
        self._queued.append(self.runner.launch_lane(lane_pass))

    def poll(self, wait: bool = False) -> list[LaneResult]:
        out: list[LaneResult] = []
        while self._queued and (self._queued[0].ready() or (wait and not out)):
            out.append(self._queued.popleft().finish())
        return out

    def in_flight(self) -> int:
        return len(self._queued)

    def close(self) -> None:
        self._queued.clear()


class ThreadedVerifier:
    """Runs lane passes on a worker thread, on a CUDA stream of their own, so verification
    does not stall fast-path decoding (LLM-42's prototype paused every request instead).

    On CUDA with ``lane_sms`` set, the worker runs inside a green context restricted to that
    many SMs (``torch.cuda.green_contexts``), leaving the rest to the fast path. Stream order:
    a pass waits for everything the engine queued before it (the fast path's K/V of its
    window), and results are only handed out once the pass's kernels have completed.
    """

    stream_ordered = True
    shares_device = True

    def __init__(self, runner: ModelRunner, lane_sms: int | None = None) -> None:
        import queue
        import threading

        import torch

        self.runner = runner
        self._torch = torch
        self._todo: queue.Queue[tuple[LanePass, object] | None] = queue.Queue()
        self._done: queue.Queue[LaneResult | BaseException] = queue.Queue()
        self._pending = 0
        self.green_context_sms: int | None = None
        self._green_ctx: Any = None  # kept alive with the thread
        self._ready = threading.Event()
        self._lane_sms = lane_sms
        self._thread = threading.Thread(target=self._work, name="lane-verifier", daemon=True)
        self._thread.start()
        self._ready.wait()

    def _work(self) -> None:
        torch = self._torch
        stream = None
        if self.runner.cuda:
            stream, self._green_ctx, self.green_context_sms = lane_stream(self.runner.device,
                                                                          self._lane_sms)
        self._ready.set()
        while (job := self._todo.get()) is not None:
            lane_pass, event = job
            try:
                if stream is not None:
                    stream.wait_event(event)  # type: ignore[arg-type]
                    with torch.cuda.stream(stream):
                        result = self.runner.run_lane(lane_pass)
                    stream.synchronize()
                else:
                    result = self.runner.run_lane(lane_pass)
                self._done.put(result)
            except BaseException as e:  # surfaced to the engine by poll()
                self._done.put(e)

    def submit(self, lane_pass: LanePass) -> None:
        event = None
        if self.runner.cuda:
            event = self._torch.cuda.Event()
            event.record()  # the fast path's writes queued so far
        self._pending += 1
        self._todo.put((lane_pass, event))

    def poll(self, wait: bool = False) -> list[LaneResult]:
        import queue

        out: list[LaneResult] = []
        block = wait and self._pending > 0
        while self._pending:
            try:
                item = self._done.get(block=block)
            except queue.Empty:
                break
            block = False
            self._pending -= 1
            if isinstance(item, BaseException):
                if isinstance(item, TensorParallelError):  # a lost rank: the engine is done
                    raise item
                raise RuntimeError("lane pass failed") from item
            out.append(item)
        return out

    def in_flight(self) -> int:
        return self._pending

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=30)


def lane_stream(device: Any, lane_sms: int | None) -> tuple[Any, Any, int | None]:
    """For the calling thread (made current on ``device``): the CUDA stream lane passes run
    on, the green context behind it (keep it alive as long as the stream), and its SM
    count. With ``lane_sms``, a stream whose kernels run on that many SMs only, where the
    driver and torch have green contexts; else a high-priority stream on every SM: when
    the lane and the fast path both have kernels waiting, the lane's go first, so windows
    and prompt chunks come back quickly and sequences do not sit out decode steps waiting
    for them."""
    import torch

    torch.cuda.set_device(device)
    if lane_sms:
        try:
            from torch.cuda.green_contexts import GreenContext

            ctx: Any = GreenContext.create(num_sms=lane_sms, device_id=device.index or 0)
            if hasattr(ctx, "Stream"):
                return ctx.Stream(), ctx, lane_sms
            ctx.set_context()  # older torch: the context current for this thread
            return torch.cuda.Stream(device=device), ctx, lane_sms
        except Exception:  # driver/torch without green contexts: share all SMs
            pass
    return torch.cuda.Stream(device=device, priority=-1), None, None
