"""A tensor-parallel worker process (rank >= 1): loads its shard of the checkpoint, builds
its runner and KV pool (its own K/V heads only), then runs whatever rank 0 sends, in order,
until told to stop or until rank 0 is gone (``executor`` describes the protocol): steps on
its main thread, lane passes in the lane's group (``LaneThread``)."""

from __future__ import annotations

import multiprocessing.connection
import queue
import threading
import traceback
from typing import Any, cast

import torch

from detserve.distributed import Group, PeerLost, new_group, open_store
from detserve.executor.kv_pool import KVPool
from detserve.executor.runner import ModelRunner
from detserve.model.loader import load_model, resolve_dtype
from detserve.parallel.messages import (
    STARTUP_TIMEOUT_S,
    BatchStep,
    EnableGraphs,
    LaneStep,
    ReadKV,
    Start,
    Stop,
    WorkerSpec,
    WriteKV,
)
from detserve.parallel.peer_sum import open_peer_sums
from detserve.parallel.shard import TensorParallel, rank_weights, shard_model


def worker_main(pipe: multiprocessing.connection.Connection, spec: WorkerSpec) -> None:
    torch.set_num_threads(spec.threads)
    c, device = spec.config, spec.device
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        store = open_store(spec.host, spec.port, server=False, timeout_s=STARTUP_TIMEOUT_S)
        pipe.send("joining")
        # (gloo applies the group's timeout to every operation: the steps' deadline)
        group = new_group(store, spec.group, spec.rank, c.tensor_parallel_size, device,
                          timeout_s=c.tp_timeout_s)
        lane_group = new_group(store, f"{spec.group}/lane", spec.rank, c.tensor_parallel_size,
                               device, timeout_s=c.tp_timeout_s)
        sums = open_peer_sums(store, {spec.group: group, f"{spec.group}/lane": lane_group},
                              resolve_dtype(c.dtype)) if c.tp_peer_sums else []
        rank = rank_weights(c.model, c.tensor_parallel_size, spec.rank)
        assert rank is not None  # (a worker exists only at TP > 1)
        mine, _, _ = load_model(c.model, dtype=c.dtype, device=device, shard=rank)
        model = shard_model(mine, rank.layout, group, tree=c.tp_invariant_lane,
                            peer_sums=sums)
        mc, cc = model.config, c.cache
        pool = KVPool(mc.num_layers, cc.num_blocks, cc.block_size, mc.num_kv_heads,
                      mc.head_dim, model.dtype, device)
        start = pipe.recv()
        if not isinstance(start, Start):
            raise RuntimeError(f"expected Start, got {type(start).__name__}")
        runner = ModelRunner(model, pool, start.numerics, start.alignment)
        pipe.send("ready")
    except (EOFError, PeerLost):
        return
    except Exception:  # reported to rank 0, which fails the engine's start
        _report(pipe, traceback.format_exc())
        return
    lanes = LaneThread(runner, lane_group, pipe, group)
    try:
        serve(pipe, runner, group, lanes)
    finally:
        lanes.stop()


class LaneThread:
    """This rank's lane passes, in the order rank 0 sent them, in the lane's group. On CUDA
    they run in the steps' thread and stream, as rank 0's do (two threads driving NCCL
    stalled the ranks: docs/tensor-parallel.md); on CPU on a thread of their own, so that
    the lane does not stop the fast path (gloo's collectives of the two groups are
    independent). A failed pass on the thread is reported and ends both groups, so that
    rank 0's next collective fails within its deadline."""

    def __init__(self, runner: ModelRunner, group: Group,
                 pipe: multiprocessing.connection.Connection, step_group: Group) -> None:
        self.runner, self.group, self.step_group = runner, group, step_group
        self.parallel = cast(TensorParallel, runner.model.parallel)
        self.pipe = pipe
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        if not runner.cuda:
            self._thread = threading.Thread(target=self._work, name="detserve-tp-lane",
                                            daemon=True)
            self._thread.start()

    def submit(self, lane_pass: Any) -> None:
        if self._thread is None:
            self._launch(lane_pass)
        else:
            self._jobs.put(lane_pass)

    def _launch(self, lane_pass: Any) -> None:
        with self.parallel.on(self.group):
            self.runner.launch_lane(lane_pass)  # never read back, as steps

    def _work(self) -> None:
        while (lane_pass := self._jobs.get()) is not None:
            try:
                self._launch(lane_pass)
            except PeerLost:
                break
            except Exception:
                _report(self.pipe, traceback.format_exc())
                break
        for g in (self.group, self.step_group):
            if g.alive and lane_pass is not None:
                g.abort()

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=5.0)


def serve(pipe: multiprocessing.connection.Connection, runner: ModelRunner,
          group: Group, lanes: LaneThread) -> None:
    """Run rank 0's steps in order (lane passes on ``lanes``); return when told to stop or
    when rank 0 is gone."""
    # this rank's heads of a whole-head K/V row (made once: an upload from pageable memory
    # would wait for the steps queued before it)
    kv_index = torch.tensor(lanes.parallel.layout.kv_heads, dtype=torch.long,
                            device=runner.device)
    while True:
        try:
            msg = pipe.recv()
        except (EOFError, OSError):
            return
        try:
            if isinstance(msg, BatchStep):
                feed = None
                if msg.feed is not None:  # rank 0's tokens, broadcast in stream order
                    fed = torch.empty(msg.feed.shape, dtype=getattr(torch, msg.feed.dtype),
                                      device=runner.device)
                    group.follow(group.broadcast(fed, 0))
                    feed = (fed, msg.feed.pairs)
                # queued, never read back: rank 0 reads the (identical) results and feeds
                # the next step's tokens by broadcast, so this host prepares the next step
                # while the device runs this one, as rank 0's does
                runner.launch_batch(msg.segments, msg.sample_specs, msg.batch_invariant,
                                    msg.align_decode, feed, msg.penalties, msg.prompt_rows)
            elif isinstance(msg, LaneStep):
                lanes.submit(msg.lane_pass)
            elif isinstance(msg, EnableGraphs):
                runner.enable_cuda_graphs(msg.decode, msg.lane, msg.max_batch, msg.max_blocks,
                                          msg.step_rows, msg.plain)
            elif isinstance(msg, WriteKV | ReadKV):
                move_kv(runner.pool, group, msg, kv_index)
            elif isinstance(msg, Stop):
                return
            else:
                raise RuntimeError(f"unknown message {type(msg).__name__}")
        except PeerLost:
            return
        except Exception:
            _report(pipe, traceback.format_exc())
            return


def move_kv(pool: KVPool, group: Group, msg: WriteKV | ReadKV, kv_index: torch.Tensor) -> None:
    """This rank's part of a K/V transfer (``parallel.kv_rows``), in step order: store its
    heads (``kv_index`` of the whole model's) of the whole-head rows rank 0 broadcasts, or
    join the all-gather with its own."""
    slots = pool.slots_of(msg.spans)
    if isinstance(msg, WriteKV):
        rows = pool.empty_rows(len(slots), msg.kv_heads)
        group.follow(group.broadcast(rows, 0))
        pool.write_rows(slots, rows.index_select(3, kv_index))
    else:
        gather_heads(pool, group, slots, msg.width)


def gather_heads(pool: KVPool, group: Group, slots: torch.Tensor, width: int
                 ) -> list[torch.Tensor]:
    """Every rank's K/V rows at ``slots`` (each rank's own), in rank order: an all-gather
    of this rank's heads with zero heads appended up to ``width`` (ranks may hold
    different counts)."""
    rows = pool.read_rows(slots)
    extra = width - rows.shape[3]
    if extra:
        rows = torch.cat([rows, rows.new_zeros((*rows.shape[:3], extra, rows.shape[4]))],
                         dim=3)
    parts = [torch.empty_like(rows) for _ in range(group.size)]
    group.follow(group.all_gather(parts, rows.contiguous()))
    return parts


def _report(pipe: multiprocessing.connection.Connection, text: str) -> None:
    try:
        pipe.send(text[-4000:])
    except OSError:
        pass
