"""``RemoteVerifier``: the decoder's side of the verifier pool (implements ``Verifier``).

It keeps one stream to one verifier found in the registry: a co-located one (same host and
device: it maps the decoder's pool) when there is one, else the least loaded of those that
do K/V transfer (``transfer``: the verifier keeps its own copy of the lane K/V; rows move
over a pair of process groups made for the stream). ``submit`` sends a
pass and remembers it until its result arrives; ``poll`` returns results. When the stream
breaks (the verifier died, was restarted, stopped answering), it picks another live
verifier, waiting up to ``failover_timeout_s`` for one to appear, says hello again and
re-sends every pass still without a result, in submission order. Re-running a pass is
safe: a request in the lane is touched by nothing else, so the same rows give the same K/V
bits and the same decisions. Results only ever come from a verifier; if none can be had,
``submit`` or ``poll`` raises ``VerifierUnavailable`` having dropped every pass in flight,
and the engine fails its deterministic requests (``LLMEngine.fail_lane``) instead of
committing anything unverified. Until a verifier is found again, a later pass looks for one
once, without waiting: it fails at once while none is usable (the engine loop is not held
up for each deterministic request meanwhile), and is verified as soon as one is. A stream
that breaks with no pass in flight is only dropped: the next pass finds a verifier, so an
engine serving only non-deterministic requests meanwhile never waits for one.

Redis is needed only to find a verifier (a hello is checked against the registry): while
Redis is away an open stream goes on verifying, the block tables wait to be published, and
the decoder's record is written again once Redis is back (a ``Heartbeat``). The engine's
thread never waits on Redis: the block tables are written behind it (``_TableIndex``), so a
Redis that hangs instead of refusing costs the engine nothing either. A decoder that
finds a newer epoch of its own id there is stale: ``submit`` and ``poll`` raise
``StaleEpochError``.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import grpc
import redis

from detserve.distributed import PeerLost, backend_for, open_store
from detserve.executor.runner import ModelRunner
from detserve.lane import LanePass, LaneResult
from detserve.parallel.kv_rows import transfer_pool
from detserve.verifier import LaneUnavailable
from services.cluster_auth import ClusterAuth
from services.kv_handle import KVExporter, KVHandle
from services.registry import (
    DEFAULT_PREFIX,
    DecoderRecord,
    Heartbeat,
    Registry,
    VerifierRecord,
)
from services.verifier import codec
from services.verifier import verifier_pb2 as pb
from services.verifier.stream import Closed, Event, LaneStream
from services.verifier.transfer import DecoderTransfer, RowStore, TransferStats

log = logging.getLogger(__name__)


class VerifierUnavailable(LaneUnavailable):
    """No usable verifier appeared within the failover timeout."""


class StaleEpochError(RuntimeError):
    """The registry holds a newer epoch of this decoder: this process must not go on."""


class VerifierError(RuntimeError):
    """A verifier reported that a pass failed (a bug on one side, not a crash)."""


class RemoteVerifier:
    @property
    def stream_ordered(self) -> bool:
        """A mapping verifier reads the decoder's K/V outside the decoder's stream order
        (the engine finishes its batch in flight before submitting a pass). A transferring
        one reads only rows pushed from here, read on the engine's stream after that batch;
        while none is found, as a mapping one (the next may be)."""
        return self._stream is not None and self._xfer is not None

    @property
    def shares_device(self) -> bool:
        """A transferring verifier runs its lane on another device (a mapping one on ours):
        the engine never gives it a decode step."""
        return not self.stream_ordered

    def __init__(self, registry: Registry, record: DecoderRecord, auth: ClusterAuth, *,
                 pool: RowStore | None = None,
                 failover_timeout_s: float = 30.0, hello_timeout_s: float = 10.0,
                 pass_timeout_s: float = 120.0, retry_bad_after_s: float = 2.0,
                 transfer_timeout_s: float = 30.0, publish_block_tables: bool = True) -> None:
        """``pool``: the engine's KV pool (at TP>1 all its ranks', ``transfer_pool``), for
        K/V transfer (without it, co-located verifiers only)."""
        self.registry = registry
        self.pool = pool
        self.transfer_timeout_s = transfer_timeout_s
        self._xfer: DecoderTransfer | None = None  # the current stream's, if it transfers
        self._xfer_gens: set[int] = set()  # generations of streams that transferred
        self.record = record
        self.auth = auth  # what verifiers ask of their callers
        self.failover_timeout_s = failover_timeout_s
        self.hello_timeout_s = hello_timeout_s
        self.pass_timeout_s = pass_timeout_s
        self.retry_bad_after_s = retry_bad_after_s
        self._pending: dict[int, LanePass] = {}  # submitted, no result yet; submission order
        self._events: queue.Queue[Event] = queue.Queue()
        self._ready: list[LaneResult] = []
        self._stream: LaneStream | None = None
        self._generation = 0
        self._bad: dict[str, float] = {}  # verifier address -> when it last failed us
        self._tables: dict[str, tuple[int, ...]] = {}  # as last handed to the index
        self._index = (_TableIndex(registry, record.decoder_id, record.epoch)
                       if publish_block_tables else None)
        self._beat: Heartbeat | None = None  # keeps this decoder's record in Redis
        # why a search that dropped passes found no verifier; None once one is found
        self._lost: str | None = None
        self._search: _Search | None = None  # looking for a verifier, off the engine thread
        # passes sent on the current transferring stream, until their rows are pulled
        self._sent: dict[int, LanePass] = {}
        self.failovers = 0
        self.resent_passes = 0

    # ---- the Verifier protocol --------------------------------------------------------
    def submit(self, lane_pass: LanePass) -> None:
        self._check_epoch()
        self._publish_tables(lane_pass)
        self._pending[lane_pass.pass_id] = lane_pass
        if self._stream is not None:
            self._send(lane_pass)
        elif self._search is None:
            self._start_search()  # the pass goes out once a verifier is found
        self._settle_search()

    def poll(self, wait: bool = False) -> list[LaneResult]:
        """Results ready now; with ``wait``, until one is, while a stream is open (while a
        verifier is being looked for, only briefly: the engine keeps stepping its other
        requests). Raises ``VerifierUnavailable`` once a search gave up."""
        self._check_epoch()
        self._settle_search()
        self._drain(block=False)
        if wait and not self._ready and self._pending:
            if self._search is not None:
                self._search.done.wait(0.05)
                self._settle_search()
            if self._stream is not None:
                self._drain(block=True)
        out, self._ready = self._ready, []
        return out

    def in_flight(self) -> int:
        """Passes a verifier is working on (or whose results wait to be polled). While one
        is looked for, none: the engine must not give the device to a lane that is not
        there (it yields steps to a lane pass in flight)."""
        if self._stream is None:
            return len(self._ready)
        return len(self._pending) + len(self._ready)

    def close(self) -> None:
        self._drop_stream(None)
        if self._index is not None:
            self._index.close()
        if self._beat is not None:
            self._beat.stop(deregister=True)
        else:
            try:
                self.registry.retire_decoder(self.record.decoder_id, self.record.epoch)
            except redis.RedisError:
                log.warning("could not retire decoder %s from the registry",
                            self.record.decoder_id)
        self.registry.close()

    # ---- extras for the decoder service -------------------------------------------------
    @property
    def verifier(self) -> VerifierRecord | None:
        """The verifier currently in use."""
        return self._stream.verifier if self._stream else None

    @property
    def ready(self) -> bool:
        """Deterministic requests can be verified now: a verifier stream is open, or a
        failover would find a usable verifier in the registry. Safe from any thread."""
        stream = self._stream
        if stream is not None and stream.open:
            return True
        # a verifier only accepts a decoder whose record is in Redis: after Redis came back
        # empty, not ready until our heartbeat wrote it again
        registered = self._beat is None or self._beat.registered
        return registered and bool(self._candidates())

    def keep_registered(self, ttl_s: float = 3.0) -> None:
        """Keep this decoder's epoch and record in Redis (written again after Redis lost
        them), every ``ttl_s / 3``."""
        if self._beat is None:
            self._beat = Heartbeat(self.registry, self.record, ttl_s).start()

    @property
    def transfer_stats(self) -> TransferStats | None:
        """K/V moved over the current stream (None: co-located, or no stream)."""
        return self._xfer.stats if self._xfer is not None else None

    def wait_tables_written(self, timeout_s: float) -> bool:
        """Whether the block tables handed over so far reached Redis within ``timeout_s``
        (True when none are published)."""
        return self._index is None or self._index.wait_written(timeout_s)

    def drop_requests(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests' block tables (in Redis too, when it is reachable), and
        have a transferring verifier drop their K/V."""
        request_ids = list(request_ids)
        if self._xfer is not None and self._stream is not None:
            held = [rid for rid in request_ids if rid in self._xfer.held]
            if held:
                self._xfer.release(held)
                self._stream.send(pb.LaneRequest(release=pb.Release(request_ids=held)))
        gone = [rid for rid in request_ids if self._tables.pop(rid, None) is not None]
        if gone and self._index is not None:
            self._index.update(dict.fromkeys(gone))

    def connect(self) -> None:
        """Open a stream to a usable verifier and (re-)send every pending pass, waiting
        for the search (``_Search``) to end. Raises ``VerifierUnavailable`` having dropped
        every pending pass if it found none."""
        if self._stream is not None:
            return
        if self._search is None:
            self._start_search()
        assert self._search is not None
        self._search.done.wait()
        self._settle_search()

    # ---- internals --------------------------------------------------------------------
    def _check_epoch(self) -> None:
        if self._beat is not None and self._beat.stale:
            raise StaleEpochError(f"decoder {self.record.decoder_id!r}: the registry holds a "
                                  f"newer epoch than {self.record.epoch}")

    def _candidates(self) -> list[VerifierRecord]:
        """Live verifiers that run our model and can reach our K/V: co-located ones first
        (they map the pool), then those that transfer K/V, least loaded first; ones that
        failed us recently only after a while (their registration may not have expired)."""
        try:
            live = self.registry.live_verifiers()
        except redis.RedisError as e:
            log.warning("registry unreachable: %s", e)
            return []
        now = time.monotonic()
        usable = [v for v in live if v.weights_hash == self.record.weights_hash
                  and (self._colocated(v) or (v.kv_store and self.pool is not None))
                  and now - self._bad.get(v.address, -1e9) > self.retry_bad_after_s]
        # rendezvous hashing breaks ties: decoders spread over the pool, each with a
        # stable preference
        return sorted(usable, key=lambda v: (not self._colocated(v), v.load, hashlib.sha1(
            f"{self.record.decoder_id}/{v.verifier_id}".encode()).digest()))

    def _colocated(self, v: VerifierRecord) -> bool:
        """Whether ``v`` maps our pool. Never at TP>1: the pool is sharded over the ranks
        (the exported one is rank 0's heads only), so its K/V always moves by transfer."""
        handle = self.record.kv_handle
        if self.record.numerics.tensor_parallel_size > 1:
            return False
        return v.host == handle.host and v.device_key in ("", handle.device_key)

    def _send(self, lane_pass: LanePass) -> None:
        """Put a pass on the current stream (with its pushed rows, when transferring)."""
        assert self._stream is not None
        if self._xfer is None:
            self._stream.send(codec.encode_pass(lane_pass))
            return
        kv_from = self._xfer.plan(lane_pass)
        self._sent[lane_pass.pass_id] = lane_pass
        self._stream.send(codec.encode_pass(lane_pass, kv_from))
        try:
            self._xfer.push(lane_pass, kv_from)
        except PeerLost as e:
            self._failover(f"K/V push: {e}")

    def _start_search(self) -> None:
        """Look for a verifier on a thread of its own: up to ``failover_timeout_s``, or
        once without waiting after a search that dropped passes (until one succeeds)."""
        wait_s = 0.0 if self._lost is not None else self.failover_timeout_s
        self._search = _Search(self, wait_s)

    def _settle_search(self) -> None:
        """On the engine thread: take a finished search's stream (re-sending the pending
        passes) or its failure."""
        search = self._search
        if search is None or not search.done.is_set():
            return
        self._search = None
        if isinstance(search.result, BaseException):
            raise search.result
        if isinstance(search.result, str):
            if self._pending or self._lost is not None:
                self._lost = search.result
            self._pending.clear()
            self._ready.clear()
            raise VerifierUnavailable(search.result)
        found = search.result
        assert found is not None
        self._lost = None
        found.stream.retarget(self._events)
        self._stream, self._xfer, self._sent = found.stream, found.xfer, {}
        if found.xfer is not None:
            self._xfer_gens.add(found.stream.generation)
            try:  # here, not on the search thread: the engine's own NCCL work runs here
                found.xfer.connect()
            except PeerLost as e:
                self._failover(f"K/V transfer groups: {e}")
                return
        log.info("decoder %s verified by %s (%s), %d passes re-sent", self.record.decoder_id,
                 found.stream.verifier.address, "K/V transfer" if found.xfer else "mapped",
                 len(self._pending))
        for p in list(self._pending.values()):
            if self._stream is None:
                break  # the push failed: a new search has started
            self._send(p)

    def _find(self, wait_s: float) -> _Found | str:
        """On the search thread: a stream to the first candidate that says Ready, or why
        none did within ``wait_s``. Touches no state the engine thread uses."""
        deadline = time.monotonic() + wait_s
        last_error = "no verifier registered"
        while True:
            for verifier in self._candidates():
                found = self._handshake(verifier)
                if (isinstance(found, Closed) and found.code == grpc.StatusCode.NOT_FOUND
                        and self._beat is not None and self._beat.refresh()):
                    found = self._handshake(verifier)  # Redis had lost our record: rewritten
                if not isinstance(found, Closed):
                    return found
                last_error = f"{verifier.address}: {found.code}: {found.details}"
                self._bad[verifier.address] = time.monotonic()
            if time.monotonic() >= deadline:
                return (f"no usable verifier for decoder {self.record.decoder_id!r} "
                        f"within {wait_s:.0f} s (last error: {last_error})")
            time.sleep(0.1)

    def _handshake(self, verifier: VerifierRecord) -> _Found | Closed:
        """Say hello (on a queue of its own); on Ready, join the transfer groups if the
        verifier cannot map our pool. Raises ``StaleEpochError``."""
        self._generation += 1
        private: queue.Queue[Event] = queue.Queue()
        stream = LaneStream(verifier, self._generation, private, self.auth)
        transfer = None
        if not self._colocated(verifier):
            assert self.pool is not None
            transfer = pb.KVTransfer(
                group=f"{self.record.decoder_id}/{self.record.epoch}/{self._generation}/"
                      f"{uuid.uuid4().hex[:8]}",
                backend=backend_for(self.pool.device), device=str(self.pool.device))
        stream.send(codec.encode_hello(self.record, transfer))
        try:
            _, event = private.get(timeout=self.hello_timeout_s)
        except queue.Empty:
            stream.close()
            return Closed(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"no answer to hello within {self.hello_timeout_s} s")
        if isinstance(event, Closed):
            stream.close()
            if event.code == grpc.StatusCode.FAILED_PRECONDITION:
                raise StaleEpochError(event.details)
            return event
        if event.WhichOneof("kind") != "ready":
            stream.close()
            return Closed(grpc.StatusCode.INTERNAL, "the verifier answered hello with a result")
        xfer = None
        if transfer is not None:
            try:
                host, port = verifier.kv_store.rsplit(":", 1)
                store = open_store(host, int(port), server=False,
                                   timeout_s=self.transfer_timeout_s)
                assert self.pool is not None
                xfer = DecoderTransfer(store, transfer.group, self.pool,
                                       self.transfer_timeout_s)
            except (PeerLost, RuntimeError, ValueError) as e:
                stream.close()
                return Closed(grpc.StatusCode.UNAVAILABLE, f"K/V transfer groups: {e}")
        return _Found(stream, xfer)

    def _drain(self, block: bool) -> None:
        """Handle queued events; with ``block``, until a result is ready."""
        while True:
            if block and self._stream is None:
                return  # failing over: the search runs on; the engine steps on
            timeout = self.pass_timeout_s if block and not self._ready else None
            try:
                if timeout is None:
                    gen, event = self._events.get_nowait()
                else:
                    gen, event = self._events.get(timeout=timeout)
            except queue.Empty:
                if timeout is None:
                    return
                self._failover(f"no result within {self.pass_timeout_s} s")
                continue
            current = self._stream is not None and gen == self._stream.generation
            if isinstance(event, Closed):
                if current and self._pending:
                    self._failover(f"stream closed: {event.code}: {event.details}")
                elif current:  # nothing to verify now: the next pass finds a verifier
                    self._drop_stream(f"stream closed: {event.code}: {event.details}")
            else:
                self._take(gen, event)

    def _take(self, gen: int, event: pb.LaneReply | Closed) -> None:
        if isinstance(event, Closed):
            return
        current = self._stream is not None and gen == self._stream.generation
        if gen in self._xfer_gens and not current:
            return  # an old transferring stream's: its rows cannot be had, the pass re-runs
        kind = event.WhichOneof("kind")
        if kind == "error":
            raise VerifierError(f"lane pass {event.error.pass_id}: {event.error.message}")
        if kind == "decisions":
            result = codec.decode_result(event.decisions)
            sent = self._sent.pop(result.pass_id, None)
            if current and self._xfer is not None and sent is not None:
                # the committed rows, into the pool before the decisions apply (a pass
                # already decided by an old stream: taken off the wire, written nowhere)
                try:
                    self._xfer.pull(sent, result, event.decisions.kv_rows,
                                    write=result.pass_id in self._pending)
                except PeerLost as e:
                    self._failover(f"K/V pull: {e}")
                    return
            # a duplicate (the pass was re-sent after its result was already under way)
            # carries the same bits; only the first one counts
            if self._pending.pop(result.pass_id, None) is not None:
                self._ready.append(result)

    def _drop_stream(self, reason: str | None) -> None:
        """Close the current stream (``reason``: it failed) and its transfer groups."""
        old, self._stream = self._stream, None
        xfer, self._xfer = self._xfer, None
        self._sent = {}
        if xfer is not None:
            xfer.close()
        if old is not None:
            if reason is not None:
                log.warning("verifier %s lost (%s); %d passes in flight",
                            old.verifier.address, reason, len(self._pending))
                self._bad[old.verifier.address] = time.monotonic()
            old.close()

    def _failover(self, reason: str) -> None:
        """The stream failed with passes in flight: drop it and look for another verifier
        (on the search thread; the passes are re-sent when one is found)."""
        self._drop_stream(reason)
        self.failovers += 1
        self.resent_passes += len(self._pending)
        if self._search is None:
            self._start_search()

    def _publish_tables(self, lane_pass: LanePass) -> None:
        if self._index is None:
            return
        changed = {s.request_id: s.block_table for s in lane_pass.segments
                   if self._tables.get(s.request_id) != s.block_table}
        if changed:
            self._tables.update(changed)
            self._index.update(changed)


class _TableIndex:
    """This decoder's block tables in Redis (which blocks hold each deterministic
    sequence's K/V), written behind the engine: ``update`` only records the latest change
    of each request (a table, or None: dropped) and a thread of its own writes them, in one
    round trip, retrying every ``retry_s`` while Redis is away or does not answer. Redis
    always ends up with the latest tables once it answers."""

    def __init__(self, registry: Registry, decoder_id: str, epoch: int,
                 retry_s: float = 0.5) -> None:
        self.registry, self.decoder_id, self.epoch = registry, decoder_id, epoch
        self.retry_s = retry_s
        self._pending: dict[str, tuple[int, ...] | None] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()  # nothing pending, nothing being written
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="block-table-index",
                                        daemon=True)
        self._thread.start()

    def update(self, tables: Mapping[str, tuple[int, ...] | None]) -> None:
        with self._lock:
            self._pending.update(tables)
            self._idle.clear()
        self._wake.set()

    def wait_written(self, timeout_s: float) -> bool:
        """Whether everything updated so far reached Redis within ``timeout_s``."""
        return self._idle.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop (what is still pending is not written: the decoder is retiring)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                batch, self._pending = self._pending, {}
            if not batch or self._stop.is_set():
                self._settle()
                continue
            try:
                self.registry.update_block_tables(self.decoder_id, self.epoch, batch)
            except redis.RedisError as e:
                log.debug("block tables not written (Redis away): %s", e)
                with self._lock:  # what changed meanwhile is newer
                    self._pending = {**batch, **self._pending}
                self._stop.wait(self.retry_s)
                self._wake.set()
                continue
            self._settle()

    def _settle(self) -> None:
        with self._lock:
            if not self._pending:
                self._idle.set()


@dataclass
class _Found:
    stream: LaneStream
    xfer: DecoderTransfer | None  # None: the verifier maps our pool


class _Search:
    """``RemoteVerifier._find`` on a daemon thread; ``result`` once ``done`` is set: a
    ``_Found``, the reason none was found, or the exception it raised."""

    def __init__(self, owner: RemoteVerifier, wait_s: float) -> None:
        self.done = threading.Event()
        self.result: _Found | str | BaseException | None = None

        def run() -> None:
            try:
                self.result = owner._find(wait_s)
            except BaseException as e:  # StaleEpochError and bugs: raised on the engine thread
                self.result = e
            self.done.set()

        threading.Thread(target=run, name="verifier-search", daemon=True).start()


def make_verifier_factory(redis_url: str, decoder_id: str, kv_handle: KVHandle | KVExporter,
                          weights_hash: str, *, auth: ClusterAuth,
                          prefix: str = DEFAULT_PREFIX,
                          connect: bool = True, **options: float | bool
                          ) -> Callable[[ModelRunner], RemoteVerifier]:
    """``LLMEngine(verifier_factory=...)``: when the engine has built its runner over the
    exported pool, publish this decoder's record and connect to a verifier.

    ``kv_handle`` may be the ``KVExporter`` also passed as ``kv_storage``: its handle exists
    only once the engine has allocated the pool, which happens before this factory runs.
    ``options`` go to ``RemoteVerifier`` (timeouts, ``publish_block_tables``)."""

    def factory(runner: ModelRunner) -> RemoteVerifier:
        handle = kv_handle.handle if isinstance(kv_handle, KVExporter) else kv_handle
        if handle.decoder_id != decoder_id:
            raise ValueError(f"KV handle of {handle.decoder_id!r}, not {decoder_id!r}")
        pool = runner.pool.data
        if tuple(pool.shape) != handle.shape or str(pool.dtype) != f"torch.{handle.dtype}":
            raise ValueError("the engine's KV pool is not the exported one")
        record = DecoderRecord(decoder_id, handle.epoch, handle, weights_hash,
                               runner.numerics, codec.kernels_profile(runner))
        registry = Registry(redis_url, prefix)
        registry.publish_decoder(record)
        verifier = RemoteVerifier(registry, record, auth, pool=transfer_pool(runner),
                                  **options)  # type: ignore[arg-type]
        verifier.keep_registered()
        if connect:
            verifier.connect()
        return verifier

    return factory
