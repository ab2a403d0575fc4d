"""The engine at TP=N: rank 0 (the engine's process) owns the scheduler and drives N-1
worker processes (``worker.py``), one per rank: over gloo on CPU; on CUDA over NCCL, rank r
on the device ``r`` places after rank 0's (``rank_device``).

Control and data take separate ways. Each step's inputs (the runner's batch description,
or a lane pass) go to every worker through its pipe before rank 0 runs the step itself;
every rank then runs the same ``ModelRunner`` call on its shard, and the collectives inside
the forward (``shard.TensorParallel``) go over one run-time group (``detserve.distributed``)
made with the ``tp_timeout_s`` deadline. The workers sample too (the gathered logits are
the same on every rank) but never read a step back: their hosts run ahead of their
devices as rank 0's does. A step fed tokens that rank 0 has not read
back (asynchronous scheduling) gets them by a broadcast in stream order, and CUDA graphs
are captured on every rank at once (``EnableGraphs``): the captures hold the collectives.
Lane passes meet in a group of their own (``lane_group``), in the order rank 0 sent them:
on CUDA in every rank's steps' thread (two threads driving NCCL stalled the ranks), on CPU
on lane threads (``worker.LaneThread``; rank 0's verifier thread with ``lane_threaded``),
so that there the lane does not stop the fast path.

A worker that dies or stalls makes rank 0's next collective raise ``PeerLost`` within the
deadline; the step then raises ``TensorParallelError`` and the engine is done (its group is
aborted). A worker whose rank 0 is gone sees its pipe close, or its collective fail, and
exits.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar, cast

import torch

from detserve.config import EngineConfig
from detserve.distributed import (
    Group,
    PeerLost,
    TensorParallelError,
    new_group,
    open_store,
    poll,
)
from detserve.executor.attention import RowSegment
from detserve.executor.gemm_classes import Alignment
from detserve.executor.kv_pool import KVPool
from detserve.executor.runner import (
    Feed,
    LaneLaunch,
    LaunchedBatch,
    ModelRunner,
    PenaltyRow,
    PromptRows,
)
from detserve.lane import LanePass
from detserve.model.llama import LlamaModel
from detserve.model.loader import read_model_config, resolve_dtype
from detserve.numerics import LaneNumerics
from detserve.parallel.layout import TPLayout
from detserve.parallel.messages import (
    STARTUP_TIMEOUT_S,
    BatchStep,
    EnableGraphs,
    FeedRows,
    LaneStep,
    Message,
    ReadKV,
    Start,
    Stop,
    WorkerSpec,
    WriteKV,
)
from detserve.parallel.peer_sum import PeerSum, open_peer_sums
from detserve.parallel.shard import TensorParallel, shard_model
from detserve.parallel.worker import worker_main
from detserve.sampler import SamplingSpec

T = TypeVar("T")


class TPRunner(ModelRunner):
    """Rank 0's runner: each forward is first sent to the workers, then run here."""

    def __init__(self, model: LlamaModel, pool: KVPool, numerics: LaneNumerics,
                 workers: Workers, alignment: Alignment | None = None) -> None:
        super().__init__(model, pool, numerics, alignment)
        self.workers = workers

    def launch_batch(self, segments: list[RowSegment], sample_specs: list[SamplingSpec | None],
                     batch_invariant: bool = False, align_decode: bool = True,
                     feed: Feed | None = None,
                     penalties: Sequence[PenaltyRow | None] = (),
                     prompt_rows: Sequence[PromptRows | None] = ()) -> LaunchedBatch:
        rows = None if feed is None else FeedRows(
            tuple(feed[0].shape), str(feed[0].dtype).removeprefix("torch."), feed[1])
        step = BatchStep(segments, sample_specs, batch_invariant, align_decode, rows,
                         penalties, prompt_rows)

        def launch() -> LaunchedBatch:
            if feed is not None:
                self.workers.share(feed[0])
            launched = super(TPRunner, self).launch_batch(
                segments, sample_specs, batch_invariant, align_decode, feed, penalties,
                prompt_rows)
            launched.before_read = self.workers.settler(self.cuda)
            return launched

        return self.workers.run(step, launch)

    def launch_lane(self, lane_pass: LanePass) -> LaneLaunch:
        parallel = cast(TensorParallel, self.model.parallel)

        def launch() -> LaneLaunch:
            with parallel.on(self.workers.lane_group):
                launched = super(TPRunner, self).launch_lane(lane_pass)
            launched.before_read = self.workers.settler(self.cuda)
            return launched

        return self.workers.run(LaneStep(lane_pass), launch)

    def enable_cuda_graphs(self, decode: str | None, lane: bool, max_batch: int,
                           max_blocks: int, step_rows: int = 0, plain: bool = False) -> None:
        self.workers.run(EnableGraphs(decode, lane, max_batch, max_blocks, step_rows, plain),
                         lambda: super(TPRunner, self).enable_cuda_graphs(
                             decode, lane, max_batch, max_blocks, step_rows, plain))


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device when rank 0 is on ``device``: CPU for all, else the CUDA
    device ``rank`` places after rank 0's."""
    d = torch.device(device)
    if d.type != "cuda":
        return str(d)
    return f"cuda:{(d.index or 0) + rank}"


class Workers:
    """Ranks 1..N-1: their processes and pipes, and rank 0's end of the group."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.tensor_parallel_size
        self.size = size
        self.timeout_s = config.tp_timeout_s
        first = torch.device(config.device)
        if first.type == "cuda" and (first.index or 0) + size > torch.cuda.device_count():
            raise TensorParallelError(
                f"tensor_parallel_size {size} on {config.device} needs CUDA devices up to "
                f"{rank_device(config.device, size - 1)}; {torch.cuda.device_count()} visible")
        self.store = open_store("127.0.0.1", 0, server=True, timeout_s=STARTUP_TIMEOUT_S)
        name = f"tp-{uuid.uuid4().hex[:12]}"
        ctx = multiprocessing.get_context("spawn")
        self.procs: list[Any] = []
        self.pipes: list[multiprocessing.connection.Connection] = []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            spec = WorkerSpec(config, rank, rank_device(config.device, rank), "127.0.0.1",
                              self.store.port, name, torch.get_num_threads())
            proc = ctx.Process(target=worker_main, args=(theirs, spec), daemon=True,
                               name=f"detserve-tp{rank}")
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.pipes.append(ours)
        self.failed: str | None = None
        self._sending = threading.Lock()  # the engine's and the lane's threads both send
        self.group, self.lane_group, self.peer_sums = self._join(name, config)

    def _join(self, name: str, config: EngineConfig) -> tuple[Group, Group, list[PeerSum]]:
        """Rank 0's end of the groups (the steps', then the lane's: the workers make them in
        that order). Once every worker has said it is joining (its imports done), the groups
        are made with the steps' deadline, which gloo applies to every operation, with
        their peer-load sums (CUDA); in a thread, while the workers are watched: one that
        exits fails the start at once."""
        for rank, pipe in enumerate(self.pipes, start=1):
            if self._receive(rank, pipe) != "joining":
                raise AssertionError("unreachable: _receive raises on anything else")
        joined: list[tuple[Group, Group, list[PeerSum]] | BaseException] = []
        device = rank_device(config.device, 0)  # ("cuda" names no index: cuda:0, as the ranks')

        def join() -> tuple[Group, Group, list[PeerSum]]:
            # a new thread's current device is the first one: rank 0 may be another (a TP
            # verifier on cuda:2), and NCCL and the peer sums' memory go to the current one
            if torch.device(device).type == "cuda":
                torch.cuda.set_device(device)
            group = new_group(self.store, name, 0, self.size, device, timeout_s=self.timeout_s)
            lane = new_group(self.store, f"{name}/lane", 0, self.size, device,
                             timeout_s=self.timeout_s)
            sums = open_peer_sums(self.store, {name: group, f"{name}/lane": lane},
                                  resolve_dtype(config.dtype)) if config.tp_peer_sums else []
            return group, lane, sums

        thread = threading.Thread(target=lambda: joined.append(_try(join)), daemon=True,
                                  name="detserve-tp-join")
        thread.start()
        while thread.is_alive() and all(p.is_alive() for p in self.procs):
            thread.join(timeout=0.1)
        thread.join(timeout=1.0)
        result = joined[0] if joined else None
        if isinstance(result, tuple):
            return result
        errors = self._worker_errors()
        self.close()
        raise TensorParallelError(f"TP workers did not join: {result or 'a worker exited'}"
                                  f"{errors}")

    def start(self, numerics: LaneNumerics, alignment: Alignment | None) -> None:
        """Send the resolved numerics and wait until every worker has built its runner."""
        self._send(Start(numerics, alignment))
        for rank, pipe in enumerate(self.pipes, start=1):
            self._receive(rank, pipe, "ready")

    def _receive(self, rank: int, pipe: multiprocessing.connection.Connection,
                 expected: str = "joining") -> str:
        """A worker's startup reply ``expected``, within ``STARTUP_TIMEOUT_S``; else the
        workers are stopped and ``TensorParallelError`` says why."""
        reply = "no reply"
        try:
            if pipe.poll(STARTUP_TIMEOUT_S):
                reply = pipe.recv()
        except (EOFError, OSError):
            reply = "exited"
        if reply != expected:
            self.close()
            raise TensorParallelError(f"TP worker {rank} failed to start: {reply}")
        return reply

    def share(self, tensor: torch.Tensor) -> None:
        """Broadcast rank 0's ``tensor`` to the workers (each is receiving one in order)."""
        self.group.follow(self.group.broadcast(tensor.contiguous(), 0))

    def settler(self, cuda: bool) -> Callable[[], None] | None:
        """On CUDA, what a step's results wait for before the host reads them: the step's
        kernels (collectives included) done within ``tp_timeout_s`` and every worker alive.
        A stalled peer holds the collectives past the deadline, and a dead one may let the
        communicator's watchdog end them early with partial sums: either way the step
        raises ``TensorParallelError`` and nothing it computed is read. (gloo's collectives
        already raise within the deadline on the host.)"""
        if not cuda:
            return None
        done = torch.cuda.Event()
        done.record()
        return lambda: self._settle(done)

    def _settle(self, done: torch.cuda.Event) -> None:
        alive = self._all_alive
        if poll(done.query, self.timeout_s, give_up=lambda: not alive()) and alive():
            return
        self._fail("a worker exited" if not alive()
                   else f"the step did not finish within {self.timeout_s} s")

    def _all_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def _fail(self, why: str, cause: BaseException | None = None) -> NoReturn:
        self.failed = why
        self._abort_groups()
        raise TensorParallelError(
            f"a TP rank was lost mid-step ({why}){self._worker_errors()}") from cause

    def check(self) -> None:
        """Raise ``TensorParallelError`` if a rank was lost before."""
        if self.failed is not None:
            raise TensorParallelError(f"tensor parallelism already failed: {self.failed}")

    def run(self, message: BatchStep | LaneStep | EnableGraphs | WriteKV | ReadKV,
            call: Callable[[], T]) -> T:
        """Send ``message`` to every worker, then run ``call`` (rank 0's same step)."""
        self.check()
        try:
            self._send(message)
            return call()
        except (PeerLost, OSError) as e:
            self._fail(f"{type(e).__name__}: {e}", e)

    def close(self) -> None:
        """Stop the workers (politely, then by force) and drop the group."""
        for pipe in self.pipes:
            try:
                pipe.send(Stop())
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2.0)
        for pipe in self.pipes:
            pipe.close()
        self.pipes, self.procs = [], []
        self._abort_groups()

    def _abort_groups(self) -> None:
        for group in (getattr(self, "group", None), getattr(self, "lane_group", None)):
            if group is not None and group.alive:
                group.abort()

    def _send(self, message: Message) -> None:
        with self._sending:  # one message whole on each pipe, in one order on all
            for pipe in self.pipes:
                pipe.send(message)

    def _worker_errors(self) -> str:
        """What the workers said before they went (their last error, or exit codes)."""
        notes = []
        for rank, (proc, pipe) in enumerate(zip(self.procs, self.pipes, strict=True), start=1):
            try:
                while pipe.poll(0):
                    msg = pipe.recv()
                    if isinstance(msg, str) and msg != "ready":
                        notes.append(f"worker {rank}: {msg}")
            except (EOFError, OSError):
                pass
            if not proc.is_alive():
                notes.append(f"worker {rank} exited ({proc.exitcode})")
        return "; " + "; ".join(notes) if notes else ""


def _try(fn: Callable[[], T]) -> T | BaseException:
    try:
        return fn()
    except BaseException as e:  # handed to the thread that waits for it
        return e


def tensor_parallel_model(config: EngineConfig, model: LlamaModel
                          ) -> tuple[LlamaModel, Workers | None]:
    """Rank 0's model for ``config``: ``model`` itself at TP=1 without the invariant lane;
    with it, ``model`` with the tree attached; at TP=N rank 0's shard (``model`` is the
    whole model or, loaded with ``shard.rank_weights``, already the shard), with the
    workers started (each loads only its own shard)."""
    size = config.tensor_parallel_size
    if size == 1 and not config.tp_invariant_lane:
        return model, None
    workers = Workers(config) if size > 1 else None
    try:
        # (``model`` may be the shard: the layout is the whole model's)
        whole = model.config if size == 1 else read_model_config(config.model)
        layout = TPLayout(whole, size, 0)
        local = shard_model(model, layout, workers.group if workers else None,
                            tree=config.tp_invariant_lane,
                            peer_sums=workers.peer_sums if workers else ())
    except BaseException:
        if workers is not None:
            workers.close()
        raise
    return local, workers


def make_runner(model: LlamaModel, pool: KVPool, numerics: LaneNumerics,
                alignment: Alignment | None, workers: Workers | None) -> ModelRunner:
    """Rank 0's runner: the plain one, or one that drives the workers (started here, with
    rank 0's numerics and alignment)."""
    if workers is None:
        return ModelRunner(model, pool, numerics, alignment)
    workers.start(numerics, alignment)
    return TPRunner(model, pool, numerics, workers, alignment)
