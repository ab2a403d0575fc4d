"""Send a ``Job``'s sequences to decoders over their links and stream their output back.

One ``ChoiceEvent`` per decoder chunk that adds something. A decoder failure (the replica
died, or its engine failed) ends a non-deterministic sequence with ``DecoderFailure``; a
deterministic one is replayed on another replica up to ``max_replays`` times (not when
its decoder lost verification: ``VerificationLost`` ends it at once), and only the
part the client has not seen yet is streamed (see ``replay``). An attempt that failed
before its decoder sent anything (its link broke at once: the replica died with the one
that failed it; or the replica refused it) is sent again to another replica without
counting as a replay, up to ``max_attempts`` attempts in all.

With no link attached (a router that just started, every replica restarting) a sequence
waits ``link_wait_s`` for one (a replay ``replay_wait_s``), then fails: before its first
event with a 503 ``APIError``, never by hanging.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace

from detserve.outputs import TokenLogprob
from services.decoder.messages import DecodeChunk, DecodeRequest
from services.router.errors import invalid, unavailable
from services.router.links import LinkHub, LinkLost
from services.router.metrics import RouterMetrics, SequenceTimer
from services.router.prepare import Job
from services.router.replay import ReplayDiverged, SentState


class DecoderFailure(Exception):
    """The sequence cannot complete: its decoder failed (message says why); ``replica``:
    the replica that failed it, where known."""

    def __init__(self, message: str, replica: str = "") -> None:
        super().__init__(message)
        self.replica = replica


class NoLink(DecoderFailure):
    """No decoder link attached in time for a replay: nowhere to send it."""


class VerificationLost(DecoderFailure):
    """The decoder could not go on verifying a deterministic sequence (its verifier lost,
    no other one to be had): not replayed, the client gets the decoder's reason at once."""


@dataclass(frozen=True)
class ChoiceEvent:
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    determinism: Mapping[str, object] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # first event, if asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Dispatcher:
    def __init__(self, links: LinkHub, metrics: RouterMetrics, max_replays: int = 1, *,
                 link_wait_s: float = 10.0, replay_wait_s: float = 120.0,
                 max_attempts: int = 8) -> None:
        """``replay_wait_s`` covers a replica's restart (Ray Serve replaces a dead one)."""
        self.links = links
        self._metrics = metrics
        self.max_replays = max_replays
        self.link_wait_s = link_wait_s
        self.replay_wait_s = replay_wait_s
        self.max_attempts = max_attempts

    async def run(self, job: Job) -> AsyncIterator[ChoiceEvent]:
        """Events of every choice, interleaved as they arrive."""
        if len(job.choices) == 1:
            async for event in self._choice(0, job.choices[0]):
                yield event
            return
        async for event in self._fan_in(job):
            yield event

    async def _fan_in(self, job: Job) -> AsyncIterator[ChoiceEvent]:
        queue: asyncio.Queue[ChoiceEvent | BaseException | None] = asyncio.Queue()

        async def pump(index: int, request: DecodeRequest) -> None:
            try:
                async for event in self._choice(index, request):
                    await queue.put(event)
                await queue.put(None)
            except Exception as e:
                await queue.put(e)

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(job.choices)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    async def _choice(self, index: int, request: DecodeRequest) -> AsyncIterator[ChoiceEvent]:
        timer = SequenceTimer(self._metrics, request.is_deterministic,
                              len(request.prompt_token_ids))
        sent = SentState()
        attempt = replays = 0
        try:
            while True:
                started = False  # the attempt's decoder sent a chunk
                try:
                    async for chunk in self._decode(request, attempt):
                        started = True
                        new = sent.new_part(chunk)
                        timer.on_tokens(len(new.token_ids))
                        if new.token_ids or new.text or new.finished or new.prompt_logprobs:
                            yield _event(index, new)
                        if new.finished:
                            timer.finish(new.finish_reason or "stop")
                    return
                except ReplayDiverged as e:
                    raise DecoderFailure(f"deterministic replay diverged: {e}") from e
                except DecoderFailure as e:
                    if not request.is_deterministic or isinstance(e, NoLink | VerificationLost):
                        raise
                    if started:
                        if replays >= self.max_replays:
                            raise
                        replays += 1
                        self._metrics.replays.inc()
                    elif attempt + 1 >= self.max_attempts:
                        raise
                    if e.replica:  # the next attempt goes elsewhere (``LinkHub.pick``)
                        request = replace(request, avoid=(*request.avoid, e.replica))
                    attempt += 1
                    sent.restart()
        finally:
            timer.close()

    async def _decode(self, request: DecodeRequest, attempt: int) -> AsyncIterator[DecodeChunk]:
        if attempt:
            request = replace(request, request_id=f"{request.request_id}-replay{attempt}")
        wait_s = self.replay_wait_s if attempt else self.link_wait_s
        replica = await self.links.wait(request, wait_s)
        if replica is None:
            if attempt:
                raise NoLink(f"no decoder link attached within {wait_s:.0f} s to replay on")
            raise unavailable(f"no decoder is reachable: no decoder link attached within "
                              f"{wait_s:.0f} s")
        request = replace(request, dispatched=time.monotonic())
        try:
            queue = self.links.submit(request, replica)
        except ValueError as e:
            raise invalid(str(e)) from e
        self._metrics.dispatch.labels("link").inc()
        done = False
        try:
            async for chunk in _queued(queue, replica):
                done = chunk.finished or chunk.error is not None
                self._metrics.engines.update(chunk.replica, chunk.engine_stats)
                if chunk.error is not None:
                    if chunk.error_type == "invalid_request":
                        raise invalid(chunk.error)
                    if chunk.error_type == "verifier_unavailable":
                        raise VerificationLost(chunk.error, chunk.replica)
                    raise DecoderFailure(chunk.error, chunk.replica)
                yield chunk
        except DecoderFailure:
            done = True  # the link broke or the decoder failed it: nothing left to abort
            raise
        finally:
            self.links.release(request.request_id, abort=not done)


async def _queued(queue: asyncio.Queue[DecodeChunk | LinkLost], replica: str
                  ) -> AsyncIterator[DecodeChunk]:
    """A request's chunks from its queue up to its last one; a lost link (``LinkLost``)
    raises ``DecoderFailure`` (of ``replica``)."""
    while True:
        item = await queue.get()
        if isinstance(item, LinkLost):
            raise DecoderFailure(item.message, replica)
        yield item
        if item.finished or item.error is not None:
            return


def _event(index: int, chunk: DecodeChunk) -> ChoiceEvent:
    return ChoiceEvent(index, chunk.text, chunk.token_ids, chunk.logprobs, chunk.finish_reason,
                       chunk.num_prompt_tokens, chunk.num_output_tokens, chunk.determinism,
                       chunk.prompt_logprobs)
