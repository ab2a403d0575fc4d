"""One verifier replica: the model, the gRPC server, and its registration in Redis.

This is everything a verifier process does, without Ray: the Ray Serve deployment
(``deployment.py``) wraps it, and ``python -m services.verifier.replica`` runs it
stand-alone (tests start verifiers this way, in processes of their own).

A replica serves co-located decoders (it maps their KV pools) and, with ``kv_blocks`` set,
any other decoder through K/V transfer: it then hosts the TCP store their process groups
meet in and publishes its address in its registry record. It binds to loopback by default
(decoders on this host only); ``--host 0.0.0.0`` for decoders elsewhere.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from detserve.config import opt
from detserve.distributed import open_store
from detserve.flags import add_flags, options
from services.cluster_auth import ClusterAuth
from services.kv_handle import device_key, host_id
from services.registry import DEFAULT_PREFIX, Heartbeat, Registry, VerifierRecord
from services.verifier import verifier_pb2 as pb
from services.verifier import verifier_pb2_grpc as pb_grpc
from services.verifier.server import VerifierServer, VerifierServicer, load_model_once

log = logging.getLogger(__name__)


class VerifierReplica:
    def __init__(self, model: str, redis_url: str, auth: ClusterAuth, *, dtype: str = "float32",
                 device: str = "cpu", host: str = "127.0.0.1", port: int = 0,
                 ttl_s: float = 3.0, prefix: str = DEFAULT_PREFIX,
                 lane_thread_init: Callable[[], None] | None = None,
                 kv_blocks: int = 0, tensor_parallel_size: int = 1) -> None:
        """Loads the model, starts serving, then registers (so a registered verifier is
        always ready to answer a hello). ``kv_blocks`` non-zero: serve decoders it cannot
        map, with a pool of that many blocks of its own (-1: what the device holds); their
        groups meet in a TCP store on a free port, published in its record.
        ``tensor_parallel_size`` M > 1 (needs ``kv_blocks``): the lane over M ranks, on
        ``device`` and the M-1 devices after it (``VerifierServicer``); its record's device
        key then matches no pool, so decoders never try to have it map theirs."""
        self.verifier_id = uuid.uuid4().hex[:12]
        self.registry = Registry(redis_url, prefix)
        weights, info = load_model_once(model, dtype, device, tensor_parallel_size)
        advertise = socket.gethostbyname(socket.gethostname()) if host == "0.0.0.0" else host
        self.store = open_store(host, 0, server=True) if kv_blocks else None
        self.servicer = VerifierServicer(weights, info, self.registry, device, self.verifier_id,
                                         lane_thread_init=lane_thread_init, store=self.store,
                                         kv_blocks=kv_blocks,
                                         tensor_parallel_size=tensor_parallel_size,
                                         model_spec=model)
        key = device_key(device)
        if tensor_parallel_size > 1:
            key = f"tp{tensor_parallel_size}:{key}"
        self.auth = auth
        self.server = VerifierServer(self.servicer, auth, host, port).start()
        self.record = VerifierRecord(
            self.verifier_id, f"{advertise}:{self.server.port}", host_id(), device,
            info.weights_hash, device_key=key,
            kv_store=f"{advertise}:{self.store.port}" if self.store is not None else "")
        self.server.gate.allow(self.record.address)  # where decoders dial it
        # a replica (re)started while Redis is away does not fail to start: it registers
        # as soon as Redis answers; each beat publishes its load (decoders attached)
        self.heartbeat = Heartbeat(
            self.registry, self.record, ttl_s,
            update=lambda r: replace(r, load=self.servicer.streams),  # type: ignore[type-var, arg-type]
        ).start(required=False)
        self._closed = False
        log.info("verifier %s serving %s on %s", self.verifier_id, info.name, self.record.address)

    @property
    def address(self) -> str:
        return self.record.address

    def check_health(self) -> None:
        """Raise if this replica cannot serve: Ray Serve then replaces it."""
        if self._closed or not self.servicer.serving:
            raise RuntimeError("verifier is shut down")
        if not self.heartbeat.alive:  # Redis away is not this replica's fault: it re-registers
            raise RuntimeError("the registration heartbeat stopped")
        with self.auth.channel(self.address) as ch:
            reply = pb_grpc.VerifierStub(ch).Health(
                pb.HealthRequest(), timeout=5.0,
                metadata=self.auth.handshake(self.address).metadata)
        if not reply.serving:
            raise RuntimeError("gRPC server reports not serving")

    def shutdown(self) -> None:
        """Deregister first (no new streams), then stop the server."""
        if self._closed:
            return
        self._closed = True
        self.heartbeat.stop(deregister=True)
        self.server.stop()
        self.registry.close()


@dataclass(frozen=True)
class ReplicaOptions:
    """The stand-alone replica's options (``python -m services.verifier.replica``), its
    flags generated from these fields; the cluster secret comes from the environment."""

    model: str = opt("", "the model: a Hugging Face folder, a .gguf file, an alias or "
                         "random:<shape> (required)")
    redis_url: str = opt("", "the registry's Redis URL (required)")
    dtype: str = opt("float32", "the weights' dtype (the decoders' own)")
    device: str = opt("cpu", "the device it verifies on (at tensor_parallel_size > 1 rank "
                             "0's; the other ranks take the devices after it)")
    host: str = opt("127.0.0.1", "the interface its gRPC server binds (0.0.0.0: every one, "
                                 "advertised by this host's address)")
    port: int = opt(0, "its gRPC port (0: any free one)")
    ttl_s: float = opt(3.0, "its registration's TTL in seconds", aliases=("--ttl",))
    prefix: str = opt(DEFAULT_PREFIX, "the registry's key prefix")
    kv_blocks: int = opt(0, "blocks of its own KV pool, for decoders on other devices or "
                            "hosts (K/V transfer); -1: what the device holds after the "
                            "model; 0: co-located decoders only")
    tensor_parallel_size: int = opt(1, "ranks the lane runs over (worker processes on the "
                                       "devices after --device), for decoders with the "
                                       "TP-invariant lane through K/V transfer (needs "
                                       "--kv-blocks)")

    def __post_init__(self) -> None:
        for name in ("model", "redis_url"):
            if not getattr(self, name):
                raise ValueError(f"--{name.replace('_', '-')} is required")
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be >= 1")
        if self.tensor_parallel_size > 1 and not self.kv_blocks:
            raise ValueError("--tensor-parallel-size > 1 needs --kv-blocks (a TP verifier "
                             "maps no pool)")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run one detserve verifier replica.")
    add_flags(ap, options(ReplicaOptions))
    try:
        opts = ReplicaOptions(**vars(ap.parse_args(argv)))
    except ValueError as e:
        ap.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    replica = VerifierReplica(auth=ClusterAuth.from_env(), **asdict(opts))
    print(f"READY {replica.verifier_id} {replica.address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    replica.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
