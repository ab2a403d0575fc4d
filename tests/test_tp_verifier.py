"""A dedicated verifier that is itself tensor-parallel (issue 36): a verifier replica at
TP=2 (its rank 0 in the replica's process on "another host", rank 1 a worker it spawns,
gloo between them), its own pool sharded by K/V heads, serving decoders through K/V
transfer (rows written into and read from both ranks' shards as whole heads,
``ShardedKV``).

With ``tp_invariant_lane`` the lane's bits do not depend on the TP size of the decoder or
of the verifier, so DVR with a perturbed fast path must give the TP=1 ``lane_only``
oracle's tokens and logprobs bit for bit, for a decoder at TP=1 and at TP=2. Shapes:
Llama-like heads (one K/V head a rank) and SmolLM2-like ones (replicated heads). Controls:
noise on the pushed heads only the verifier's worker holds changes the output; hellos the
verifier cannot serve are refused, naming why. A verifier rank lost mid-run: the decoder
fails over to another verifier, nothing unverified released.
"""

# ruff: noqa: F811  (the fixtures imported from the other test modules are parameters here)
from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from engine_utils import drive, signature, tiny_model
from test_dedicated_verifier import (  # noqa: F401  (fixtures used by name)
    PREFIX_REQS,
    decoder_host,
    health,
    transferring,
)
from test_remote_verifier import (  # noqa: F401  (fixtures used by name)
    DET,
    REQS,
    VerifierProc,
    cluster_secret,
    make_engine,
    oracle_prefix_checker,
    redis_url,
)
from test_tp_dedicated_verifier import (
    SHAPES,
    _hello,
    _refusals,
    assert_prefix_output_changes,
    check_against_the_tp1_oracle,
    lane_only,
    shaped_verifier,
)

from services.verifier import codec
from services.verifier import verifier_pb2 as pb
from services.verifier.client import RemoteVerifier
from services.verifier.transfer import _Pair

pytestmark = pytest.mark.timeout(600)

INVARIANT = {"tp_invariant_lane": True}


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped(request: pytest.FixtureRequest, redis_url: str
           ) -> Iterator[tuple[str, str, list[VerifierProc]]]:
    """A tiny model of the shape, and one verifier replica of it at TP=2."""
    yield from shaped_verifier(request.param, redis_url, tensor_parallel_size=2)


@pytest.mark.parametrize("decoder_tp", [1, 2])
def test_a_tp2_verifier_gives_the_tp1_oracle_bits(
        shaped: tuple[str, str, list[VerifierProc]], redis_url: str, decoder_tp: int) -> None:
    model, prefix, procs = shaped
    address = procs[0].address
    before = health(address).passes
    check_against_the_tp1_oracle(model, redis_url, prefix, address,
                                 {**INVARIANT, "tensor_parallel_size": decoder_tp},
                                 then=partial(_refusals, address, mapped_words="maps no decoder's pool")
                                 if decoder_tp == 1 else None)
    assert health(address).passes > before, "the TP verifier ran the passes"


def test_noise_on_the_verifier_workers_heads_is_caught(
        shaped: tuple[str, str, list[VerifierProc]], redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the pushed rows' heads that only the verifier's worker (rank 1)
    holds decide its lane's output. Noise on them changes the output, so the comparisons
    above would catch a verifier that dropped or misplaced the worker's shard."""
    model, prefix, _ = shaped
    prefix_oracle = lane_only(model, PREFIX_REQS)
    real = _Pair.send_rows

    class Noisy:
        def __init__(self, pool: Any) -> None:
            self.pool = pool

        def read_rows(self, slots: Any) -> torch.Tensor:
            rows = self.pool.read_rows(slots)
            heads = rows.shape[3]
            theirs = list(range(heads - heads // 2, heads))  # rank 1's half of the heads
            rows[:, :, :, theirs] += torch.randn_like(rows[:, :, :, theirs])
            return rows

    def noisy_send(self: _Pair, group: Any, pool: Any, slots: Any, dst: int) -> None:
        real(self, group, Noisy(pool) if group is self.push else pool,  # type: ignore[arg-type]
             slots, dst)

    monkeypatch.setattr(_Pair, "send_rows", noisy_send)
    assert_prefix_output_changes(model, redis_url, prefix, INVARIANT, prefix_oracle,
                                 "noise on rank 1's heads went unnoticed")


def _worker_of(proc: VerifierProc) -> int:
    """The pid of the verifier's TP worker (its spawned child running the worker)."""
    pid = proc.proc.pid
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        children += [int(c) for c in text]
    for child in children:
        cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"multiprocessing.spawn" in cmd and b"resource_tracker" not in cmd:
            return child
    raise AssertionError(f"no TP worker among {children}")


def test_a_lost_verifier_rank_fails_over_to_another_verifier(redis_url: str) -> None:
    """The TP verifier's worker killed mid-run: its rank 0's next collective fails, the
    stream ends UNAVAILABLE and the replica stops serving (Health says so); the decoder
    fails over to a TP=1 verifier, which is pushed every committed prefix. Nothing
    unverified is released, every deterministic output is the oracle's."""
    model = tiny_model()
    oracle = lane_only(model, REQS)
    prefix = f"tpvk{uuid.uuid4().hex[:6]}"
    with transferring(1, model, redis_url, prefix, tensor_parallel_size=2) as tp_procs:
        engine, exporter = make_engine(model, redis_url, prefix, "dec-tpv-kill",
                                       engine_kw=INVARIANT, transfer_timeout_s=5.0)
        remote = engine.verifier
        try:
            assert isinstance(remote, RemoteVerifier) and remote.verifier is not None
            assert remote.verifier.address == tp_procs[0].address
            with transferring(1, model, redis_url, prefix) as spare:
                submit, submitted = remote.submit, [0]

                def submit_then_kill(lane_pass: Any) -> None:
                    submit(lane_pass)
                    submitted[0] += 1
                    if submitted[0] == 4:
                        os.kill(_worker_of(tp_procs[0]), signal.SIGKILL)

                remote.submit = submit_then_kill  # type: ignore[method-assign]
                outs = drive(engine, REQS, oracle_prefix_checker(oracle))
                assert remote.failovers >= 1 and remote.verifier.address == spare[0].address
                for i in DET:
                    assert signature(outs[i]) == oracle[i], f"r{i} differs from the oracle"
                assert not health(tp_procs[0].address).serving
                # and a decoder that says hello now is turned away, not left waiting
                hello = codec.encode_hello(remote.record, pb.KVTransfer(
                    group=f"late-{uuid.uuid4().hex[:6]}", backend="gloo", device="cpu"))
                code, details = _hello(tp_procs[0].address, hello)
                assert code == grpc.StatusCode.UNAVAILABLE and "lost a TP rank" in details
        finally:
            engine.close()
            exporter.close()
