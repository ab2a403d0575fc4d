"""The verifier pool as a Ray Serve deployment (named ``Verifier``, see serve_config.py).

Each replica is a ``VerifierReplica``: it loads the model, serves the ``Verify`` gRPC
stream on a free port and registers ``host:port`` in Redis with a TTL heartbeat. Decoders
find replicas through the registry, not through Ray handles: lane traffic is a long-lived
bidirectional stream, which Serve's request path does not carry. Ray Serve still places
the replicas, runs ``check_health`` and replaces a replica that dies or fails it; the
decoders then fail over to another one (services/verifier/client.py).

On a GPU the replica shares the decoder's GPU (a fractional ``num_gpus``), and its lane
uses every SM unless ``confine`` asks to confine it to that share:
- under MPS (the daemon is running) the two processes' kernels run at the same time.
  ``confine`` caps this process with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (set before it
  first touches CUDA). Not by default: a capped client sees fewer SMs, and cuBLAS picks its
  GEMM algorithms, so its reduction orders, by the SM count; the lane's products then stop
  matching the decoder's aligned fast path and nearly every window rolls back (measured in
  docs/benchmarks/gpu/README.md). Output stays correct either way: the lane decides.
- without MPS the GPU time-slices between the two processes: a verifier kernel never runs
  beside a decoder kernel, so confining the lane to a slice of the SMs only leaves the
  others idle during its time slices; ``confine`` then makes a CUDA green context of the
  share (measured against the whole GPU in docs/benchmarks/gpu/README.md).
The CPU suite tests which of these ``limit_sms`` picks; the paths themselves need a GPU.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

from ray import serve

from services.cluster_auth import ClusterAuth
from services.kv_handle import HOST_ID_ENV
from services.registry import DEFAULT_PREFIX
from services.verifier.replica import VerifierReplica

# the MPS daemon's directories when CUDA_MPS_PIPE_DIRECTORY / _LOG_DIRECTORY are unset
MPS_PIPE_DEFAULT, MPS_LOG_DEFAULT = "/tmp/nvidia-mps", "/tmp/nvidia-mps-log"


def mps_running() -> bool:
    return os.path.exists(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", MPS_PIPE_DEFAULT))


def limit_sms(device: str, sm_fraction: float,
              confine: bool = False) -> Callable[[], None] | None:
    """With ``confine``, confine lane kernels to ``sm_fraction`` of the GPU: through MPS when
    its daemon runs, else through a green context (see the module docstring); without it,
    nothing. Must run before CUDA is initialised in this process; returns the lane thread's
    initializer (or None)."""
    if not confine or not device.startswith("cuda") or not 0.0 < sm_fraction < 1.0:
        return None
    if mps_running():
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, round(100 * sm_fraction)))
        return None
    return _green_context_init(device, sm_fraction)


def _green_context_init(device: str, sm_fraction: float) -> Callable[[], None]:
    import torch
    from torch.cuda.green_contexts import GreenContext

    held: list[Any] = []  # the context must outlive the lane thread's use of it

    def init() -> None:
        index = torch.device(device).index or 0
        total = torch.cuda.get_device_properties(index).multi_processor_count
        # SM partitions come in hardware-sized groups; 8 is a multiple of all of them
        num_sms = max(8, int(total * sm_fraction) // 8 * 8)
        ctx: Any = GreenContext.create(num_sms=num_sms, device_id=index)
        ctx.set_context()
        torch.cuda.set_stream(ctx.Stream())
        held.append(ctx)

    return init


@serve.deployment(name="Verifier", health_check_period_s=5, health_check_timeout_s=15,
                  graceful_shutdown_timeout_s=10)
class Verifier:
    """Constructor arguments are the application's (see ``services.app``):
    ``model``, ``redis_url``, ``dtype``, ``device``, ``sm_fraction`` (normally the
    replica's fractional GPU share, ``verifier_gpu_fraction``) and ``confine``
    (``verifier_confine``: confine the lane to that share)."""

    def __init__(self, model: str, redis_url: str, dtype: str = "float32", device: str = "cpu",
                 sm_fraction: float = 0.0, ttl_s: float = 3.0,
                 prefix: str = DEFAULT_PREFIX, confine: bool = False,
                 dedicated_blocks: int = 0, tensor_parallel_size: int = 1) -> None:
        """``dedicated_blocks``: a dedicated verifier (a device of its own, K/V transfer)
        with a pool of that many blocks (-1: what the GPU holds after the model); it binds
        every interface, decoders elsewhere reach it. 0: co-located (loopback).
        ``tensor_parallel_size`` M > 1 (dedicated): the lane over M ranks, on the M GPUs
        Ray made visible (rank r on cuda:r)."""
        if device.startswith("cuda"):
            device = "cuda:0"  # Ray exposes the assigned GPU as the only visible one
        lane_init = limit_sms(device, sm_fraction, confine)
        host = "127.0.0.1"
        if dedicated_blocks:
            host = "0.0.0.0"
            if device == "cpu":  # no GPU to tell it apart: it is a host of its own
                os.environ[HOST_ID_ENV] = f"verifier-{uuid.uuid4().hex[:8]}"
        self.replica = VerifierReplica(model, redis_url, ClusterAuth.from_env(), dtype=dtype,
                                       device=device, host=host,
                                       ttl_s=ttl_s, prefix=prefix, lane_thread_init=lane_init,
                                       kv_blocks=dedicated_blocks,
                                       tensor_parallel_size=tensor_parallel_size)

    def check_health(self) -> None:
        self.replica.check_health()

    def info(self) -> dict[str, Any]:
        s = self.replica.servicer
        return {"verifier_id": self.replica.verifier_id, "address": self.replica.address,
                "streams": s.streams, "passes": s.passes, "kv_bytes_in": s.kv_bytes_in,
                "kv_bytes_out": s.kv_bytes_out, "kv_rows_out": s.kv_rows_out}

    def __del__(self) -> None:
        # Ray Serve calls __del__ when it stops a replica: deregister before exiting
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.shutdown()
