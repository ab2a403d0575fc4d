"""The verifier's gRPC servicer: runs decoders' lane passes, on their pools or its own.

One ``Verify`` stream per decoder. Its first message is a Hello; the servicer checks it
against the registry (the epoch must be the decoder's current one) and against its own
model (weights, dtype, kernels, KV geometry). A co-located decoder's pool is mapped through
its handle and a ``ModelRunner`` built over it, cached per decoder and epoch; the lane
writes its K/V in place there. A decoder that asks for K/V transfer (another GPU or host)
gets its sequences' blocks in the verifier's own pool, shared by all such streams, and a
pair of process groups for the rows that move (``transfer``). Then the servicer answers
every lane pass, in order, with the runner's decisions. Passes of all streams run one at a
time on a single lane thread (one device, one model copy), which also keeps the gRPC
threads free for Health checks.
While Redis is away, open streams go on and a decoder already attached at the same epoch
may say hello again; a new one is refused with UNAVAILABLE until the registry answers.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial

import grpc
import redis
import torch

from detserve.config import EngineConfig
from detserve.distributed import PeerLost, TensorParallelError, backend_for
from detserve.executor.kv_pool import KVPool
from detserve.executor.runner import ModelRunner
from detserve.lane import LanePass, LaneResult
from detserve.model.identity import ModelInfo
from detserve.model.llama import LlamaModel
from detserve.model.loader import load_model, read_model_config
from detserve.numerics import LaneNumerics
from detserve.parallel.executor import Workers, make_runner, tensor_parallel_model
from detserve.parallel.kv_rows import transfer_pool
from detserve.parallel.layout import TPLayout
from detserve.parallel.shard import rank_weights, shard_model, tree_twin
from services.cluster_auth import ClusterAuth
from services.kv_handle import KVHandle, open_kv
from services.registry import Registry
from services.verifier import codec
from services.verifier import verifier_pb2 as pb
from services.verifier import verifier_pb2_grpc as pb_grpc
from services.verifier.transfer import KVFull, VerifierKV, VerifierTransfer

log = logging.getLogger(__name__)
_MODELS: dict[tuple[str, str, str, int], tuple[LlamaModel, ModelInfo]] = {}
_MODELS_LOCK = threading.Lock()
# accept the decoders' keepalive pings (services/verifier/stream.py) during long passes
_SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]


def load_model_once(spec: str, dtype: str, device: str, tensor_parallel_size: int = 1
                    ) -> tuple[LlamaModel, ModelInfo]:
    """The process's copy of the weights (a verifier loads its model once); at
    ``tensor_parallel_size`` M > 1 only rank 0's shard of them."""
    key = (spec, dtype, device, tensor_parallel_size)
    with _MODELS_LOCK:
        if key not in _MODELS:
            model, _, info = load_model(spec, dtype=dtype, device=device,
                                        shard=rank_weights(spec, tensor_parallel_size))
            _MODELS[key] = (model, info)
        return _MODELS[key]


class HelloRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Attached:
    epoch: int
    handle: KVHandle
    runner: ModelRunner
    kernels: str  # codec.kernels_profile(runner)


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, model: LlamaModel, info: ModelInfo, registry: Registry, device: str,
                 verifier_id: str | None = None,
                 lane_thread_init: Callable[[], None] | None = None,
                 cuda_graphs: bool = True, store: object | None = None,
                 kv_blocks: int = 0, transfer_timeout_s: float = 30.0,
                 tensor_parallel_size: int = 1, model_spec: str = "") -> None:
        """``cuda_graphs`` (CUDA): run each lane pass as a CUDA graph (captured on the lane
        thread at its first pass of each size), as the offline engine's lane does; eager,
        a pass of a large model costs tens of ms of kernel launches. ``store`` (the TCP
        store transfer groups meet in) and ``kv_blocks`` (its own pool's size): K/V
        transfer for decoders that cannot be mapped (-1: as many blocks as the device's free
        memory holds at the first such hello); without them such a hello is refused.

        ``tensor_parallel_size`` M > 1: the lane runs over M ranks (worker processes on the
        devices after ``device``, loading ``model_spec``), its K/V sharded by heads. Such a
        verifier serves decoders through K/V transfer only, with the TP-invariant lane (whose
        bits do not depend on M), at the numerics of its first decoder."""
        if tensor_parallel_size > 1 and not (model_spec and store is not None and kv_blocks):
            raise ValueError("a verifier at tensor_parallel_size > 1 needs model_spec and K/V "
                             "transfer (store, kv_blocks)")
        self.model = model  # at tensor_parallel_size > 1 rank 0's shard (``load_model_once``)
        self.model_config = (read_model_config(model_spec) if tensor_parallel_size > 1
                             else model.config)  # the whole model's
        self.info = info
        self.registry = registry
        self.device = device
        self.cuda_graphs = cuda_graphs and torch.device(device).type == "cuda"
        self.verifier_id = verifier_id or uuid.uuid4().hex[:12]
        self._lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lane",
                                        initializer=partial(_lane_thread_init, device,
                                                            lane_thread_init))
        self._attached: dict[str, _Attached] = {}
        self._lock = threading.Lock()
        self.store = store
        self.kv_blocks = kv_blocks
        self.transfer_timeout_s = transfer_timeout_s
        self._own: VerifierKV | None = None  # made at the first transfer hello
        self._own_runners: dict[LaneNumerics, ModelRunner] = {}
        self.tensor_parallel_size = tensor_parallel_size
        self.model_spec = model_spec
        self._workers: Workers | None = None  # ranks 1..M-1 (at the first hello)
        self._tree_model: LlamaModel | None = None  # made at the first invariant-lane hello
        self._tree_lock = threading.Lock()
        self.streams = 0
        self.passes = 0
        self.busy_s = 0.0
        self.kv_bytes_in = 0
        self.kv_bytes_out = 0
        self.kv_rows_out = 0  # committed rows sent back to transferring decoders
        self.serving = True

    # ---- RPCs ---------------------------------------------------------------------
    def Verify(self, request_iterator: Iterator[pb.LaneRequest],
               context: grpc.ServicerContext) -> Iterator[pb.LaneReply]:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "hello":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a hello")
            return
        hello = first.hello
        try:
            runner = (self._attach_transfer(hello) if hello.HasField("transfer")
                      else self._attach(hello))
        except HelloRefused as e:
            log.warning("refused %s: %s", hello.decoder_id, e)
            context.abort(e.code, str(e))
            return
        with self._lock:
            self.streams += 1
        transfer: VerifierTransfer | None = None
        try:
            yield pb.LaneReply(ready=pb.Ready(verifier_id=self.verifier_id))
            if hello.HasField("transfer"):
                assert self._own is not None
                try:  # the decoder joins as soon as it reads Ready
                    transfer = VerifierTransfer(self.store, hello.transfer.group, self._own,
                                                self.transfer_timeout_s)
                    # on the lane thread, which issues every other stream's transfers, once
                    # the decoder said it connects too (so a lost one cannot hold the lane)
                    transfer.await_decoder()
                    self._lane.submit(transfer.connect).result()
                except PeerLost as e:
                    context.abort(grpc.StatusCode.UNAVAILABLE, f"transfer groups: {e}")
            for req in request_iterator:
                kind = req.WhichOneof("kind")
                if kind == "release":
                    if transfer is not None:
                        self._lane.submit(transfer.release, list(req.release.request_ids))
                    continue
                if kind != "lane_pass":
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "hello sent twice")
                if not context.is_active() or not self.serving:
                    return  # the decoder has moved on: write nothing more into its pool
                yield self._run(runner, req.lane_pass, transfer, context)
        finally:
            if transfer is not None:
                try:
                    self._lane.submit(transfer.close)
                except RuntimeError:  # the servicer is closing: the lane thread is gone
                    transfer.close()
            with self._lock:
                self.streams -= 1

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthReply:
        return pb.HealthReply(serving=self.serving, verifier_id=self.verifier_id,
                              weights_hash=self.info.weights_hash, streams=self.streams,
                              passes=self.passes, kv_bytes_in=self.kv_bytes_in,
                              kv_bytes_out=self.kv_bytes_out, busy_s=self.busy_s,
                              kv_blocks_used=self._blocks_used())

    def _blocks_used(self) -> int:
        own = self._own
        return 0 if own is None else own.blocks.num_blocks - 1 - own.blocks.num_free

    def close(self) -> None:
        self.serving = False
        self._lane.shutdown(wait=True)
        with self._lock:
            self._attached.clear()
        if self._workers is not None:
            self._workers.close()

    # ---- internals ----------------------------------------------------------------
    def _run(self, runner: ModelRunner, message: pb.LanePass,
             transfer: VerifierTransfer | None, context: grpc.ServicerContext) -> pb.LaneReply:
        try:
            lane_pass = codec.decode_pass(message)
            kv_from = codec.decode_kv_from(message) if transfer is not None else []
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad lane pass: {e}")
            raise  # (abort raises)
        try:
            reply = self._lane.submit(self._pass, runner, lane_pass, kv_from, transfer).result()
        except (KVFull, PeerLost, TensorParallelError) as e:
            # the stream cannot go on (its K/V is incomplete, or a rank of this verifier was
            # lost: then no stream can, and Health says so): the decoder fails over
            if isinstance(e, TensorParallelError):
                self.serving = False
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(e, KVFull)
                    else grpc.StatusCode.UNAVAILABLE)
            context.abort(code, f"lane pass {lane_pass.pass_id}: {e}")
            raise
        except Exception as e:  # a bad pass is a bug on one side: report it, never guess
            log.exception("lane pass %d failed", lane_pass.pass_id)
            return pb.LaneReply(error=pb.PassError(pass_id=lane_pass.pass_id,
                                                   message=f"{type(e).__name__}: {e}"))
        with self._lock:
            self.passes += 1
        return reply

    def _pass(self, runner: ModelRunner, lane_pass: LanePass, kv_from: list[int | None],
              transfer: VerifierTransfer | None) -> pb.LaneReply:
        """On the lane thread: one pass, with its transfers."""
        t0 = time.perf_counter()
        kv_rows = 0
        if transfer is None:
            result: LaneResult = runner.run_lane(lane_pass)
        else:
            before = (transfer.stats.bytes_in, transfer.stats.bytes_out)
            lane_pass = transfer.prepare(lane_pass, kv_from)
            result = runner.run_lane(lane_pass)
            kv_rows = transfer.send_back(lane_pass, result)
            self.kv_bytes_in += transfer.stats.bytes_in - before[0]
            self.kv_bytes_out += transfer.stats.bytes_out - before[1]
            self.kv_rows_out += kv_rows
        self.busy_s += time.perf_counter() - t0
        return codec.encode_result(result, kv_rows)

    def _attach(self, hello: pb.Hello) -> ModelRunner:
        handle = _handle(hello)
        unreachable: redis.RedisError | None = None
        try:
            self._check_current(hello, handle)
        except redis.RedisError as e:
            unreachable = e
        self._check_compatible(hello, handle)
        numerics = _numerics(hello)
        with self._lock:
            cached = self._attached.get(hello.decoder_id)
        # (a hello whose numerics or kernels differ is checked like a new one)
        known = (cached is not None and cached.epoch == hello.epoch and cached.handle == handle
                 and cached.runner.numerics == numerics and cached.kernels == hello.kernels)
        if unreachable is not None and not known:
            # Redis away: a decoder this verifier already attached at this very epoch and
            # pool reconnects (a broken stream); anyone else waits until it can be checked
            raise HelloRefused(grpc.StatusCode.UNAVAILABLE,
                               f"the registry is unreachable: {unreachable}") from unreachable
        if known:
            assert cached is not None
            return cached.runner
        try:
            storage = open_kv(handle)
        except FileNotFoundError as e:
            raise HelloRefused(grpc.StatusCode.NOT_FOUND, f"KV pool not found: {e}") from e
        except (ValueError, RuntimeError) as e:
            raise HelloRefused(grpc.StatusCode.INVALID_ARGUMENT, f"cannot map KV pool: {e}") from e
        mc = self.model.config
        pool = KVPool(mc.num_layers, handle.shape[2], numerics.block_size, mc.num_kv_heads,
                      mc.head_dim, handle.torch_dtype, self.device, storage=storage)
        runner = ModelRunner(self._model_for(numerics), pool, numerics)
        kernels = _same_kernels(hello, runner)
        if self.cuda_graphs:  # a pass's block tables are at most the whole pool wide
            runner.enable_cuda_graphs(None, lane=True, max_batch=1, max_blocks=handle.shape[2])
        with self._lock:  # a newer epoch replaces (and unmaps) the old one
            self._attached[hello.decoder_id] = _Attached(hello.epoch, handle, runner, kernels)
        return runner

    def _attach_transfer(self, hello: pb.Hello) -> ModelRunner:
        """A decoder whose pool this verifier cannot map: checked as any other, then a
        runner over the verifier's own pool (shared by every decoder with its numerics)."""
        if self.store is None or not self.kv_blocks:
            raise HelloRefused(grpc.StatusCode.FAILED_PRECONDITION,
                               "this verifier does no K/V transfer (co-located decoders only)")
        handle = _handle(hello)
        try:
            self._check_current(hello, handle)
        except redis.RedisError as e:
            raise HelloRefused(grpc.StatusCode.UNAVAILABLE,
                               f"the registry is unreachable: {e}") from e
        self._check_compatible(hello, handle, mapped=False)
        if hello.transfer.backend != backend_for(self.device):
            raise HelloRefused(grpc.StatusCode.INVALID_ARGUMENT,
                               f"transfer backend {hello.transfer.backend!r}, this verifier "
                               f"uses {backend_for(self.device)!r}")
        numerics = _numerics(hello)
        if self.tensor_parallel_size > 1:
            return self._attach_tp(hello, numerics)
        with self._lock:
            if self._own is None:
                mc = self.model.config
                dtype = getattr(torch, self.info.dtype)
                blocks = (self.kv_blocks if self.kv_blocks > 0
                          else _blocks_that_fit(self.model, dtype, self.device,
                                                numerics.block_size))
                self._own = VerifierKV(KVPool(mc.num_layers, blocks, numerics.block_size,
                                              mc.num_kv_heads, mc.head_dim, dtype, self.device))
            own = self._own
            if own.pool.block_size != numerics.block_size:
                raise HelloRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"block size {numerics.block_size}: this verifier's pool "
                                   f"has blocks of {own.pool.block_size}")
            runner = self._own_runners.get(numerics)
            if runner is None:
                runner = ModelRunner(self._model_for(numerics), own.pool, numerics)
                if self.cuda_graphs:  # tables as wide as the longest sequence, not the pool
                    longest = -(-self.model.config.max_position_embeddings
                                // numerics.block_size)
                    runner.enable_cuda_graphs(None, lane=True, max_batch=1,
                                              max_blocks=min(longest, own.pool.data.shape[2]))
                self._own_runners[numerics] = runner
        _same_kernels(hello, runner)
        return runner

    def _attach_tp(self, hello: pb.Hello, numerics: LaneNumerics) -> ModelRunner:
        """The runner over this verifier's M ranks: made at the first hello, with its
        numerics; a later hello must bring the same (the workers run one set)."""
        # (``_check_compatible`` refused the ordinary lane.) With the invariant lane the
        # decoder's TP size decides only its fast path's sums: decoders of every TP size
        # share the ranks
        numerics = replace(numerics, tensor_parallel_size=1)
        with self._lock:
            if self._workers is not None and self._workers.failed:
                raise HelloRefused(grpc.StatusCode.UNAVAILABLE,
                                   f"this verifier lost a TP rank ({self._workers.failed})")
            if self._own is None:  # on the lane thread, which issues all its collectives
                self._own, self._own_runners[numerics] = self._lane.submit(
                    self._start_tp, numerics).result()
            found = self._own_runners.get(numerics)
        if found is None:
            raise HelloRefused(grpc.StatusCode.INVALID_ARGUMENT,
                               "this verifier's ranks run other lane numerics (those of its "
                               "first decoder); a verifier at tensor_parallel_size > 1 serves "
                               "one set")
        _same_kernels(hello, found)
        return found

    def _start_tp(self, numerics: LaneNumerics) -> tuple[VerifierKV, ModelRunner]:
        """Start ranks 1..M-1 (each loads its shard of the model) and rank 0's runner over
        a pool of ``kv_blocks`` blocks on every rank; the K/V moves as whole heads."""
        mc = self.model_config
        dtype = getattr(torch, self.info.dtype)
        m = self.tensor_parallel_size
        # every rank's pool has as many blocks, of its heads (rank 0's shard is loaded, so
        # the free memory measured here is what its pool may take)
        heads = max(len(TPLayout(mc, m, r).kv_heads) for r in range(m))
        blocks = (self.kv_blocks if self.kv_blocks > 0
                  else _blocks_that_fit(self.model, dtype, self.device, numerics.block_size,
                                        kv_heads=heads))
        config = EngineConfig.create(
            self.model_spec, "llm42", dtype=self.info.dtype, device=self.device,
            max_model_len=mc.max_position_embeddings, block_size=numerics.block_size,
            num_blocks=blocks, tensor_parallel_size=self.tensor_parallel_size,
            tp_invariant_lane=True)
        try:
            local, workers = tensor_parallel_model(config, self.model)
        except (TensorParallelError, ValueError) as e:
            raise HelloRefused(grpc.StatusCode.UNAVAILABLE,
                               f"this verifier's TP ranks did not start: {e}") from e
        assert workers is not None
        self._workers = workers
        lc = local.config
        pool = KVPool(lc.num_layers, blocks, numerics.block_size, lc.num_kv_heads,
                      lc.head_dim, dtype, self.device)
        runner = make_runner(local, pool, numerics, None, workers)
        if self.cuda_graphs:
            longest = -(-mc.max_position_embeddings // numerics.block_size)
            runner.enable_cuda_graphs(None, lane=True, max_batch=1,
                                      max_blocks=min(longest, blocks))
        return VerifierKV(pool, transfer_pool(runner)), runner

    def _model_for(self, numerics: LaneNumerics) -> LlamaModel:
        """The model a runner of ``numerics`` runs: with the TP-invariant lane, the whole
        model carrying the tree's leaves and its rows in the tree's order (as a TP=1
        engine's; a twin, so that ordinary-lane runners keep their weights), whatever the
        decoder's TP size; else the model itself."""
        if not numerics.tp_invariant_lane:
            return self.model
        with self._tree_lock:
            if self._tree_model is None:
                self._tree_model = shard_model(tree_twin(self.model),
                                               TPLayout(self.model.config, 1, 0), None,
                                               tree=True)
            return self._tree_model

    def _check_current(self, hello: pb.Hello, handle: KVHandle) -> None:
        """Refuse anything but the decoder's current epoch, as published in the registry."""
        current = self.registry.current_epoch(hello.decoder_id)
        if current is None:
            raise HelloRefused(grpc.StatusCode.NOT_FOUND,
                               f"decoder {hello.decoder_id!r} is not in the registry")
        if hello.epoch != current:
            raise HelloRefused(grpc.StatusCode.FAILED_PRECONDITION,
                               f"stale epoch {hello.epoch} of decoder {hello.decoder_id!r} "
                               f"(current {current})")
        record = self.registry.get_decoder(hello.decoder_id)
        if record is None or record.epoch != hello.epoch:
            raise HelloRefused(grpc.StatusCode.NOT_FOUND,
                               f"decoder {hello.decoder_id!r} has not published epoch {hello.epoch}")
        if record.kv_handle != handle or handle.epoch != hello.epoch:
            raise HelloRefused(grpc.StatusCode.FAILED_PRECONDITION,
                               "the hello's KV handle is not the one the decoder published")

    def _check_compatible(self, hello: pb.Hello, handle: KVHandle, mapped: bool = True) -> None:
        """Refuse a decoder whose lane this verifier would not reproduce bit for bit (or
        whose pool it cannot map, when ``mapped``)."""
        mc = self.model_config
        g = _numerics(hello)
        problems = []
        if hello.weights_hash != self.info.weights_hash:
            problems.append(f"weights {hello.weights_hash[:12]} != {self.info.weights_hash[:12]}")
        if hello.dtype != self.info.dtype or handle.dtype != self.info.dtype:
            problems.append(f"dtype {hello.dtype} != {self.info.dtype}")
        if mapped and (handle.kind == "shm") != (torch.device(self.device).type == "cpu"):
            problems.append(f"a {handle.kind} pool cannot be used on {self.device}")
        kv_heads = mc.num_kv_heads
        tp, m = g.tensor_parallel_size, self.tensor_parallel_size
        if mapped and m > 1:
            problems.append(f"this verifier runs at tensor_parallel_size {m}: its K/V is "
                            "sharded over its ranks, so it maps no decoder's pool (K/V "
                            "transfer only)")
        if (tp > 1 or m > 1) and not g.tp_invariant_lane:
            problems.append(f"a decoder at tensor_parallel_size {tp} is verified outside its "
                            f"ranks (here at tensor_parallel_size {m}) only with "
                            "tp_invariant_lane (whose bits do not depend on the TP size)")
        if tp > 1:  # the handle is rank 0's pool: its heads only
            if mapped:
                problems.append(f"a decoder at tensor_parallel_size {tp} shards its KV pool "
                                "over its ranks: it cannot be mapped (K/V transfer only)")
            try:
                kv_heads = len(TPLayout(mc, tp, 0).kv_heads)
            except ValueError as e:
                problems.append(str(e))
        nb = handle.shape[2] if len(handle.shape) == 6 else -1
        want = KVPool.shape_for(mc.num_layers, nb, g.block_size, kv_heads, mc.head_dim)
        if handle.shape != want:
            problems.append(f"KV pool shape {handle.shape} != {want}")
        if problems:
            raise HelloRefused(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(problems))


def _handle(hello: pb.Hello) -> KVHandle:
    try:
        return KVHandle.from_json(hello.kv_handle)
    except (ValueError, KeyError, TypeError) as e:
        raise HelloRefused(grpc.StatusCode.INVALID_ARGUMENT, f"bad KV handle: {e}") from e


def _same_kernels(hello: pb.Hello, runner: ModelRunner) -> str:
    """The runner's kernel profile, refused unless it is the decoder's."""
    kernels = codec.kernels_profile(runner)
    if hello.kernels != kernels:
        raise HelloRefused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"kernels {hello.kernels!r} != {kernels!r}")
    return kernels


def _lane_thread_init(device: str, then: Callable[[], None] | None) -> None:
    """The lane thread works on the verifier's device (not necessarily the current one)."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    if then is not None:
        then()


def _blocks_that_fit(model: LlamaModel, dtype: torch.dtype, device: str, block_size: int,
                     fraction: float = 0.85, kv_heads: int | None = None) -> int:
    """KV blocks of ``kv_heads`` heads (default: all) that ``fraction`` of the device's
    free memory holds now (CUDA; the model loaded); on CPU a fixed 4096."""
    if torch.device(device).type != "cuda":
        return 4096
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    mc = model.config
    per_block = math.prod(KVPool.shape_for(mc.num_layers, 1, block_size,
                                           kv_heads or mc.num_kv_heads,
                                           mc.head_dim)) * dtype.itemsize
    return max(2, int(free * fraction) // per_block)


def _numerics(hello: pb.Hello) -> LaneNumerics:
    try:
        return codec.decode_numerics(hello.numerics)
    except (TypeError, ValueError) as e:
        raise HelloRefused(grpc.StatusCode.INVALID_ARGUMENT, f"bad lane numerics: {e}") from e


class VerifierServer:
    """A gRPC server around one servicer, on ``host:port`` (port 0: any free port); it
    answers only callers with the cluster secret (``auth``), over TLS where configured."""

    def __init__(self, servicer: VerifierServicer, auth: ClusterAuth, host: str = "127.0.0.1",
                 port: int = 0, max_streams: int = 32) -> None:
        self.servicer = servicer
        self.host = host
        self.gate = auth.gate()  # callers must hold the cluster secret
        # one thread per open stream, plus room for Health checks
        self._pool = ThreadPoolExecutor(max_workers=max_streams + 4,
                                        thread_name_prefix="verifier-grpc")
        self._server = grpc.server(self._pool, maximum_concurrent_rpcs=max_streams + 4,
                                   options=_SERVER_OPTIONS,
                                   interceptors=[self.gate.interceptor()])
        pb_grpc.add_VerifierServicer_to_server(servicer, self._server)
        self.port = auth.add_port(self._server, f"{host}:{port}")
        if self.port == 0:
            raise RuntimeError(f"could not bind the verifier's gRPC server on {host}:{port}")
        self.gate.allow(self.address)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> VerifierServer:
        self._server.start()
        return self

    def stop(self, grace_s: float = 1.0) -> None:
        self.servicer.serving = False
        self._server.stop(grace_s).wait()
        self._pool.shutdown(wait=False)  # (grpc leaves its threads idle, never ended)
        self.servicer.close()
