"""What every target shares: the per-request result record and the replay contract.

A target replays a list of trace requests, honouring each request's ``arrival_s`` and a
concurrency cap, and returns one ``RequestResult`` per request (in the order given).
Timings are client-side wall clock (``time.perf_counter``) in seconds. A "chunk" is one
streamed delta: the server may commit several tokens at once (a verified window), so ITL is
measured between chunks, as vLLM's benchmark does, and ``chunk_tokens`` says how many
tokens each chunk carried when the target can tell.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from loadgen.tokenizer import Tokenizer
from loadgen.trace import TraceRequest

OnDone = Callable[["RequestResult"], None]


@dataclass
class RequestResult:
    request_id: str
    is_deterministic: bool
    prompt_len: int
    success: bool = False
    error: str = ""
    output_len: int = 0
    start_s: float = 0.0             # when it was sent, from the start of the run
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    text: str = ""
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    determinism: dict[str, Any] | None = None   # the server's determinism object, if any

    @property
    def tpot_s(self) -> float | None:
        """(E2EL - TTFT) / (output_len - 1), vLLM's time per output token; None if < 2."""
        if not self.success or self.output_len < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_len - 1)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestResult:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


class ResultRecorder:
    """Builds a RequestResult from stream events; all times from ``time.perf_counter``."""

    def __init__(self, req: TraceRequest, run_start: float) -> None:
        self.result = RequestResult(req.id, req.is_deterministic, req.prompt_len)
        self._sent = time.perf_counter()
        self.result.start_s = self._sent - run_start
        self._last: float | None = None
        self._texts: list[str] = []
        self._counted = 0

    @property
    def text_so_far(self) -> str:
        return "".join(self._texts)

    def chunk(self, text: str = "", num_tokens: int | None = None,
              token_ids: Sequence[int] | None = None,
              logprobs: Sequence[float] | None = None) -> None:
        """One streamed delta. Empty deltas (no text, no tokens) are ignored."""
        n = num_tokens if num_tokens is not None else (
            len(token_ids) if token_ids is not None else (
                len(logprobs) if logprobs else (1 if text else 0)))
        if n == 0 and not text:
            return
        now = time.perf_counter()
        r = self.result
        if self._last is None:
            r.ttft_s = now - self._sent
        else:
            r.itl_s.append(now - self._last)
        self._last = now
        r.chunk_tokens.append(n)
        self._counted += n
        self._texts.append(text)
        if token_ids is not None:
            r.token_ids = (r.token_ids or []) + [int(t) for t in token_ids]
        if logprobs is not None:
            r.logprobs = (r.logprobs or []) + [float(x) for x in logprobs]

    def finish(self, *, output_len: int | None = None, finish_reason: str | None = None,
               determinism: dict[str, Any] | None = None) -> RequestResult:
        r = self.result
        r.e2el_s = time.perf_counter() - self._sent
        r.text = "".join(self._texts)
        r.output_len = output_len if output_len is not None else self._counted
        r.finish_reason = finish_reason
        r.determinism = determinism
        r.success = self._last is not None or r.output_len > 0
        if not r.success:
            r.error = "no tokens were returned"
        return r

    def fail(self, error: str) -> RequestResult:
        r = self.result
        r.e2el_s = time.perf_counter() - self._sent
        r.text = "".join(self._texts)
        r.success = False
        r.error = error or "error"
        return r


@dataclass(frozen=True)
class ReplayOptions:
    """``deadline_s``: no request runs past this many seconds from the replay's start (a
    request still streaming then fails as timed out; one not yet sent fails unsent), so an
    overloaded run ends on time instead of draining its backlog."""

    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError("deadline_s must be > 0")

    def timeout_at(self, elapsed_s: float) -> float:
        """The timeout of a request sent ``elapsed_s`` after the replay's start."""
        if self.deadline_s is None:
            return self.request_timeout_s
        return min(self.request_timeout_s, self.deadline_s - elapsed_s)


class Target(ABC):
    """Something that serves requests. ``label`` names it in results."""

    label: str = "target"
    tokenizer: Tokenizer | None = None

    @abstractmethod
    async def replay(self, requests: Sequence[TraceRequest], opts: ReplayOptions,
                     on_done: OnDone | None = None) -> list[RequestResult]:
        """Send every request at its arrival offset; results in the order given."""

    async def server_stats(self) -> dict[str, float]:
        """Cumulative server counters (rollbacks, recomputed_tokens...); {} if unknown."""
        return {}

    async def aclose(self) -> None:
        return None


class StreamingTarget(Target):
    """A target driven one request at a time over a network API."""

    @abstractmethod
    async def generate(self, req: TraceRequest, run_start: float) -> RequestResult:
        """Send one request, consume its stream, return its result (never raises)."""

    async def replay(self, requests: Sequence[TraceRequest], opts: ReplayOptions,
                     on_done: OnDone | None = None) -> list[RequestResult]:
        start = time.perf_counter()
        sem = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None

        async def one(req: TraceRequest) -> RequestResult:
            delay = req.arrival_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem if sem is not None else contextlib.nullcontext():
                timeout = opts.timeout_at(time.perf_counter() - start)
                try:
                    if timeout <= 0:
                        raise asyncio.TimeoutError
                    res = await asyncio.wait_for(self.generate(req, start), timeout)
                except asyncio.TimeoutError:
                    res = RequestResult(req.id, req.is_deterministic, req.prompt_len,
                                        start_s=time.perf_counter() - start,
                                        error=f"timed out after {max(timeout, 0.0):.1f}s")
            if on_done is not None:
                on_done(res)
            return res

        return list(await asyncio.gather(*(one(r) for r in requests)))
