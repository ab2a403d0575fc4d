"""A tensor-parallel decoder verified by a dedicated verifier replica (issue 36): the
decoder at TP=2 (gloo, rank 0 in this process and a spawned worker), the verifier a
TP=1 replica on "another host" with a pool of its own, K/V moved over gloo between them
(``detserve/parallel/kv_rows.py`` reads and writes whole heads over every rank).

With ``tp_invariant_lane`` the lane's bits do not depend on the TP size, so DVR with a
perturbed fast path must give the TP=1 ``lane_only`` oracle's tokens and logprobs bit for
bit, pulled rows written into both ranks' shards, and pushed rows (a prefix-cache hit)
gathered from both. Shapes: Llama-like heads (2 K/V heads, one a rank) and SmolLM2-like
ones (3 K/V heads: 4 and 5 a rank, replicated, of unequal counts). Negative controls:
without the invariant lane the engine and the verifier refuse, naming it.
"""

# ruff: noqa: F811  (the fixtures imported from the other test modules are parameters here)
from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import closing
from functools import partial
from typing import Any

import grpc
import pytest
import torch
from engine_utils import drive, run_engine, signature, tiny_model
from test_dedicated_verifier import PREFIX_REQS, decoder_host, transferring  # noqa: F401
from test_remote_verifier import (  # noqa: F401  (fixtures used by name)
    AUTH,
    DET,
    NUM_BLOCKS,
    REQS,
    G,
    VerifierProc,
    W,
    cluster_secret,
    kill_after,
    make_engine,
    oracle_prefix_checker,
    redis_url,
)
from test_tensor_parallel import SMOLLM2_HEADS

from detserve.parallel.kv_rows import ShardedKV, Slots
from services.registry import Registry
from services.verifier import codec
from services.verifier import verifier_pb2 as pb
from services.verifier import verifier_pb2_grpc as pb_grpc
from services.verifier.client import RemoteVerifier

TP2 = {"tensor_parallel_size": 2, "tp_invariant_lane": True}
SHAPES = {"llama": {}, "smollm2-heads": SMOLLM2_HEADS}


def lane_only(model: str, reqs: list) -> list[tuple]:
    """The TP=1 invariant lane's outputs: what DVR at any TP size must give."""
    outs, _, _ = run_engine(model, reqs, mode="lane_only", window=W, group=G,
                            num_blocks=NUM_BLOCKS, tp_invariant_lane=True)
    return [signature(o) for o in outs]


def shaped_verifier(shape: str, redis_url: str, tensor_parallel_size: int = 1
                    ) -> Iterator[tuple[str, str, list[VerifierProc]]]:
    """A tiny model of ``shape``, and one transferring verifier replica of it."""
    model = tiny_model(**SHAPES[shape])
    prefix = f"tpx{uuid.uuid4().hex[:6]}"
    with transferring(1, model, redis_url, prefix, tensor_parallel_size) as procs:
        yield model, prefix, procs


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped(request: pytest.FixtureRequest, redis_url: str
           ) -> Iterator[tuple[str, str, list[VerifierProc]]]:
    yield from shaped_verifier(request.param, redis_url)


def test_tp2_decoder_with_a_dedicated_verifier_equals_the_tp1_oracle(
        shaped: tuple[str, str, list[VerifierProc]], redis_url: str) -> None:
    model, prefix, procs = shaped
    check_against_the_tp1_oracle(model, redis_url, prefix, procs[0].address, TP2,
                                 then=partial(_refusals, procs[0].address))


def check_against_the_tp1_oracle(model: str, redis_url: str, prefix: str, address: str,
                                 engine_kw: Mapping[str, Any],
                                 then: Callable[[RemoteVerifier], None] | None = None) -> None:
    """A decoder of ``engine_kw`` (the invariant lane), verified by the transferring
    verifier at ``address`` with its fast path perturbed, gives the TP=1 ``lane_only``
    oracle's bits, rows pulled back and (a prefix-cache hit) pushed; ``then(remote)`` runs
    before it closes."""
    oracle, prefix_oracle = lane_only(model, REQS), lane_only(model, PREFIX_REQS)
    engine, exporter = make_engine(model, redis_url, prefix, f"dec-{uuid.uuid4().hex[:6]}",
                                   engine_kw=dict(engine_kw))
    remote = engine.verifier
    try:
        assert isinstance(remote, RemoteVerifier) and remote.verifier is not None
        assert remote.verifier.address == address
        assert remote.transfer_stats is not None, "the K/V moves by transfer, never mapped"
        outs = drive(engine, REQS, oracle_prefix_checker(oracle))
        stats = engine.stats()
        assert stats["perturbed_tokens"] > 0 and stats["rollbacks"] > 0
        for i in DET:
            assert signature(outs[i]) == oracle[i], f"r{i} differs from the TP=1 oracle"
        assert remote.transfer_stats.rows_in > 0, "the lane's rows came back"
        pushed = remote.transfer_stats.rows_out
        outs = drive(engine, PREFIX_REQS)
        assert engine.scheduler.prefix_hit_tokens > 0, "the second prompt hit the cache"
        assert remote.transfer_stats.rows_out > pushed, "the cached rows were pushed"
        for i, out in enumerate(outs):
            assert signature(out) == prefix_oracle[i], f"prefix request {i} differs"
        if then is not None:
            then(remote)
    finally:
        engine.close()
        exporter.close()


def test_a_wrong_gather_is_caught(shaped: tuple[str, str, list[VerifierProc]], redis_url: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the heads gathered from the worker decide the pushed rows. Noise
    on the heads only the worker holds (as a gather that took the wrong rank's) changes
    the output, so the comparison above would catch a wrong assembly."""
    model, prefix, _ = shaped
    prefix_oracle = lane_only(model, PREFIX_REQS)
    real = ShardedKV.read_rows

    def noisy_read(self: ShardedKV, slots: Slots) -> torch.Tensor:
        rows = real(self, slots)
        theirs = sorted(set(range(self.kv_heads)) - {int(h) for h in self._mine})
        rows[:, :, :, theirs] += torch.randn_like(rows[:, :, :, theirs])
        return rows

    monkeypatch.setattr(ShardedKV, "read_rows", noisy_read)
    assert_prefix_output_changes(model, redis_url, prefix, TP2, prefix_oracle,
                                 "a wrong gather went unnoticed")


def assert_prefix_output_changes(model: str, redis_url: str, prefix: str,
                                 engine_kw: Mapping[str, Any], prefix_oracle: list[tuple],
                                 why: str) -> None:
    """A decoder of ``engine_kw`` runs ``PREFIX_REQS`` (the second pushes the first's
    cached K/V): the second must differ from the oracle (the control's fault mattered)."""
    engine, exporter = make_engine(model, redis_url, prefix, f"dec-n-{uuid.uuid4().hex[:6]}",
                                   engine_kw=dict(engine_kw))
    try:
        outs = drive(engine, PREFIX_REQS)
        assert engine.scheduler.prefix_hit_tokens > 0
        assert outs[1].finish_reason == "length"
        assert signature(outs[1]) != prefix_oracle[1], why
    finally:
        engine.close()
        exporter.close()


def test_killed_verifier_pushes_the_prefix_from_both_ranks(redis_url: str) -> None:
    """Two transferring verifiers; the one in use killed mid-run: the TP decoder fails
    over and pushes every sequence's committed prefix to the new one, gathered from both
    ranks, and every deterministic output still equals the TP=1 oracle."""
    model = tiny_model()
    oracle = lane_only(model, REQS)
    prefix = f"tpkill{uuid.uuid4().hex[:6]}"
    with transferring(2, model, redis_url, prefix) as procs:
        engine, exporter = make_engine(model, redis_url, prefix, "dec-tp-kill",
                                       engine_kw=TP2, transfer_timeout_s=5.0)
        remote = engine.verifier
        assert isinstance(remote, RemoteVerifier) and remote.verifier is not None
        first = kill_after(remote, procs, 4)
        try:
            outs = drive(engine, REQS, oracle_prefix_checker(oracle))
            assert remote.failovers >= 1 and remote.verifier.address != first
            for i in DET:
                assert signature(outs[i]) == oracle[i], f"r{i} differs from the TP=1 oracle"
            assert remote.transfer_stats is not None and remote.transfer_stats.rows_out > 0, \
                "the new verifier was pushed the committed rows"
        finally:
            engine.close()
            exporter.close()


def _refusals(address: str, remote: RemoteVerifier, mapped_words: str = "cannot be mapped"
              ) -> None:
    """The verifier's own checks of a TP decoder's hello, or of any hello to a TP
    verifier (the engine refuses first): not mapped (the refusal says ``mapped_words``),
    and not without the invariant lane."""
    mapped = codec.encode_hello(remote.record)  # no transfer asked: a mapping
    code, details = _hello(address, mapped)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and mapped_words in details
    plain = pb.LaneRequest()
    plain.CopyFrom(codec.encode_hello(remote.record, pb.KVTransfer(
        group=f"never-{uuid.uuid4().hex[:6]}", backend="gloo", device="cpu")))
    plain.hello.numerics.tp_invariant_lane = False
    code, details = _hello(address, plain)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tp_invariant_lane" in details


def _hello(address: str, hello: pb.LaneRequest) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as ch:
        replies = pb_grpc.VerifierStub(ch).Verify(
            iter([hello]), timeout=10, metadata=AUTH.handshake(address).metadata)
        try:
            first = next(replies)
        except grpc.RpcError as e:
            return e.code(), e.details()  # type: ignore[attr-defined]
        return grpc.StatusCode.OK, first.WhichOneof("kind")


def test_tp2_decoder_without_the_invariant_lane_is_refused(redis_url: str) -> None:
    """Negative control: a TP=1 verifier cannot reproduce the ordinary lane's TP=2 bits;
    the engine refuses the verifier at once (no worker spawned, nothing waits)."""
    model = tiny_model()
    prefix = f"tpno{uuid.uuid4().hex[:6]}"
    with pytest.raises(ValueError, match="only with tp_invariant_lane"):
        make_engine(model, redis_url, prefix, "dec-tp-plain",
                    engine_kw={"tensor_parallel_size": 2})
    with closing(Registry(redis_url, prefix)) as registry:
        assert registry.get_decoder("dec-tp-plain") is None, "nothing was published"
