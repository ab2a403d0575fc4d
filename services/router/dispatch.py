"""Send a ``Job``'s sequences to decoders and stream their committed output back.

One ``ChoiceEvent`` per decoder chunk that adds something. A decoder failure (the replica
died, or its engine failed) ends a non-deterministic sequence with ``DecoderFailure``; a
deterministic one is replayed on another replica up to ``max_replays`` times (through Ray
Serve handle calls), and only the part the client has not seen yet is streamed (see
``replay``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ray.exceptions import RayError

from detserve.outputs import TokenLogprob
from services.decoder.messages import DecodeChunk, DecodeRequest
from services.router.channels import ChannelHub, ChannelLost, Item
from services.router.errors import invalid
from services.router.links import LinkHub
from services.router.metrics import RouterMetrics, SequenceTimer
from services.router.prepare import Job
from services.router.replay import ReplayDiverged, SentState

# how long after a channel request's call ended its last chunk may still be on the way
LAST_CHUNK_GRACE_S = 60.0


class DecoderFailure(Exception):
    """The sequence cannot complete: its decoder failed (message says why); ``replica``:
    the replica that failed it, where known."""

    def __init__(self, message: str, replica: str = "") -> None:
        super().__init__(message)
        self.replica = replica


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
    def __init__(self, decoder: Any, metrics: RouterMetrics, max_replays: int = 1,
                 channels: bool = True, links: LinkHub | None = None) -> None:
        """``links``: a sequence goes over a decoder's link (``services.router.links``)
        while one is attached, else through Ray Serve handle calls; ``channels``: those
        calls' chunks come through one channel per decoder replica
        (``services.router.channels``); False: each request's own stream."""
        self._decoder = decoder.options(stream=True)
        self._metrics = metrics
        self.max_replays = max_replays
        self.hub = ChannelHub(self._decoder) if channels else None
        self.links = links
        self._watchers: set[asyncio.Task[None]] = set()

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
        attempt = 0
        try:
            while True:
                try:
                    async for chunk in self._decode(request, attempt):
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
                    if not request.is_deterministic or attempt >= self.max_replays:
                        raise
                    if e.replica:  # the replay goes elsewhere (``request_router``)
                        request = replace(request, avoid=(*request.avoid, e.replica))
                    attempt += 1
                    sent.restart()
                    self._metrics.replays.inc()
        finally:
            timer.close()

    async def _decode(self, request: DecodeRequest, attempt: int) -> AsyncIterator[DecodeChunk]:
        if attempt:
            request = replace(request, request_id=f"{request.request_id}-replay{attempt}")
        request = replace(request, dispatched=time.monotonic())
        # a replay goes through Ray Serve: its controller knows which replicas are alive,
        # while a link to a replica that died with the first one may not have broken yet
        replica = self.links.pick(request) if self.links is not None and not attempt else None
        if replica is not None:
            chunks = self._decode_link(request, replica)
        elif self.hub is not None:
            chunks = self._decode_channel(request)
        else:
            chunks = self._decode_stream(request)
        self._metrics.dispatch.labels("handle" if replica is None else "link").inc()
        async for chunk in chunks:
            self._metrics.engines.update(chunk.replica, chunk.engine_stats)
            if chunk.error is not None:
                if chunk.error_type == "invalid_request":
                    raise invalid(chunk.error)
                raise DecoderFailure(chunk.error, chunk.replica)
            yield chunk

    async def _decode_link(self, request: DecodeRequest, replica: str
                           ) -> AsyncIterator[DecodeChunk]:
        links = self.links
        assert links is not None
        queue = links.submit(request, replica)
        done = False
        try:
            async for chunk in _queued(queue, replica):
                done = chunk.finished or chunk.error is not None
                yield chunk
        except DecoderFailure:
            done = True  # the link broke: nothing left to abort
            raise
        finally:
            links.release(request.request_id, abort=not done)

    async def _decode_channel(self, request: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        hub = self.hub
        assert hub is not None
        rid = request.request_id
        queue = hub.register(rid)
        stream = self._decoder.generate.remote(request, hub.id)
        done = False
        try:
            try:
                (replica,) = await stream.__anext__()
            except RayError as e:
                raise DecoderFailure(decoder_failed(e)) from e
            except StopAsyncIteration:
                raise DecoderFailure("decoder stream ended before the request started") from None
            hub.bind(rid, replica)
            watcher = asyncio.create_task(_watch(stream, queue, replica,
                                                 lambda: hub.is_open(rid, queue)))
            self._watchers.add(watcher)
            watcher.add_done_callback(self._watchers.discard)
            async for chunk in _queued(queue, replica):
                done = chunk.finished or chunk.error is not None
                yield chunk
        except DecoderFailure:
            done = True  # the channel or the call broke: nothing left to cancel
            raise
        finally:
            hub.release(rid)
            if not done:
                stream.cancel()

    async def _decode_stream(self, request: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        stream = self._decoder.generate.remote(request)
        done = False
        try:
            async for wire in stream:
                chunk = DecodeChunk.from_wire(wire)
                done = chunk.finished or chunk.error is not None
                yield chunk
        except RayError as e:
            done = True
            raise DecoderFailure(decoder_failed(e)) from e
        finally:
            if not done:
                stream.cancel()
        if not done:
            raise DecoderFailure("decoder stream ended before the request finished")


async def _queued(queue: asyncio.Queue[Item], replica: str) -> AsyncIterator[DecodeChunk]:
    """A request's chunks from its queue up to its last one; a lost channel or link
    (``ChannelLost``) raises ``DecoderFailure`` (of ``replica``)."""
    while True:
        item = await queue.get()
        if isinstance(item, ChannelLost):
            raise DecoderFailure(item.message, replica)
        yield item
        if item.finished or item.error is not None:
            return


async def _watch(stream: Any, queue: asyncio.Queue[Item], replica: str,
                 is_open: Callable[[], bool]) -> None:
    """The rest of a channel request's ``generate`` call: it ends when the request does; if
    it fails first (the replica died), the request's queue learns it. Once it has ended,
    the request's last chunk is on the channel: if the request is still open
    ``LAST_CHUNK_GRACE_S`` later (``is_open``), that chunk was lost, and the request fails
    instead of waiting forever."""
    try:
        async for _ in stream:
            pass
    except asyncio.CancelledError:
        raise
    except Exception as e:  # RayError: the replica died; after a cancel nobody reads this
        queue.put_nowait(ChannelLost(decoder_failed(e, replica)))
        return

    def overdue() -> None:
        if is_open():
            queue.put_nowait(ChannelLost(
                f"decoder {replica} finished the request, but its last chunk did not "
                f"arrive within {LAST_CHUNK_GRACE_S:.0f} s"))

    asyncio.get_running_loop().call_later(LAST_CHUNK_GRACE_S, overdue)


def decoder_failed(error: BaseException, replica: str = "") -> str:
    """What a request whose decoder call failed is told."""
    who = f"decoder {replica}" if replica else "decoder"
    return f"{who} failed: {type(error).__name__}: {error}"


def _event(index: int, chunk: DecodeChunk) -> ChoiceEvent:
    return ChoiceEvent(index, chunk.text, chunk.token_ids, chunk.logprobs, chunk.finish_reason,
                       chunk.num_prompt_tokens, chunk.num_output_tokens, chunk.determinism,
                       chunk.prompt_logprobs)
