"""Peer-load sums of a TP group (``detserve.parallel.peer_sum``): on two CUDA devices they
give NCCL's gathered sum bit for bit, eagerly and replayed in a CUDA graph, and fall back
to NCCL beyond their buffer; on CPU (gloo) a group keeps its own collectives."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch

from detserve.distributed import new_group, open_store
from detserve.parallel.peer_sum import PEER_SUM_BYTES, PeerSum


def _member(port: int, rank: int, size: int, device: str, out: Any) -> None:
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
            dev = f"cuda:{rank}"
        else:
            dev = "cpu"
        store = open_store("127.0.0.1", port, server=False, timeout_s=30)
        group = new_group(store, "tp", rank, size, dev, timeout_s=30)
        peer = PeerSum.open(group, store, "tp", torch.bfloat16)
        if peer is None:
            out.put((rank, "none", None))
            return
        gen = torch.Generator().manual_seed(100 + rank)
        rows = []
        for n in (1, 37, 64, 512):  # decode batches and a lane pass of an 8B-sized row
            x = torch.randn(n, 4096, generator=gen).to(dev, torch.bfloat16)
            parts = [torch.empty_like(x) for _ in range(size)]
            group.wait(group.all_gather(parts, x))
            want = parts[0]
            for p in parts[1:]:
                want = want + p
            got = peer(x)
            assert got is not None
            rows.append(bool(torch.equal(got, want)))
        # replayed in a CUDA graph with new inputs, as a decode step's graph does
        x = torch.randn(64, 4096, generator=gen).to(dev, torch.bfloat16)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            peer(x)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = peer(x)
        replays = []
        for step in range(3):
            x.copy_(torch.randn(64, 4096, generator=gen).to(dev, torch.bfloat16) * (step + 1))
            graph.replay()
            parts = [torch.empty_like(x) for _ in range(size)]
            group.wait(group.all_gather(parts, x))
            want = parts[0]
            for p in parts[1:]:
                want = want + p
            assert y is not None
            replays.append(bool(torch.equal(y, want)))
        too_big = torch.zeros(PEER_SUM_BYTES // 2 + 1, dtype=torch.bfloat16, device=dev)
        out.put((rank, "ok", (rows, replays, peer(too_big) is None)))
    except Exception as e:  # reported to the test
        out.put((rank, "error", repr(e)))


def _run(size: int, device: str) -> list[tuple]:
    store = open_store("127.0.0.1", 0, server=True)
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(store.port, r, size, device, out))
             for r in range(size)]
    for p in procs:
        p.start()
    results = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, "a member failed or hung"
    return sorted(results)


def test_gloo_groups_keep_their_collectives() -> None:
    assert [kind for _, kind, _ in _run(2, "cpu")] == ["none", "none"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_peer_sum_gives_nccls_bits_eagerly_and_in_a_graph() -> None:
    for rank, kind, detail in _run(2, "cuda"):
        assert kind == "ok", (rank, kind, detail)
        rows, replays, fell_back = detail
        assert all(rows) and len(rows) == 4, rows
        assert all(replays) and len(replays) == 3, replays
        assert fell_back
