"""A verifier on a device of its own, for offline benchmarks (``bench_offline``'s
``llm42-dedicated`` mode): an embedded Redis, one verifier replica process on
``--dedicated-verifier-device`` (K/V transfer: a pool of its own, rows over NCCL/gloo), and
engines whose verifier is that replica (``RemoteVerifier``).

On CPU the replica registers as another host (``DETSERVE_HOST_ID``), so that it transfers
rather than maps, as it would on another GPU.
"""

from __future__ import annotations

import os
import secrets
import selectors
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from detserve.config import EngineConfig
from detserve.engine import LLMEngine
from services.cluster_auth import SECRET_ENV, ClusterAuth
from services.kv_handle import HOST_ID_ENV, KVExporter, KVHandle, release_kv
from services.redis_server import EmbeddedRedis
from services.registry import Registry
from services.verifier import verifier_pb2 as pb
from services.verifier import verifier_pb2_grpc as pb_grpc
from services.verifier.client import RemoteVerifier, make_verifier_factory

ROOT = Path(__file__).resolve().parent.parent


def die_with_parent() -> None:
    """Linux: the replica is killed when this process dies (a benchmark stopped by a
    timeout would otherwise leave it holding its GPU)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass(frozen=True)
class VerifierAddress:
    """Where the dedicated replica is and how to be let in: what a decoder process of this
    host needs to build engines verified by it (picklable, for decoders in processes of
    their own)."""

    redis_url: str
    prefix: str
    secret: str  # the cluster secret (SECRET_ENV)
    address: str  # the replica's gRPC address


class _ReusedPool(KVExporter):
    """``kv_storage`` that hands every engine of a client (one at a time) the pool the first
    one exported, zeroed, under the new engine's id and epoch. A CUDA pool once exported
    stays allocated until the process ends (torch keeps an IPC-shared block until a mapper
    lets go, and a transferring verifier never maps it): one 8B-shape pool a run ran an
    H200 out of memory by the third run."""

    def __init__(self, decoder_id: str, epoch: int,
                 kept: dict[tuple[Any, ...], tuple[torch.Tensor, KVHandle]]) -> None:
        super().__init__(decoder_id, epoch)
        self._kept = kept

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
        key = (tuple(shape), dtype, str(device))
        if key not in self._kept:
            tensor = super().__call__(shape, dtype, device)
            self._kept[key] = (tensor, self.handle)
            return tensor
        tensor, handle = self._kept[key]
        self._handle = replace(handle, decoder_id=self.decoder_id, epoch=self.epoch)
        return tensor.zero_()

    def close(self) -> None:
        """Kept for the next engine (``VerifierClient.release`` frees it)."""


class VerifierClient:
    """Builds engines verified by the replica at ``where``, one at a time (``engine``), and
    reads the replica's health. Engine ids are ``<name>-0``, ``<name>-1``, ...: several
    clients of one replica need names of their own."""

    def __init__(self, where: VerifierAddress, name: str = "bench-decoder") -> None:
        self.where, self.name = where, name
        self.auth = ClusterAuth(where.secret)
        self._engines = 0
        self._pools: dict[tuple[Any, ...], tuple[torch.Tensor, KVHandle]] = {}

    def engine(self, config: EngineConfig, loaded: Any) -> LLMEngine:
        """A new engine (the one before it is closed: runs take turns), on the pool the
        client's first engine of its shape exported (``_ReusedPool``)."""
        decoder_id = f"{self.name}-{self._engines}"
        self._engines += 1
        registry = Registry(self.where.redis_url, self.where.prefix)
        epoch = registry.next_epoch(decoder_id)
        registry.close()
        exporter = _ReusedPool(decoder_id, epoch, self._pools)
        factory = make_verifier_factory(self.where.redis_url, decoder_id, exporter,
                                        loaded[2].weights_hash, auth=self.auth,
                                        prefix=self.where.prefix, publish_block_tables=False)
        engine = LLMEngine(config, loaded=loaded, kv_storage=exporter,
                           verifier_factory=factory)
        remote = engine.verifier
        if not isinstance(remote, RemoteVerifier) or remote.transfer_stats is None:
            raise RuntimeError("the engine's verifier does not transfer K/V (co-located?)")
        return engine

    def health(self) -> pb.HealthReply:
        address = self.where.address
        with self.auth.channel(address) as ch:
            return pb_grpc.VerifierStub(ch).Health(  # type: ignore[no-any-return]
                pb.HealthRequest(), timeout=10,
                metadata=self.auth.handshake(address).metadata)

    def release(self) -> None:
        """Give up the exported pools (no engine of this client may run any more)."""
        for _, handle in self._pools.values():
            release_kv(handle)
        self._pools.clear()


class DedicatedVerifier:
    """Redis + one verifier replica process; ``engine(config, loaded)`` builds an engine
    verified by it, and ``where`` lets other processes build theirs (``VerifierClient``).
    ``close()`` stops both."""

    def __init__(self, model: str, dtype: str, device: str,
                 start_timeout_s: float = 600.0, tensor_parallel_size: int = 1) -> None:
        """``tensor_parallel_size`` M > 1: the replica's lane over M ranks, on ``device``
        and the devices after it (decoders then need the TP-invariant lane)."""
        self.redis = EmbeddedRedis().start()
        prefix = f"bench{uuid.uuid4().hex[:6]}"
        secret = os.environ.get(SECRET_ENV) or secrets.token_urlsafe(32)
        env = {**os.environ, SECRET_ENV: secret, "PYTHONUNBUFFERED": "1"}
        if torch.device(device).type != "cuda":  # (on a GPU of its own, it sees both: NCCL
            env[HOST_ID_ENV] = "dedicated-verifier-host"  # may then use NVLink P2P)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.verifier.replica", "--model", model,
             "--redis-url", self.redis.url, "--prefix", prefix, "--dtype", dtype,
             "--device", device, "--kv-blocks", "-1",  # its pool: what the device holds
             "--tensor-parallel-size", str(tensor_parallel_size)],
            cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env,
            preexec_fn=die_with_parent)
        self.client: VerifierClient | None = None
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(start_timeout_s):
            self.close()
            raise TimeoutError("the verifier replica did not start")
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "READY":
            self.close()
            raise RuntimeError(f"the verifier replica failed to start: {line}")
        self.where = VerifierAddress(self.redis.url, prefix, secret, line[2])
        self.client = VerifierClient(self.where)

    @property
    def address(self) -> str:
        return self.where.address

    def engine(self, config: EngineConfig, loaded: Any) -> LLMEngine:
        assert self.client is not None
        return self.client.engine(config, loaded)

    def health(self) -> pb.HealthReply:
        assert self.client is not None
        return self.client.health()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.client is not None:
            self.client.release()
        self.redis.stop()
