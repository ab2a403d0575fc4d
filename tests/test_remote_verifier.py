"""Decoder <-> verifier over gRPC, with the verifier in another process mapping the
decoder's shared-memory KV pool, found through a real Redis.

DVR with a remote verifier must equal the in-process ``lane_only`` oracle token for token,
logprob for logprob; killing the verifier in use mid-run must lose no request and release
no token that is not the oracle's; stale or incompatible decoders are refused.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from engine_utils import Req, drive, random_prompts, run_engine, signature, tiny_model

from detserve.config import EngineConfig
from detserve.engine import LLMEngine
from detserve.lane import LaneDecision, LanePass, LaneResult, LaneSegment
from detserve.model.loader import load_model
from detserve.outputs import RequestOutput, TokenLogprob
from detserve.params import SamplingParams, SamplingSpec
from services.cluster_auth import SECRET_ENV, ClusterAuth
from services.kv_handle import KVExporter
from services.redis_server import EmbeddedRedis
from services.registry import Registry
from services.verifier import codec
from services.verifier import verifier_pb2 as pb
from services.verifier import verifier_pb2_grpc as pb_grpc
from services.verifier.client import (
    RemoteVerifier,
    StaleEpochError,
    VerifierUnavailable,
    make_verifier_factory,
)

ROOT = Path(__file__).resolve().parent.parent
W, G, NUM_BLOCKS = 8, 4, 128
_PROMPTS = random_prompts(5, [21, 9, 40, 5, 17], seed=42)
REQS = [
    Req(_PROMPTS[0], SamplingParams(max_tokens=40, is_deterministic=True, logprobs=2,
                                    prompt_logprobs=2,  # the verifier answers them
                                    ignore_eos=True)),
    Req(_PROMPTS[1], SamplingParams(max_tokens=30, is_deterministic=False, temperature=0.7,
                                    seed=1, ignore_eos=True), arrival=1),
    Req(_PROMPTS[2], SamplingParams(max_tokens=36, temperature=0.8, top_p=0.9, seed=1234,
                                    is_deterministic=True, logprobs=1, ignore_eos=True,
                                    # penalties: the spec and the tokens before a window
                                    # travel to the verifier
                                    presence_penalty=-1.0, frequency_penalty=0.3)),
    Req(_PROMPTS[3], SamplingParams(max_tokens=25, is_deterministic=False, ignore_eos=True)),
    Req(_PROMPTS[4], SamplingParams(max_tokens=33, is_deterministic=True, logprobs=0,
                                    ignore_eos=True,  # the bias travels to the verifier
                                    logit_bias={t: -100.0 if t % 3 else 2.5
                                                for t in range(0, 300, 2)}), arrival=3),
]
DET = [i for i, r in enumerate(REQS) if r.params.is_deterministic]
AUTH = ClusterAuth("test-cluster-secret-" + uuid.uuid4().hex)


@pytest.fixture(scope="module", autouse=True)
def cluster_secret() -> Iterator[None]:
    """The secret in this process's environment: verifier processes (and the Ray Serve
    class constructed here) take it from there."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SECRET_ENV, AUTH.secret)
        yield


class VerifierProc:
    """``python -m services.verifier.replica`` in a process of its own."""

    def __init__(self, model: str, redis_url: str, prefix: str, ttl_s: float = 1.0,
                 extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        """``env``: more environment variables (e.g. another host id)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.verifier.replica", "--model", model,
             "--redis-url", redis_url, "--prefix", prefix, "--ttl", str(ttl_s), *extra],
            cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.address = ""

    def wait_ready(self, timeout_s: float = 60.0) -> VerifierProc:
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            raise TimeoutError("verifier did not start")
        line = self.proc.stdout.readline().split()
        assert line and line[0] == "READY", f"verifier failed to start: {line}"
        self.address = line[2]
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_verifiers(n: int, model: str, redis_url: str, prefix: str,
                    extra: tuple[str, ...] = (),
                    env: Callable[[], dict[str, str]] | None = None) -> list[VerifierProc]:
    """``env``: each verifier's extra environment (called once per verifier)."""
    procs = [VerifierProc(model, redis_url, prefix, extra=extra,  # start in parallel
                          env=env() if env else None)
             for _ in range(n)]
    return [p.wait_ready() for p in procs]


@pytest.fixture(scope="module")
def model() -> str:
    return tiny_model()


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as r:
        yield r.url


def oracle_of(model: str, reqs: list[Req]) -> list[tuple]:
    """The in-process ``lane_only`` outputs of ``reqs``: what DVR must give."""
    outs, _, _ = run_engine(model, reqs, mode="lane_only", window=W, group=G,
                            num_blocks=NUM_BLOCKS)
    return [signature(o) for o in outs]


@pytest.fixture(scope="module")
def oracle(model: str) -> list[tuple]:
    return oracle_of(model, REQS)


@contextmanager
def running_verifiers(n: int, model: str, redis_url: str, prefix: str,
                      **kw: Any) -> Iterator[list[VerifierProc]]:
    """``start_verifiers``, stopped on the way out."""
    procs = start_verifiers(n, model, redis_url, prefix, **kw)
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def pool(model: str, redis_url: str) -> Iterator[tuple[str, list[VerifierProc]]]:
    """One verifier shared by the tests that do not kill it."""
    prefix = f"pool{uuid.uuid4().hex[:6]}"
    with running_verifiers(1, model, redis_url, prefix) as procs:
        yield prefix, procs


def kill_after(remote: RemoteVerifier, procs: list[VerifierProc], passes: int) -> str:
    """Make ``remote`` kill the verifier it talks to now right after submitting its
    ``passes``-th lane pass (that pass is then certainly still in flight); returns the
    killed verifier's address."""
    assert remote.verifier is not None
    first = remote.verifier.address
    victim = next(p for p in procs if p.address == first)
    submit, submitted = remote.submit, [0]

    def submit_then_kill(lane_pass: LanePass) -> None:
        submit(lane_pass)
        submitted[0] += 1
        if submitted[0] == passes:
            victim.kill()

    remote.submit = submit_then_kill  # type: ignore[method-assign]
    return first


def make_engine(model: str, redis_url: str, prefix: str, decoder_id: str,
                connect: bool = True, engine_kw: dict[str, Any] | None = None,
                **options: float) -> tuple[LLMEngine, KVExporter]:
    """The decoder side, exactly as a decoder service wires it."""
    registry = Registry(redis_url, prefix)
    epoch = registry.next_epoch(decoder_id)
    registry.close()
    exporter = KVExporter(decoder_id, epoch)
    kw = engine_kw or {}
    loaded = load_model(model, kw.get("dtype", "float32"), kw.get("device", "cpu"))
    config = EngineConfig.create(model, "llm42", verify_window=W, verify_group=G,
                                 max_model_len=512, num_blocks=NUM_BLOCKS,
                                 fastpath_perturbation=0.2, seed=7, **kw)
    factory = make_verifier_factory(redis_url, decoder_id, exporter, loaded[2].weights_hash,
                                    auth=AUTH, prefix=prefix, connect=connect, **options)
    return LLMEngine(config, loaded=loaded, kv_storage=exporter, verifier_factory=factory), exporter


@contextmanager
def unconnected(model: str, redis_url: str, prefix: str, decoder_id: str,
                **options: float) -> Iterator[tuple[LLMEngine, RemoteVerifier]]:
    """A decoder (``make_engine``) whose verifier has not said hello yet, and that verifier;
    both closed after."""
    engine, exporter = make_engine(model, redis_url, prefix, decoder_id, connect=False,
                                   **options)
    remote = engine.verifier
    assert isinstance(remote, RemoteVerifier)
    try:
        yield engine, remote
    finally:
        remote.close()
        exporter.close()


def oracle_prefix_checker(oracle: list[tuple]) -> Callable[[int, RequestOutput], None]:
    """Every released state of a deterministic request is a prefix of the oracle's."""
    def check(i: int, out: RequestOutput) -> None:
        if i in DET:
            tokens, lps = signature(out)
            assert tokens == oracle[i][0][:len(tokens)], f"r{i} released an unverified token"
            assert lps == oracle[i][1][:len(lps)]
    return check


def drive_against_oracle(engine: LLMEngine, oracle: list[tuple], verifier_address: str
                         ) -> tuple[list[RequestOutput], dict[str, float], pb.HealthReply]:
    """Run REQS (every released state checked against the oracle), check each deterministic
    request's output equals it and that the verifier served every lane pass."""
    outs = drive(engine, REQS, oracle_prefix_checker(oracle))
    stats = engine.stats()
    for i in DET:
        assert signature(outs[i]) == oracle[i], f"r{i} differs from the oracle"
    with AUTH.channel(verifier_address) as ch:
        health = pb_grpc.VerifierStub(ch).Health(
            pb.HealthRequest(), timeout=5, metadata=AUTH.handshake(verifier_address).metadata)
    assert health.passes >= stats["verify_passes"]
    return outs, stats, health


def test_codec_roundtrip_is_exact() -> None:
    spec = SamplingSpec(temperature=0.1 + 0.2, top_p=0.9, top_k=5, seed=2**63 - 1, logprobs=None,
                        min_tokens=2, prompt_len=7, stop_ids=(0, 2),
                        logit_bias=((3, -100.0), (9, 0.1 + 0.2)), presence_penalty=-0.7,
                        frequency_penalty=0.1 + 0.2)
    lane_pass = LanePass(9, 32, (
        LaneSegment("a", "window", 12, (5, 6, 7), (1, 4), (6, 7), (0, 1, 2), spec, (4, 4, 9)),
        LaneSegment("b", "prefill", 0, (3,), (2,), (), (), SamplingSpec(logprobs=0)),
        LaneSegment("c", "prefill", 4, (3, 8), (2,), (), (), SamplingSpec(), (), 0, (8, 1))))
    assert codec.decode_pass(codec.encode_pass(lane_pass).lane_pass) == lane_pass
    lp = TokenLogprob(6, -0.123456789012345, {6: -0.12, 3: -2.5, 9: -1e-300})
    plp = TokenLogprob(8, -3.25, {})
    result = LaneResult(9, (LaneDecision("a", "window", 12, 1, (6, 8), (lp, None)),
                            LaneDecision("b", "prefill", 0, 0, (), ()),
                            LaneDecision("c", "prefill", 4, 0, (), (), (plp, lp))), 28, 0.25)
    back = codec.decode_result(codec.encode_result(result).decisions)
    assert back == result
    first = back.decisions[0].logprobs[0]
    assert first is not None and list(first.top) == [6, 3, 9], "top order is kept"


def test_remote_lane_equals_oracle(model: str, redis_url: str, oracle: list[tuple],
                                   pool: tuple[str, list[VerifierProc]]) -> None:
    prefix, procs = pool
    engine, exporter = make_engine(model, redis_url, prefix, "dec-oracle")
    remote = engine.verifier
    assert isinstance(remote, RemoteVerifier) and remote.verifier is not None
    registry = Registry(redis_url, prefix)
    try:
        outs, stats, health = drive_against_oracle(engine, oracle, procs[0].address)
        assert stats["perturbed_tokens"] > 0 and stats["rollbacks"] > 0
        # a mapping verifier: its lane shares our device, read outside our stream order;
        # this load gives it steps (the control for the transferring test's none)
        assert remote.shares_device and not remote.stream_ordered
        assert stats["lane_bound_waits"] > 0
        local = run_engine(model, REQS[:1], mode="lane_only", window=W, group=G,
                           num_blocks=NUM_BLOCKS)[0][0]
        assert local.prompt_logprobs is not None and len(local.prompt_logprobs) == 21
        assert outs[0].prompt_logprobs == local.prompt_logprobs  # the verifier's, bit for bit
        assert all(o.finished and len(o.token_ids) == REQS[i].params.max_tokens
                   for i, o in enumerate(outs))
        assert health.serving
        assert remote.wait_tables_written(10.0)
        tables = registry.block_tables("dec-oracle", remote.record.epoch)
        assert set(tables) == {f"r{i}" for i in DET}, "deterministic requests' tables published"
        remote.drop_requests(["r0"])
        assert remote.wait_tables_written(10.0)
        assert "r0" not in registry.block_tables("dec-oracle", remote.record.epoch)
    finally:
        remote.close()
        exporter.close()
    assert registry.get_decoder("dec-oracle") is None, "close() retires the decoder"
    registry.close()


@pytest.mark.gpu
def test_remote_lane_on_gpu_equals_oracle(model: str, redis_url: str) -> None:
    """The served layout on a GPU: a verifier process (lane passes as CUDA graphs) writing
    the lane K/V into the decoder's pool through CUDA IPC; DVR with the fast path perturbed
    equals the in-process lane_only oracle on the same GPU."""
    cuda = {"device": "cuda", "dtype": "bfloat16"}
    outs, _, o = run_engine(model, REQS, mode="lane_only", window=W, group=G,
                            num_blocks=NUM_BLOCKS, **cuda)
    o.close()
    oracle = [signature(x) for x in outs]
    prefix = f"gpu{uuid.uuid4().hex[:6]}"
    procs = start_verifiers(1, model, redis_url, prefix,
                            extra=("--device", "cuda", "--dtype", "bfloat16"))
    engine, exporter = make_engine(model, redis_url, prefix, "dec-gpu", engine_kw=cuda)
    try:
        _, stats, _ = drive_against_oracle(engine, oracle, procs[0].address)
        assert stats["verify_passes"] > 0 and stats["perturbed_tokens"] > 0
    finally:
        engine.verifier.close()
        exporter.close()
        for p in procs:
            p.stop()


def test_killed_verifier_loses_nothing(model: str, redis_url: str,
                                       oracle: list[tuple]) -> None:
    prefix = f"kill{uuid.uuid4().hex[:6]}"
    procs = start_verifiers(2, model, redis_url, prefix)
    by_address = {p.address: p for p in procs}
    try:
        engine, exporter = make_engine(model, redis_url, prefix, "dec-kill")
        remote = engine.verifier
        assert isinstance(remote, RemoteVerifier) and remote.verifier is not None
        first = kill_after(remote, procs, 3)
        try:
            outs = drive(engine, REQS, oracle_prefix_checker(oracle))
        finally:
            remote.close()
            exporter.close()
        assert by_address[first].proc.poll() is not None, "the verifier was killed"
        assert remote.failovers == 1 and remote.resent_passes >= 1
        assert remote.verifier is None or remote.verifier.address != first
        assert all(o.finished and len(o.token_ids) == REQS[i].params.max_tokens
                   for i, o in enumerate(outs)), "a request was lost"
        for i in DET:
            assert signature(outs[i]) == oracle[i], f"r{i} differs from the oracle"
    finally:
        for p in procs:
            p.stop()


def test_lost_verifier_fails_deterministic_requests_then_recovers(
        model: str, redis_url: str, oracle: list[tuple]) -> None:
    """The only verifier killed mid-run: the deterministic requests end "error" with only
    verified tokens, the others finish; while none is there a new deterministic request
    fails at once; a verifier started later serves the next ones equal to the oracle."""
    prefix = f"lost{uuid.uuid4().hex[:6]}"
    (proc,) = start_verifiers(1, model, redis_url, prefix)
    engine, exporter = make_engine(model, redis_url, prefix, "dec-lost", failover_timeout_s=1.0,
                                   hello_timeout_s=2.0)
    remote = engine.verifier
    assert isinstance(remote, RemoteVerifier)
    submit, submitted, lost = remote.submit, [0], []

    def submit_then_kill(lane_pass: LanePass) -> None:
        submit(lane_pass)
        submitted[0] += 1
        if submitted[0] == 3:  # the pass just sent is certainly still in flight
            proc.kill()

    step = engine.step

    def step_as_the_decoder_loop() -> list[RequestOutput]:
        try:
            return step()
        except VerifierUnavailable as e:
            lost.append(str(e))
            return engine.fail_lane(str(e))

    remote.submit = submit_then_kill  # type: ignore[method-assign]
    engine.step = step_as_the_decoder_loop  # type: ignore[method-assign]
    late: list[VerifierProc] = []
    try:
        outs = drive(engine, REQS, oracle_prefix_checker(oracle))
        assert lost and "no usable verifier" in lost[0]
        for i, out in enumerate(outs):
            if i in DET:
                assert out.finish_reason == "error"
                assert len(out.token_ids) < REQS[i].params.max_tokens
            else:
                assert len(out.token_ids) == REQS[i].params.max_tokens
        assert engine.blocks.num_free == engine.blocks.num_blocks - 1, "blocks leaked"
        assert remote.in_flight() == 0
        t0 = time.monotonic()
        (again,) = drive(engine, [REQS[0]])
        assert again.finish_reason == "error" and again.token_ids == []
        assert time.monotonic() - t0 < 5, "failed slowly while no verifier was there"
        late.append(VerifierProc(model, redis_url, prefix).wait_ready())
        outs = drive(engine, REQS, oracle_prefix_checker(oracle))
        for i in DET:
            assert signature(outs[i]) == oracle[i], f"r{i} differs from the oracle"
        assert remote.verifier is not None and remote.verifier.address == late[0].address
    finally:
        remote.close()
        exporter.close()
        for p in (proc, *late):
            p.stop()


def test_other_requests_go_on_while_a_verifier_is_looked_for(
        model: str, redis_url: str, oracle: list[tuple]) -> None:
    """The only verifier killed: while the decoder looks for another (up to its failover
    timeout, off the engine thread), the non-deterministic requests decode to their end;
    the deterministic ones end with an error only when the search gives up."""
    prefix = f"search{uuid.uuid4().hex[:6]}"
    (proc,) = start_verifiers(1, model, redis_url, prefix)
    failover_s = 4.0
    engine, exporter = make_engine(model, redis_url, prefix, "dec-search",
                                   failover_timeout_s=failover_s, hello_timeout_s=2.0)
    remote = engine.verifier
    assert isinstance(remote, RemoteVerifier)
    submit, submitted, killed = remote.submit, [0], [0.0]

    def submit_then_kill(lane_pass: LanePass) -> None:
        submit(lane_pass)
        submitted[0] += 1
        if submitted[0] == 3:
            proc.kill()
            killed[0] = time.monotonic()

    step, finished = engine.step, {}

    def step_as_the_decoder_loop() -> list[RequestOutput]:
        try:
            outs = step()
        except VerifierUnavailable as e:
            outs = engine.fail_lane(str(e))
        for o in outs:
            if o.finished:
                finished[o.request_id] = (time.monotonic(), o.finish_reason)
        return outs

    remote.submit = submit_then_kill  # type: ignore[method-assign]
    engine.step = step_as_the_decoder_loop  # type: ignore[method-assign]
    try:
        drive(engine, REQS, oracle_prefix_checker(oracle))
        assert killed[0] > 0
        nondet = [finished[f"r{i}"] for i in range(len(REQS)) if i not in DET]
        det = [finished[f"r{i}"] for i in DET]
        assert all(reason == "length" for _, reason in nondet)
        assert all(reason == "error" for _, reason in det)
        assert max(t for t, _ in nondet) < min(t for t, _ in det), \
            "the other requests waited for the search"
        assert min(t for t, _ in det) - killed[0] >= failover_s - 0.5, "gave up too early"
    finally:
        remote.close()
        exporter.close()
        proc.stop()


def test_stale_or_incompatible_decoder_is_refused(model: str, redis_url: str,
                                                  pool: tuple[str, list[VerifierProc]]) -> None:
    prefix, procs = pool
    with (unconnected(model, redis_url, prefix, "dec-stale") as (_, remote),
          closing(Registry(redis_url, prefix)) as registry):
        hello = codec.encode_hello(remote.record)
        assert _hello_status(procs[0].address, hello) == grpc.StatusCode.OK
        bad = pb.LaneRequest()
        bad.CopyFrom(hello)
        bad.hello.weights_hash = "0" * 64
        assert _hello_status(procs[0].address, bad) == grpc.StatusCode.INVALID_ARGUMENT
        # numerics the verifier's runner would not reproduce, or cannot be built from
        for field, value in (("kernels", "torch-ref-0/other"), ("numerics", 0)):
            bad.CopyFrom(hello)
            if field == "kernels":
                bad.hello.kernels = str(value)
            else:
                bad.hello.numerics.verify_group = int(value)
            assert _hello_status(procs[0].address, bad) == grpc.StatusCode.INVALID_ARGUMENT
        registry.next_epoch("dec-stale")  # the decoder restarted: this epoch is now stale
        assert _hello_status(procs[0].address, hello) == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(StaleEpochError, match="stale epoch"):
            remote.connect()


def test_a_decoder_record_lost_with_redis_is_written_again_on_connect(
        model: str, redis_url: str, oracle: list[tuple],
        pool: tuple[str, list[VerifierProc]]) -> None:
    """Redis came back empty and a verifier re-registered before the decoder's heartbeat
    wrote its record again: the verifier refuses the hello (NOT_FOUND), the decoder writes
    its record at once and is verified; until then it does not call itself ready. Control:
    a decoder without a heartbeat is refused the same way, and stays refused."""
    prefix, procs = pool
    registry = Registry(redis_url, prefix)
    engines = {name: make_engine(model, redis_url, prefix, name, connect=False,
                                 failover_timeout_s=1.0)
               for name in ("dec-kept", "dec-unkept")}
    kept, unkept = (engines[n][0].verifier for n in ("dec-kept", "dec-unkept"))
    assert isinstance(kept, RemoteVerifier) and isinstance(unkept, RemoteVerifier)
    for remote in (kept, unkept):  # the factory's heartbeats beat each second: too often
        assert remote._beat is not None
        remote._beat.stop(deregister=False)
        remote._beat = None
    kept.keep_registered(ttl_s=60.0)  # its next beat comes long after this test
    try:
        for name in engines:  # what a Redis that came back empty holds of these decoders
            registry.r.delete(registry.epoch_key(name), registry.decoder_key(name))
        assert kept._beat is not None
        kept._beat.last_ok = 0.0  # Redis was away longer than one TTL
        assert not kept.ready, "ready while no verifier would accept this decoder"
        outs = drive(engines["dec-kept"][0], REQS, oracle_prefix_checker(oracle))
        for i in DET:
            assert signature(outs[i]) == oracle[i], f"r{i} differs from the oracle"
        assert registry.current_epoch("dec-kept") == kept.record.epoch
        assert kept.ready
        with pytest.raises(VerifierUnavailable, match="not in the registry"):
            unkept.connect()
    finally:
        for engine, exporter in engines.values():
            engine.verifier.close()
            exporter.close()
        registry.close()


def test_a_hung_redis_never_holds_the_engine_up(model: str, oracle: list[tuple]) -> None:
    """Redis stops answering without closing its connections (SIGSTOP: a partition, a
    stalled host) while a decoder serves: no step waits on it (a Redis call would wait out
    the client's 5 s socket timeout), the deterministic outputs are the oracle's, and once
    Redis answers again the block tables it missed are written."""
    prefix = f"hung{uuid.uuid4().hex[:6]}"
    with EmbeddedRedis() as r, running_verifiers(1, model, r.url, prefix) as procs:
        engine, exporter = make_engine(model, r.url, prefix, "dec-hung")
        remote = engine.verifier
        assert isinstance(remote, RemoteVerifier) and remote.verifier is not None
        assert r.pid is not None
        step, longest = engine.step, [0.0]

        def timed() -> list[RequestOutput]:
            t0 = time.monotonic()
            try:
                return step()
            finally:
                longest[0] = max(longest[0], time.monotonic() - t0)

        engine.step = timed  # type: ignore[method-assign]
        os.kill(r.pid, signal.SIGSTOP)
        try:
            outs = drive(engine, REQS, oracle_prefix_checker(oracle))
            assert longest[0] < 1.0, f"a step waited {longest[0]:.1f} s on Redis"
            assert not remote.wait_tables_written(0.5), "written while Redis was stopped?"
        finally:
            os.kill(r.pid, signal.SIGCONT)
        try:
            for i in DET:
                assert signature(outs[i]) == oracle[i], f"r{i} differs from the oracle"
            assert remote.wait_tables_written(15.0), "the tables never reached Redis"
            registry = Registry(r.url, prefix)
            assert set(registry.block_tables("dec-hung", remote.record.epoch)) == {
                f"r{i}" for i in DET}
            registry.close()
            again = drive(engine, REQS[:1])  # and it goes on serving
            assert signature(again[0]) == oracle[0]
            assert procs[0].proc.poll() is None
        finally:
            remote.close()
            exporter.close()


def _hello_status(address: str, hello: pb.LaneRequest,
                  metadata: tuple[tuple[str, str], ...] | None = None) -> grpc.StatusCode:
    """The verifier's answer to ``hello`` from a caller sending ``metadata`` (default: a
    fresh token of this cluster's secret)."""
    if metadata is None:
        metadata = AUTH.handshake(address).metadata
    with grpc.insecure_channel(address) as ch:
        replies = pb_grpc.VerifierStub(ch).Verify(iter([hello]), timeout=10, metadata=metadata)
        try:
            first = next(replies)
        except grpc.RpcError as e:
            return e.code()  # type: ignore[attr-defined,no-any-return]
        assert first.WhichOneof("kind") == "ready"
        return grpc.StatusCode.OK


def test_a_caller_without_the_cluster_secret_is_refused(
        model: str, redis_url: str, pool: tuple[str, list[VerifierProc]]) -> None:
    """A caller that found the verifier in Redis but lacks the cluster secret (no token,
    a forged one, one made with another secret, or a valid one used a second time) gets
    UNAUTHENTICATED on every RPC, before its hello is read; the verifier keeps serving
    callers that have it (control: the same hello with a fresh token gets Ready)."""
    prefix, procs = pool
    address = procs[0].address
    with unconnected(model, redis_url, prefix, "dec-auth") as (_, remote):
        hello = codec.encode_hello(remote.record)
        forged = (("x-detserve-auth", f"{int(time.time())}.{'0' * 32}.{'f' * 64}"),)
        foreign = ClusterAuth("another-clusters-secret-0123").handshake(address).metadata
        used = AUTH.handshake(address).metadata
        assert _hello_status(address, hello, metadata=used) == grpc.StatusCode.OK
        for metadata in ((), forged, foreign, used):
            assert _hello_status(address, hello, metadata) == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as info:
            pb_grpc.VerifierStub(ch).Health(pb.HealthRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        assert _hello_status(address, hello) == grpc.StatusCode.OK
        other = RemoteVerifier(Registry(redis_url, prefix), remote.record,
                               ClusterAuth("another-clusters-secret-0123"),
                               failover_timeout_s=0.5, publish_block_tables=False)
        with pytest.raises(VerifierUnavailable, match="UNAUTHENTICATED"):
            other.connect()
        other.registry.close()


def test_waits_for_a_verifier_then_gives_up_clearly(model: str, redis_url: str,
                                                    oracle: list[tuple]) -> None:
    prefix = f"wait{uuid.uuid4().hex[:6]}"
    with unconnected(model, redis_url, prefix, "dec-wait",
                     failover_timeout_s=0.5) as (engine, remote):
        t0 = time.monotonic()
        with pytest.raises(VerifierUnavailable, match="no usable verifier"):
            remote.connect()
        assert time.monotonic() - t0 < 5
        remote.failover_timeout_s = 60.0
        late: list[VerifierProc] = []
        starter = threading.Timer(1.0, lambda: late.append(VerifierProc(model, redis_url, prefix)))
        starter.start()  # a verifier appears only after the first pass is submitted
        try:
            outs = drive(engine, REQS, oracle_prefix_checker(oracle))
        finally:
            starter.join()
            for p in late:
                p.stop()
        for i in DET:
            assert signature(outs[i]) == oracle[i]


def test_deployment_replica_registers_serves_and_deregisters(model: str, redis_url: str) -> None:
    """The Ray Serve class, constructed as Serve would (without starting Ray)."""
    pytest.importorskip("ray")
    from services.serve_config import VERIFIER
    from services.verifier.deployment import Verifier

    deployment: Any = Verifier  # a Serve Deployment; its class is func_or_class
    assert deployment.name == VERIFIER == "Verifier"
    prefix = f"dep{uuid.uuid4().hex[:6]}"
    replica = deployment.func_or_class(model, redis_url, ttl_s=1.0, prefix=prefix)
    registry = Registry(redis_url, prefix)
    try:
        replica.check_health()
        live = registry.live_verifiers()
        assert [v.address for v in live] == [replica.info()["address"]]
        assert live[0].weights_hash == load_model(model)[2].weights_hash
    finally:
        replica.__del__()
    assert registry.live_verifiers() == [], "deregistered on shutdown"
    deadline = time.monotonic() + 5.0  # the server's RPC threads end with it
    while (left := [t.name for t in threading.enumerate()
                    if t.name.startswith("verifier-grpc")]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, left
    with pytest.raises(RuntimeError):
        replica.check_health()
    registry.close()
