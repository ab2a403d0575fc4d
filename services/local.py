"""Start Ray (local) and Ray Serve for a serving config: `detserve serve`, tests, benchmarks.

Ray Serve's settings for the serving path (`services.serve_config.ray_serve_env`: the
throughput profile and direct ingress) are environment variables its processes read when
they start, so they are put into this process's environment before `ray.init` starts the
local cluster, whose processes inherit them; so is the cluster secret that the internal
gRPC servers ask for (``services.cluster_auth``: a fresh one unless one is configured).
A cluster with fewer GPUs than the app reserves (decoders x ``tensor_parallel_size``, plus
the verifiers') is refused before Ray Serve starts.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from services.cluster_auth import ensure_cluster_secret
from services.redis_server import free_port
from services.serve_config import (
    apply_ray_serve_env,
    check_gpu_count,
    gpus_needed,
    serve_start_options,
)


def start_local_serve(stack: ExitStack, config: dict[str, Any], **ray_init: Any
                      ) -> dict[str, str]:
    """``ray.init(**ray_init)`` and ``serve.start`` for ``config``; ``stack`` shuts both
    down. Returns the Ray Serve environment in effect."""
    import ray
    from ray import serve

    args = config["applications"][0]["args"]
    env = apply_ray_serve_env(args["http_port"], args["grpc_port"])
    ensure_cluster_secret()
    ray.init(include_dashboard=False, **ray_init)
    stack.callback(ray.shutdown)
    if gpus_needed(args):  # before Serve starts: replicas without GPUs would wait forever
        check_gpu_count(args, ray.cluster_resources().get("GPU", 0.0))
    host = config["http_options"]["host"]
    http, grpc = serve_start_options(config, env, (free_port(host), free_port(host)))
    try:
        serve.start(http_options=http, grpc_options=grpc)
    except ray.exceptions.RayActorError:
        # the controller gave up on the first proxy before it was ready (a slow start) and
        # restarts it; the controller is up, so a second call connects to it
        serve.start(http_options=http, grpc_options=grpc)
    stack.callback(serve.shutdown)
    return env
