"""K/V between a decoder and a verifier that cannot map its pool (another GPU or host).

The verifier keeps its own copy of the lane K/V of every deterministic sequence it
verifies: it wrote all of it (prompt chunks prefilled in its lane, windows verified there),
except rows it never saw, which the decoder sends before the pass that reads them. The
decoder's pool holds the lane's bits of every committed position, as with a co-located
verifier: after each pass the verifier sends back the rows the lane wrote from committed
inputs, and the decoder writes them in place before the pass's decisions are applied.

    decoder                                    verifier
    submit: message (kv_from per segment) ---> recv pushed rows into its own blocks
            push rows kv_from..start (push)    run the lane on its own blocks
    poll:   <--- reply (kv_rows)               send committed rows (pull)
            recv, write into its pool, then the engine applies the decisions

Each direction has a process group of its own (``detserve.distributed``): NCCL runs a
group's sends and receives in issue order on one stream, so a decoder that pushed pass
k+1 before pulling pass k would otherwise wait on a verifier that sends k before it
receives k+1. Within a direction both sides issue in pass order. A failed transfer
(``PeerLost``) ends the stream: the decoder fails over and a new verifier starts from
nothing, its first segment of each sequence pushing the whole committed prefix.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Protocol

import torch

from detserve.block_manager import BlockManager
from detserve.distributed import Group, PeerLost, new_group
from detserve.executor.kv_pool import KVPool
from detserve.lane import LanePass, LaneResult, LaneSegment

log = logging.getLogger(__name__)
VERIFIER_RANK, DECODER_RANK = 0, 1
MAX_SENDS = 32  # sends in flight per direction before the oldest is waited for


class RowStore(Protocol):
    """What a transfer uses of a pool: ``KVPool``, or a tensor-parallel engine's ranks as
    whole heads (``detserve.parallel.kv_rows.ShardedKV``); ``slots_of`` returns what the
    other methods take (``len``: the positions)."""

    @property
    def device(self) -> torch.device: ...

    def slots_of(self, spans: Iterable[tuple[Sequence[int], int, int]]) -> Any: ...

    def read_rows(self, slots: Any) -> torch.Tensor: ...

    def write_rows(self, slots: Any, rows: torch.Tensor) -> None: ...

    def empty_rows(self, n: int) -> torch.Tensor: ...


class KVFull(RuntimeError):
    """The verifier's own pool has no room for a pass's rows."""


def committed(lane_pass: LanePass, result: LaneResult) -> list[tuple[LaneSegment, int]]:
    """Each decision's segment and the end of its rows the lane computed from committed
    inputs (all of a prompt chunk; of a window, its last committed token and the accepted
    candidates), in decision order: the rows a pass sends back."""
    segs = {s.request_id: s for s in lane_pass.segments}
    out = []
    for d in result.decisions:
        s = segs[d.request_id]
        out.append((s, s.start + (len(s.input_ids) if s.kind == "prefill" else d.accepted + 1)))
    return out


@dataclass
class TransferStats:
    bytes_in: int = 0       # rows received
    bytes_out: int = 0      # rows sent
    rows_in: int = 0
    rows_out: int = 0
    wait_s: float = 0.0     # host time spent waiting for transfers


class JoinSignal:
    """The decoder's word, in the stream's store, that it connects its groups now. The
    verifier connects on its lane thread only once it has it, so that a decoder lost
    between Ready and its connect cannot hold the lane (and every other stream) in NCCL's
    set-up."""

    def __init__(self, store: Any, name: str, timeout_s: float) -> None:
        self.store, self.key, self.timeout_s = store, f"detserve/{name}/joining", timeout_s

    def announce(self) -> None:
        self.store.set(self.key, "1")

    def wait(self) -> None:
        """Until announced, or raise ``PeerLost`` after ``timeout_s``."""
        try:
            self.store.wait([self.key], timedelta(seconds=self.timeout_s))
        except RuntimeError as e:  # (DistStoreError is one)
            raise PeerLost(f"the decoder did not connect: {e}") from e


class _Pair:
    """The two groups of one stream, and the sends not yet known to be complete (their
    buffers stay alive until then)."""

    def __init__(self, store: Any, name: str, rank: int, device: torch.device | str,
                 timeout_s: float) -> None:
        # the verifier is rank 0 in both; "push" carries decoder -> verifier. Formed here
        # (any thread); ``connect`` runs on the thread of the process's other NCCL work.
        self.push = new_group(store, f"{name}/push", rank, 2, device, timeout_s, connect=False)
        self.pull = new_group(store, f"{name}/pull", rank, 2, device, timeout_s, connect=False)
        self.joining = JoinSignal(store, name, timeout_s)
        self.stats = TransferStats()
        self._sends: list[tuple[Group, Any, torch.Tensor]] = []
        # CUDA: receives are issued from a stream of their own. NCCL orders an operation
        # after the work queued on the stream it is issued from; from the engine's stream a
        # decoder's pull would wait for the fast step still running (async scheduling),
        # and its host with it, though the rows land in a buffer that step never reads.
        dev = torch.device(device)
        self._recv_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    def connect(self) -> None:
        """Both groups' communicators (NCCL), push first, as the peer does; raises
        ``PeerLost`` if the peer does not join in time."""
        self.push.connect()
        self.pull.connect()

    def send_rows(self, group: Group, pool: RowStore, slots: Any, dst: int) -> None:
        """Send the K/V of ``slots`` (nothing if there are none); does not wait."""
        if not len(slots):
            return
        rows = pool.read_rows(slots)
        self._sends.append((group, group.send(rows, dst), rows))
        self.stats.bytes_out += rows.numel() * rows.element_size()
        self.stats.rows_out += rows.shape[2]

    def recv_rows(self, group: Group, pool: RowStore, slots: Any, src: int,
                  write: bool = True) -> None:
        """Receive the K/V of ``slots`` and, with ``write``, store it there; raises
        ``PeerLost`` if it does not come."""
        if not len(slots):
            return
        side = self._recv_stream
        with torch.cuda.stream(side) if side is not None else nullcontext():
            rows = pool.empty_rows(len(slots))
            work = group.recv(rows, src)
        t0 = time.perf_counter()
        group.wait(work)  # (CUDA: the engine's stream is now ordered after the receive)
        self.stats.wait_s += time.perf_counter() - t0
        self.stats.bytes_in += rows.numel() * rows.element_size()
        self.stats.rows_in += rows.shape[2]
        if write:
            if side is not None:  # read on the engine's stream: not reused before that
                rows.record_stream(torch.cuda.current_stream(pool.device))
            pool.write_rows(slots, rows)

    def reap(self) -> None:
        """Forget the sends that completed; wait (up to the deadline, else ``PeerLost``) only
        for the oldest ones beyond ``MAX_SENDS`` in flight. A verifier's send completes when
        its decoder polls, so waiting for every one would hold the lane thread, and the other
        decoders' passes, up for one slow decoder."""
        t0 = time.perf_counter()
        while self._sends and (len(self._sends) > MAX_SENDS
                               or self._sends[0][1].is_completed()):
            group, work, _ = self._sends.pop(0)
            group.wait(work)  # (completed: raises if it failed)
        self.stats.wait_s += time.perf_counter() - t0

    def close(self) -> None:
        self._sends.clear()
        self.push.abort()
        self.pull.abort()


class DecoderTransfer:
    """The decoder's side of one verifier stream: what the verifier holds of each sequence,
    the rows to push before a pass, the rows to take back after it."""

    def __init__(self, store: Any, name: str, pool: RowStore, timeout_s: float) -> None:
        """``pool``: the engine's, or at TP>1 its ranks' as whole heads."""
        self.pool = pool
        self.pair = _Pair(store, name, DECODER_RANK, pool.device, timeout_s)
        # request id -> positions 0 .. n-1 the verifier holds (or will, once the passes
        # sent so far have run)
        self.held: dict[str, int] = {}

    def connect(self) -> None:
        """The groups' communicators: on the thread that issues this process's other NCCL
        work (``_Pair.connect``), announced first (``JoinSignal``)."""
        self.pair.joining.announce()
        self.pair.connect()

    @property
    def stats(self) -> TransferStats:
        return self.pair.stats

    def plan(self, lane_pass: LanePass) -> dict[int, int]:
        """``kv_from`` of each segment that reads rows the verifier does not hold."""
        kv_from = {}
        for i, s in enumerate(lane_pass.segments):
            held = self.held.get(s.request_id, 0)
            if held < s.start:
                kv_from[i] = held
            self.held[s.request_id] = s.start + len(s.input_ids)
        return kv_from

    def push(self, lane_pass: LanePass, kv_from: dict[int, int]) -> None:
        """Send the planned rows (from this pool: the lane's bits of committed positions);
        does not wait for them to arrive."""
        segs = lane_pass.segments
        slots = self.pool.slots_of((segs[i].block_table, a, segs[i].start)
                                   for i, a in sorted(kv_from.items()))
        self.pair.send_rows(self.pair.push, self.pool, slots, VERIFIER_RANK)

    def pull(self, lane_pass: LanePass, result: LaneResult, kv_rows: int,
             write: bool = True) -> None:
        """Take the pass's committed rows back into this pool (before its decisions are
        applied); ``write`` False: only off the wire (the pass was decided already, its
        blocks may be another's by now). Raises ``PeerLost`` if they do not come."""
        self.pair.reap()
        spans = committed(lane_pass, result)
        for s, end in spans:
            if s.kind == "window":  # rows past the accepted ones are the rejected candidates'
                self.held[s.request_id] = end
        slots = self.pool.slots_of((s.block_table, s.start, end) for s, end in spans)
        if len(slots) != kv_rows:
            raise PeerLost(f"pass {result.pass_id}: the verifier sends {kv_rows} rows, "
                           f"its decisions commit {len(slots)}")
        self.pair.recv_rows(self.pair.pull, self.pool, slots, VERIFIER_RANK, write=write)

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.held.pop(rid, None)

    def close(self) -> None:
        self.pair.close()


class VerifierKV:
    """A verifier's own K/V: one pool and block manager shared by all its streams.
    ``rows``: what transfers read and write, the pool itself or, at TP>1, every rank's
    pool as whole heads (``ShardedKV`` over rank 0's ``pool``)."""

    def __init__(self, pool: KVPool, rows: RowStore | None = None) -> None:
        self.pool = pool
        self.rows: RowStore = pool if rows is None else rows
        self.blocks = BlockManager(pool.data.shape[2], pool.block_size)


class VerifierTransfer:
    """The verifier's side of one decoder's stream: that decoder's sequences' blocks in the
    verifier's own pool, and the transfers around each pass."""

    def __init__(self, store: Any, name: str, kv: VerifierKV, timeout_s: float) -> None:
        self.kv = kv
        self.pair = _Pair(store, name, VERIFIER_RANK, kv.pool.data.device, timeout_s)
        self.tables: dict[str, list[int]] = {}

    def connect(self) -> None:
        """The groups' communicators: on the thread that issues this process's other NCCL
        work (``_Pair.connect``), after ``await_decoder``."""
        self.pair.connect()

    def await_decoder(self) -> None:
        """Until the decoder announced its connect (any thread; ``JoinSignal``)."""
        self.pair.joining.wait()

    @property
    def stats(self) -> TransferStats:
        return self.pair.stats

    def prepare(self, lane_pass: LanePass, kv_from: Sequence[int | None]) -> LanePass:
        """Room for the pass's rows, the pushed rows received; the pass over this
        verifier's blocks. Raises ``KVFull`` (nothing received: the stream must end) or
        ``PeerLost``."""
        pool, blocks = self.kv.rows, self.kv.blocks
        for s in lane_pass.segments:
            table = self.tables.setdefault(s.request_id, [])
            if not blocks.grow(table, s.start + len(s.input_ids)):
                raise KVFull(f"no room for {s.request_id!r} ({blocks.num_free} blocks free)")
        spans = [(self.tables[s.request_id], a, s.start)
                 for s, a in zip(lane_pass.segments, kv_from, strict=True) if a is not None]
        self.pair.recv_rows(self.pair.push, pool, pool.slots_of(spans), DECODER_RANK)
        return replace(lane_pass, segments=tuple(
            replace(s, block_table=tuple(self.tables[s.request_id])) for s in lane_pass.segments))

    def send_back(self, lane_pass: LanePass, result: LaneResult) -> int:
        """Send the committed rows of ``lane_pass`` (as ``prepare`` returned it); their
        count, for the reply."""
        self.pair.reap()
        slots = self.kv.rows.slots_of((s.block_table, s.start, end)
                                      for s, end in committed(lane_pass, result))
        self.pair.send_rows(self.pair.pull, self.kv.rows, slots, DECODER_RANK)
        return len(slots)

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            table = self.tables.pop(rid, None)
            if table:
                self.kv.blocks.free(table)

    def close(self) -> None:
        self.release(list(self.tables))
        self.pair.close()
