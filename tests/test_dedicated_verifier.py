"""A verifier that cannot map the decoder's pool (another host; on GPUs another device)
verifies through K/V transfer: its own copy of the lane K/V, rows moved over a pair of
torch.distributed groups (gloo here, between processes that share no memory and register
as different hosts), control on the gRPC stream.

DVR output must equal the in-process ``lane_only`` oracle token for token and logprob for
logprob, with the fast path perturbed; the control corrupts the rows the decoder pushes and
shows the comparison catches it. A verifier killed mid-run, two decoders on one verifier,
and a stale epoch are covered as for co-located verifiers.
"""

# ruff: noqa: F811  (the fixtures imported from test_remote_verifier are parameters here)
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, closing
from typing import Any

import grpc
import pytest
import torch
from engine_utils import Req, drive, random_prompts, signature
from test_remote_verifier import (  # noqa: F401  (fixtures used by name)
    AUTH,
    DET,
    NUM_BLOCKS,
    REQS,
    G,
    VerifierProc,
    W,
    _hello_status,
    cluster_secret,
    kill_after,
    make_engine,
    model,
    oracle,
    oracle_of,
    oracle_prefix_checker,
    redis_url,
    running_verifiers,
    unconnected,
)

from detserve.lane import LanePass
from detserve.params import SamplingParams
from services.kv_handle import HOST_ID_ENV
from services.registry import Registry
from services.verifier import codec
from services.verifier import verifier_pb2 as pb
from services.verifier import verifier_pb2_grpc as pb_grpc
from services.verifier.client import RemoteVerifier
from services.verifier.transfer import DecoderTransfer

KV_BLOCKS = 256


def transferring(n: int, model: str, redis_url: str, prefix: str, tensor_parallel_size: int = 1
                 ) -> AbstractContextManager[list[VerifierProc]]:
    """Verifier replicas each on "another host", with a pool of their own (over
    ``tensor_parallel_size`` ranks)."""
    return running_verifiers(n, model, redis_url, prefix,
                             extra=("--kv-blocks", str(KV_BLOCKS),
                                    "--tensor-parallel-size", str(tensor_parallel_size)),
                             env=lambda: {HOST_ID_ENV: f"verifier-host-{uuid.uuid4().hex[:6]}"})


@pytest.fixture(autouse=True)
def decoder_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process (the decoder) is a host of its own."""
    monkeypatch.setenv(HOST_ID_ENV, "decoder-host")


def health(address: str) -> pb.HealthReply:
    with AUTH.channel(address) as ch:
        return pb_grpc.VerifierStub(ch).Health(
            pb.HealthRequest(), timeout=5, metadata=AUTH.handshake(address).metadata)


# a deterministic prompt, then one that extends it: its first blocks come from the
# decoder's prefix cache, so their K/V must be pushed to the verifier
_BASE = random_prompts(1, [40], seed=7)[0]
PREFIX_REQS = [
    Req(_BASE, SamplingParams(max_tokens=12, is_deterministic=True, logprobs=1,
                              ignore_eos=True)),
    Req(_BASE + [5, 6, 7, 8, 9], SamplingParams(max_tokens=20, is_deterministic=True,
                                                temperature=0.9, seed=3, logprobs=1,
                                                ignore_eos=True), arrival=40),
]


@pytest.fixture(scope="module")
def prefix_oracle(model: str) -> list[tuple]:
    return oracle_of(model, PREFIX_REQS)


@pytest.fixture(scope="module")
def pool(model: str, redis_url: str) -> Iterator[tuple[str, list[VerifierProc]]]:
    prefix = f"xfer{uuid.uuid4().hex[:6]}"
    with transferring(1, model, redis_url, prefix) as procs:
        yield prefix, procs


def test_transfer_lane_equals_oracle(model: str, redis_url: str, oracle: list[tuple],
                                     prefix_oracle: list[tuple],
                                     pool: tuple[str, list[VerifierProc]],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    prefix, procs = pool
    before = health(procs[0].address)
    # the groups are formed on the search thread but connected where the engine's other
    # NCCL work is issued (NCCL forbids two threads issuing on one device's communicators)
    connected_on: list[str] = []
    plain_connect = DecoderTransfer.connect

    def connect(self: DecoderTransfer) -> None:
        connected_on.append(threading.current_thread().name)
        plain_connect(self)

    monkeypatch.setattr(DecoderTransfer, "connect", connect)
    engine, exporter = make_engine(model, redis_url, prefix, "dec-xfer")
    assert connected_on == [threading.current_thread().name]
    remote = engine.verifier
    assert isinstance(remote, RemoteVerifier) and remote.verifier is not None
    assert remote.verifier.address == procs[0].address
    assert remote.transfer_stats is not None, "another host: K/V transfer, not a mapping"
    try:
        outs = drive(engine, REQS, oracle_prefix_checker(oracle))
        stats = engine.stats()
        assert stats["perturbed_tokens"] > 0 and stats["rollbacks"] > 0
        # its lane runs elsewhere, on rows pushed in our stream order: the engine neither
        # reads its batch in flight before a pass nor gives the lane a step (the same load
        # does with a mapping verifier: test_remote_lane_equals_oracle)
        assert remote.stream_ordered and not remote.shares_device
        assert stats["lane_bound_waits"] == 0
        for i in DET:
            assert signature(outs[i]) == oracle[i], f"r{i} differs from the oracle"
        pulled = remote.transfer_stats.rows_in
        assert pulled > 0, "the lane's rows came back to the decoder"
        pushed_before = remote.transfer_stats.rows_out
        outs = drive(engine, PREFIX_REQS)
        for i, out in enumerate(outs):
            assert signature(out) == prefix_oracle[i], f"prefix request {i} differs"
        assert engine.scheduler.prefix_hit_tokens > 0, "the second prompt hit the cache"
        assert remote.transfer_stats.rows_out > pushed_before, "the cached rows were pushed"
        after = health(procs[0].address)
        assert after.kv_bytes_in > before.kv_bytes_in and after.kv_bytes_out > before.kv_bytes_out
        assert after.busy_s > before.busy_s
    finally:
        remote.close()
        exporter.close()


def test_corrupted_pushes_are_caught(model: str, redis_url: str, prefix_oracle: list[tuple],
                                     pool: tuple[str, list[VerifierProc]],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the rows the decoder pushes decide the verifier's bits. Noise
    added to them (as a transfer that lost bits would) changes the output, so the
    comparison above would catch a wrong transfer."""
    prefix, _ = pool
    real = DecoderTransfer.push

    def noisy_push(self: DecoderTransfer, lane_pass: LanePass, kv_from: dict[int, int]) -> None:
        self.pool.data.add_(torch.randn_like(self.pool.data) * 0.5)
        real(self, lane_pass, kv_from)

    engine, exporter = make_engine(model, redis_url, prefix, "dec-noisy")
    monkeypatch.setattr(DecoderTransfer, "push", noisy_push)
    try:
        outs = drive(engine, PREFIX_REQS)
        assert engine.scheduler.prefix_hit_tokens > 0
        assert outs[1].finish_reason == "length"
        assert signature(outs[1]) != prefix_oracle[1], "corrupted K/V went unnoticed"
    finally:
        engine.verifier.close()
        exporter.close()


def test_killed_verifier_mid_transfer_loses_nothing(model: str, redis_url: str,
                                                    oracle: list[tuple]) -> None:
    """Two transferring verifiers; the one in use killed while a pass (and its rows) is in
    flight: the decoder fails over, the new verifier gets each sequence's committed rows
    pushed, and every deterministic output equals the oracle."""
    prefix = f"xkill{uuid.uuid4().hex[:6]}"
    with transferring(2, model, redis_url, prefix) as procs:
        _kill_mid_transfer(model, redis_url, prefix, procs, oracle)


def _kill_mid_transfer(model: str, redis_url: str, prefix: str, procs: list[VerifierProc],
                       oracle: list[tuple]) -> None:
    by_address = {p.address: p for p in procs}
    engine, exporter = make_engine(model, redis_url, prefix, "dec-xkill",
                                   transfer_timeout_s=5.0)
    remote = engine.verifier
    assert isinstance(remote, RemoteVerifier) and remote.verifier is not None
    first = kill_after(remote, procs, 4)
    try:
        outs = drive(engine, REQS, oracle_prefix_checker(oracle))
        assert by_address[first].proc.poll() is not None
        assert remote.failovers >= 1 and remote.resent_passes >= 1
        assert remote.verifier is not None and remote.verifier.address != first
        assert all(o.finished and len(o.token_ids) == REQS[i].params.max_tokens
                   for i, o in enumerate(outs)), "a request was lost"
        for i in DET:
            assert signature(outs[i]) == oracle[i], f"r{i} differs from the oracle"
        assert remote.transfer_stats is not None and remote.transfer_stats.rows_out > 0, \
            "the new verifier was pushed the committed rows"
    finally:
        remote.close()
        exporter.close()


def test_two_decoders_share_one_verifier(model: str, redis_url: str, oracle: list[tuple],
                                         pool: tuple[str, list[VerifierProc]]) -> None:
    """N:1: two decoders verified at once by one verifier (its pool shared between them)."""
    prefix, procs = pool
    engines = [make_engine(model, redis_url, prefix, f"dec-n{i}") for i in range(2)]
    results: dict[int, list[Any]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = drive(engines[i][0], REQS, oracle_prefix_checker(oracle))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        seen = 0
        while any(t.is_alive() for t in threads):
            seen = max(seen, health(procs[0].address).streams)
            threads[0].join(0.05)
        for t in threads:
            t.join()
        assert not errors, errors
        assert seen == 2, "both decoders' streams were open on the verifier at once"
        for i in range(2):
            for j in DET:
                assert signature(results[i][j]) == oracle[j], f"decoder {i}: r{j} differs"
    finally:
        for engine, exporter in engines:
            engine.verifier.close()
            exporter.close()


def test_stale_epoch_is_refused(model: str, redis_url: str,
                                pool: tuple[str, list[VerifierProc]]) -> None:
    prefix, procs = pool
    with (unconnected(model, redis_url, prefix, "dec-xstale") as (_, remote),
          closing(Registry(redis_url, prefix)) as registry):
        # a backend this verifier's device does not use
        transfer = pb.KVTransfer(group="stale-test", backend="nccl", device="cuda:0")
        wrong = codec.encode_hello(remote.record, transfer)
        assert _hello_status(procs[0].address, wrong) == grpc.StatusCode.INVALID_ARGUMENT
        transfer.backend, transfer.device = "gloo", "cpu"
        hello = codec.encode_hello(remote.record, transfer)
        registry.next_epoch("dec-xstale")  # the decoder restarted: this epoch is stale
        assert _hello_status(procs[0].address, hello) == grpc.StatusCode.FAILED_PRECONDITION


def test_a_vanished_decoder_frees_its_blocks_and_hangs_nothing(
        model: str, redis_url: str, oracle: list[tuple],
        pool: tuple[str, list[VerifierProc]]) -> None:
    """A decoder that vanishes mid-run (its stream cut, its groups gone, no release): the
    verifier frees every block it held for it and serves the next decoder."""
    prefix, procs = pool
    engine, exporter = make_engine(model, redis_url, prefix, "dec-vanish")
    remote = engine.verifier
    assert isinstance(remote, RemoteVerifier)
    step, steps, held = engine.step, [0], [0]

    def step_then_vanish() -> list[Any]:
        steps[0] += 1
        if steps[0] == 6:  # passes in flight and K/V held: as if the process were killed
            assert remote._xfer is not None and remote._stream is not None
            held[0] = health(procs[0].address).kv_blocks_used
            remote._xfer.close()
            remote._stream.close()
            raise ConnectionAbortedError("the decoder is gone")
        return step()

    engine.step = step_then_vanish  # type: ignore[method-assign]
    try:
        with pytest.raises(ConnectionAbortedError):
            drive(engine, REQS)
        assert held[0] > 0, "the verifier held K/V of the decoder when it vanished"
    finally:
        remote._stream = remote._xfer = None
        remote.close()
        exporter.close()
    deadline = time.monotonic() + 20
    while (h := health(procs[0].address)).kv_blocks_used or h.streams:
        assert time.monotonic() < deadline, f"the verifier kept the vanished decoder's K/V: {h}"
        time.sleep(0.1)
    after, exporter2 = make_engine(model, redis_url, prefix, "dec-after")
    try:
        outs = drive(after, REQS, oracle_prefix_checker(oracle))
        for i in DET:
            assert signature(outs[i]) == oracle[i]
    finally:
        after.verifier.close()
        exporter2.close()


def test_the_verifier_connects_only_once_the_decoder_announced() -> None:
    """The verifier connects a stream's groups on its lane thread (NCCL: one thread issues
    all of a device's work), so first it waits, on the stream's own thread, for the
    decoder's announcement: a decoder lost between Ready and its connect ends that stream
    with ``PeerLost`` after the deadline instead of holding the lane."""
    from detserve.distributed import PeerLost, open_store
    from services.verifier.transfer import JoinSignal

    server = open_store("127.0.0.1", 0, server=True, timeout_s=5.0)
    client = open_store("127.0.0.1", server.port, server=False, timeout_s=5.0)
    verifier_side = JoinSignal(server, "dec/1/2/ab", timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match="did not connect"):
        verifier_side.wait()  # nobody announced: the deadline, not a hang
    assert 0.9 < time.monotonic() - t0 < 5.0
    JoinSignal(client, "dec/1/2/other", 1.0).announce()  # another stream's word
    with pytest.raises(PeerLost):
        verifier_side.wait()
    JoinSignal(client, "dec/1/2/ab", 1.0).announce()
    t0 = time.monotonic()
    verifier_side.wait()
    assert time.monotonic() - t0 < 0.5
