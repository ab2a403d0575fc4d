"""Process groups made at run time, and the waits that never hang on a dead peer.

torch.distributed's default group is one per process, formed once at start-up. A decoder
that talks to whichever verifier it finds, and a tensor-parallel replica whose workers can
be replaced, need groups they can make, use and drop while the process lives: each is a
backend object (gloo on CPU, NCCL on CUDA) over a ``PrefixStore`` of a shared TCP store,
never registered as the default group. Who hosts the store and how peers learn its address
(the registry in Redis, or a parent process) is the caller's business.

A two-member NCCL group also makes its point-to-point communicator when it is formed:
NCCL would otherwise make it at the pair's first send or receive, holding both hosts until
the other comes (a verifier that sends before it replies would never see the decoder come).

Every operation on a group is awaited with ``wait`` and a deadline: a peer that died or
stopped answering raises ``PeerLost`` within it, and the group is aborted (its NCCL
communicator too), never left half-used. NCCL's own watchdog is told to clean up, not to
kill the process (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``), set before the first group.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class PeerLost(RuntimeError):
    """A group operation did not complete within its deadline, or its peer is gone."""


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank was lost (died, stalled past ``tp_timeout_s``, or failed);
    the engine cannot go on (``parallel.executor`` raises it; here so that the verifiers
    can tell it apart without importing the executor)."""


# group aborts still running (``in_background``), joined for a while at exit
_BACKGROUND: list[threading.Thread] = []
EXIT_JOIN_S = 10.0


def in_background(fn: Callable[[], None]) -> threading.Thread:
    """Run ``fn`` on a daemon thread that the interpreter's exit waits for, up to
    ``EXIT_JOIN_S`` in all: a thread cut off inside NCCL when the interpreter finalizes
    ends the process with ``std::terminate`` (exit status 134) after its work is done."""
    _BACKGROUND[:] = [t for t in _BACKGROUND if t.is_alive()]
    thread = threading.Thread(target=fn, daemon=True, name="detserve-group-abort")
    _BACKGROUND.append(thread)
    thread.start()
    return thread


@atexit.register
def join_background(timeout_s: float = EXIT_JOIN_S) -> None:
    deadline = time.monotonic() + timeout_s
    for thread in list(_BACKGROUND):
        thread.join(max(0.0, deadline - time.monotonic()))


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def open_store(host: str, port: int, *, server: bool, timeout_s: float = 30.0) -> dist.TCPStore:
    """The TCP store a group's members meet in: ``server`` hosts it (``port`` 0: any free
    port, read back from ``store.port``); the others connect to ``host:port``. Any number
    of groups share one store, each under its own prefix."""
    return dist.TCPStore(host, port, is_master=server, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), use_libuv=True)


def poll(done: Callable[[], bool], timeout_s: float,
         give_up: Callable[[], bool] = lambda: False) -> bool:
    """Whether ``done()`` came true within ``timeout_s``: asked again after a pause that
    grows from microseconds to a millisecond, and abandoned at once when ``give_up()``."""
    deadline = time.monotonic() + timeout_s
    pause = 20e-6
    while not done():
        if time.monotonic() > deadline or give_up():
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return True


@dataclass
class Group:
    """One run-time process group: ``rank`` of ``size`` over ``backend``."""

    backend: str
    rank: int
    size: int
    pg: Any  # ProcessGroupGloo | ProcessGroupNCCL
    timeout_s: float
    device: torch.device

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Any:
        return self._checked(lambda: self.pg.send([tensor], dst, tag))

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Any:
        return self._checked(lambda: self.pg.recv([tensor], src, tag))

    def all_gather(self, out: list[torch.Tensor], tensor: torch.Tensor) -> Any:
        return self._checked(lambda: self.pg.allgather([out], [tensor]))

    def all_reduce(self, tensor: torch.Tensor) -> Any:
        return self._checked(lambda: self.pg.allreduce([tensor]))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """``src``'s ``tensor`` into every member's (same shape and dtype)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        return self._checked(lambda: self.pg.broadcast([tensor], opts))

    def barrier(self) -> None:
        """Every member got here (a small all-reduce: the same on either backend)."""
        one = torch.ones(1, device=self.device)
        self.wait(self.all_reduce(one))
        if int(one.item()) != self.size:
            raise PeerLost(f"barrier counted {one.item()} of {self.size}")

    def wait(self, work: Any, timeout_s: float | None = None) -> None:
        """Until ``work`` completed (CUDA: its stream is ordered after it), or raise
        ``PeerLost`` and abort the group once ``timeout_s`` (default: the group's) passed."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        if self.backend == "gloo":
            try:
                work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
                return
            except RuntimeError as e:
                self.abort()
                raise PeerLost(str(e)) from e
        # NCCL: poll, so that a lost peer costs the deadline, not the watchdog's timeout
        if not poll(work.is_completed, deadline - time.monotonic()):
            self.abort()
            raise PeerLost(f"no completion within {self.timeout_s} s")
        try:
            work.wait()
        except RuntimeError as e:
            self.abort()
            raise PeerLost(str(e)) from e

    def follow(self, work: Any) -> None:
        """Order what comes next after ``work``. gloo: the host waits for it (``wait``).
        NCCL: the current stream waits and the host does not (a step must not stop at
        every layer); a lost peer then shows where the host next waits for the stream with
        the group's deadline (a TP step's read-back)."""
        if self.backend == "nccl":
            work.wait()
        else:
            self.wait(work)

    def connect(self) -> None:
        """NCCL: make the communicator now (and a pair's point-to-point one), not inside a
        step or a lane pass; every member calls it, in the same order of groups. gloo
        connected when the group was made."""
        if self.backend == "nccl":
            self.barrier()
            if self.size == 2:
                self._warm_p2p()

    def _warm_p2p(self) -> None:
        """NCCL makes a pair's point-to-point communicator at the pair's first send/recv,
        blocking both hosts until both are there. A sender that waits there before telling
        its peer (over another channel) to receive would wait for ever: make it now."""
        one = torch.zeros(1, device=self.device)
        work = self.send(one, 1) if self.rank == 0 else self.recv(one, 0)
        self.wait(work)

    def abort(self) -> None:
        """Drop the group (its communicator, for NCCL); later operations fail at once.
        NCCL's abort can wait up to a minute on a peer that has gone, so it finishes in
        the background."""
        pg, self.pg = self.pg, None
        if pg is None:
            return

        def drop() -> None:
            try:
                pg.abort()
            except (RuntimeError, AttributeError):
                pass

        if self.backend == "nccl":
            in_background(drop)
        else:
            drop()

    @property
    def alive(self) -> bool:
        return self.pg is not None

    def _checked(self, op: Any) -> Any:
        if self.pg is None:
            raise PeerLost("the group was aborted")
        try:
            return op()
        except RuntimeError as e:
            self.abort()
            raise PeerLost(str(e)) from e


def new_group(store: dist.Store, name: str, rank: int, size: int, device: torch.device | str,
              timeout_s: float = 30.0, connect: bool = True) -> Group:
    """Join group ``name`` (its members all call this with the same name, size and store);
    returns once all of them have. NCCL makes its communicator here too (``Group.connect``)
    unless ``connect`` is False: NCCL forbids issuing operations on communicators of one
    device from several threads at once, so a process whose NCCL work runs on one thread
    has that thread connect a group formed elsewhere.

    Raises ``PeerLost`` if the members do not all arrive within ``timeout_s``."""
    device = torch.device(device)
    backend = backend_for(device)
    prefixed = dist.PrefixStore(f"detserve/{name}/", store)
    timeout = timedelta(seconds=timeout_s)
    try:
        if backend == "gloo":
            pg: Any = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        else:
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # clean up, live on
            opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
            # the watchdog's own timeout is twice the group's deadline, so that a host
            # waiting with that deadline (``wait``, a TP step's read-back) sees a stalled
            # peer first, before the watchdog ends the kernels with whatever they hold
            opts._timeout = 2 * timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    except RuntimeError as e:
        raise PeerLost(f"group {name!r}: {e}") from e
    group = Group(backend, rank, size, pg, timeout_s, device)
    if connect:
        group.connect()
    return group
