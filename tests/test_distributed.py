"""Run-time process groups (``detserve.distributed``) between separate processes over gloo:
they form, move tensors, and a peer that dies or goes silent costs a deadline, not a hang."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from detserve.distributed import PeerLost, new_group, open_store


def _member(port: int, rank: int, behaviour: str, out: mp.Queue) -> None:
    store = open_store("127.0.0.1", port, server=False, timeout_s=10)
    group = new_group(store, "pair", rank, 2, "cpu", timeout_s=2)
    x = torch.arange(6.0).reshape(2, 3) + 10 * rank
    gathered = [torch.empty(2, 3), torch.empty(2, 3)]
    group.wait(group.all_gather(gathered, x))
    out.put(("gathered", rank, [t.tolist() for t in gathered]))
    if rank == 0:
        group.wait(group.send(x, 1))
        if behaviour == "die":
            return
        if behaviour == "hang":
            time.sleep(6)  # alive, silent: past the 2 s deadline
            return
        group.wait(group.send(x * 2, 1))
    else:
        got = torch.empty(2, 3)
        group.wait(group.recv(got, 0))
        out.put(("recv", rank, got.tolist()))
        t0 = time.monotonic()
        try:
            group.wait(group.recv(got, 0))
            out.put(("recv", rank, got.tolist()))
        except PeerLost as e:
            out.put(("lost", rank, time.monotonic() - t0, str(e)))
        try:
            group.recv(got, 0)
            out.put(("used after abort", rank, None))
        except PeerLost:
            out.put(("refused after abort", rank, None))


def _run_pair(behaviour: str) -> list[tuple]:
    store = open_store("127.0.0.1", 0, server=True)
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(store.port, r, behaviour, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode is not None, "a member hung"
    results = []
    while not out.empty():
        results.append(out.get())
    return results


@pytest.mark.parametrize("behaviour", ["ok", "die", "hang"])
def test_pair_group_moves_tensors_and_a_lost_peer_costs_the_deadline(behaviour: str) -> None:
    results = _run_pair(behaviour)
    gathered = [r for r in results if r[0] == "gathered"]
    want = [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0], [13.0, 14.0, 15.0]]]
    assert len(gathered) == 2 and all(g[2] == want for g in gathered)
    recvs = [r[2] for r in results if r[0] == "recv"]
    lost = [r for r in results if r[0] == "lost"]
    if behaviour == "ok":
        assert recvs == [want[0], [[2 * v for v in row] for row in want[0]]] and not lost
        return
    assert recvs == [want[0]], "the first message arrived before the peer went away"
    assert len(lost) == 1 and lost[0][2] < 5.0, lost  # the group's 2 s deadline, not a hang
    assert ("refused after abort", 1, None) in results


def test_members_that_never_arrive_raise() -> None:
    store = open_store("127.0.0.1", 0, server=True)
    t0 = time.monotonic()
    with pytest.raises(PeerLost):
        new_group(store, "alone", 0, 2, "cpu", timeout_s=1.5)
    assert time.monotonic() - t0 < 10


def test_background_aborts_finish_before_the_interpreter_exits(tmp_path: Path) -> None:
    """An NCCL abort runs on a daemon thread (it may wait on a lost peer); the interpreter's
    exit waits for it, within a bound, instead of cutting it off inside NCCL (which ends
    the process with std::terminate)."""
    done = tmp_path / "done"
    code = ("import time\nfrom detserve.distributed import in_background\n"
            f"in_background(lambda: (time.sleep(0.5), open({str(done)!r}, 'w').close()))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert done.exists(), "the exit waited for the background abort"
    # the wait is bounded
    from detserve.distributed import in_background, join_background

    release = threading.Event()
    thread = in_background(lambda: release.wait(30))
    t0 = time.monotonic()
    join_background(timeout_s=0.2)
    assert time.monotonic() - t0 < 2.0 and thread.is_alive()
    release.set()
    thread.join(5)
