"""``detserve serve``: Ray (local), Redis, router, decoders and verifiers in one command.

    detserve serve --model smollm2        # OpenAI API on :8000, gRPC on :9000

Picked up by ``services.console`` through ``register_detserve_commands``. The application args
come from ``services.serve_config.default_serve_config``, the same function KubeRay's
manifests are rendered from, so a local server and a cluster run the same config.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from detserve.flags import add_engine_flags, add_flags, options
from services.serve_config import (
    APP_NAME,
    ARG_NAMES,
    DEFAULT_ARGS,
    OPTIONAL_ARGS,
    SERVE_ENGINE_DEFAULTS,
    ServeConfig,
)


def register_detserve_commands(subcommand: Callable[..., Any]) -> None:
    subcommand("serve", "serve the OpenAI-compatible API locally (Ray Serve)", _args)(_serve)


# the serve command's own defaults: None, chosen when the config is built
_SERVE_DEFAULTS = {"verifier_gpu_fraction": None, "redis_url": None}


def _args(p: argparse.ArgumentParser) -> None:
    add_engine_flags(p, defaults=SERVE_ENGINE_DEFAULTS)
    add_flags(p.add_argument_group("serving options (ServeConfig)"), options(ServeConfig),
              _SERVE_DEFAULTS)
    p.add_argument("--mps", action="store_true",
                   help="cuda: start a CUDA MPS control daemon for this server unless one "
                        "runs (stopped on exit), so that the decoders' and the verifiers' "
                        "kernels run side by side on a shared GPU instead of time-slicing")
    p.add_argument("--host", default="0.0.0.0", help="HTTP bind address")


def serve_config_from(a: argparse.Namespace, redis_url: str) -> dict[str, Any]:
    """The application config of parsed flags: every required arg, and each optional one
    whose flag differs from its default (an absent arg means the default)."""
    from services.serve_config import default_serve_config

    fraction = a.verifier_gpu_fraction
    if fraction is None:
        shared = a.device == "cuda" and a.num_verifiers and not a.dedicated_verifiers
        fraction = 0.25 if shared else 0.0
    values = {**vars(a), "verifier_gpu_fraction": fraction, "redis_url": redis_url}
    overrides = {name: values[name] for name in ARG_NAMES}
    overrides.update({name: values[name] for name, default in OPTIONAL_ARGS.items()
                      if values[name] is not None and values[name] != default})
    return default_serve_config(http_host=a.host, **overrides)


def _serve(a: argparse.Namespace) -> int:

    from services.app import compose
    from services.local import start_local_serve

    # every refusal of the args (e.g. verifiers at TP > 1) before anything starts
    serve_config_from(a, a.redis_url or DEFAULT_ARGS["redis_url"])
    for port in (a.http_port, a.grpc_port):
        _ensure_free(a.host, port)
    with ExitStack() as stack:
        if a.mps:  # before Ray starts: its workers inherit the daemon's pipe directory
            _start_mps(stack, a.device)
        redis_url = a.redis_url or _embedded_redis(stack)
        config = serve_config_from(a, redis_url)
        args = config["applications"][0]["args"]
        replicas = 1 + args["num_decoders"] + args["num_verifiers"]
        cpus = os.cpu_count() or 1
        start_local_serve(stack, config)
        # share this machine's CPUs between the replicas instead of waiting for more
        run_app(compose(args, replica_cpus=min(1.0, cpus / replicas)), name=APP_NAME,
                route_prefix="/")
        host = "127.0.0.1" if a.host == "0.0.0.0" else a.host
        print(f"detserve: serving {args['model']} ({args['mode']}) at "
              f"http://{host}:{args['http_port']}/v1 and grpc {host}:{args['grpc_port']}; "
              "Ctrl-C stops", flush=True)
        _wait_for_signal()
        print("detserve: shutting down", flush=True)
    return 0


def run_app(app: Any, **options: Any) -> None:
    """``serve.run(app, **options)``; a failed deployment's error also carries each
    deployment's status message (what its replicas hit), where Serve names only the
    deployments."""
    from ray import serve

    try:
        serve.run(app, **options)
    except RuntimeError as e:
        try:
            apps = serve.status().applications
        except Exception:  # (the controller may be gone with the failure)
            raise e from None
        why = "".join(f"\n  {name} {d.status}: {d.message}" for status in apps.values()
                      for name, d in status.deployments.items() if d.message)
        raise RuntimeError(f"{e}{why}") from e


def _stop_signals() -> list[int]:
    """Handle SIGINT (Ctrl-C) and SIGTERM from now on (a background job started by a shell
    has SIGINT ignored, so both are handled explicitly): the returned list collects them.
    The handler only records the signal: it runs on the main thread between two bytecodes,
    and one that took a lock (``threading.Event.set``) could deadlock against the wait it
    interrupted."""
    received: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    return received


def _wait_for_signal(received: list[int] | None = None, poll_s: float = 0.5) -> int:
    """Block until a stop signal arrives (``_stop_signals``); returns it."""
    received = _stop_signals() if received is None else received
    while not received:
        time.sleep(poll_s)
    return received[0]


def _ensure_free(host: str, port: int) -> None:
    """Ray Serve's proxies bind with SO_REUSEPORT: a second server on a taken port would
    start and silently share its connections with the first. Refuse instead."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise RuntimeError(f"port {port} is in use ({e.strerror}); pick another "
                               "with --port / --grpc-port") from e


def _start_mps(stack: ExitStack, device: str) -> None:
    """Start a CUDA MPS control daemon for this server (``--mps``) unless the one named by
    ``CUDA_MPS_PIPE_DIRECTORY`` (or the default one) runs; ``stack`` stops it.

    MPS clients number devices relative to the daemon's own ``CUDA_VISIBLE_DEVICES``, while
    Ray hands each replica host-wide GPU ids; so the daemon sees every GPU, and a server
    given GPUs 2 and 3 finds them as 2 and 3. Unless the user names a pipe directory, each
    server gets one of its own, so servers beside each other on one host neither share a
    daemon nor stop one another's."""
    from services.verifier.deployment import MPS_LOG_DEFAULT, MPS_PIPE_DEFAULT, mps_running

    if device != "cuda":
        raise SystemExit("detserve serve: --mps needs --device cuda")
    if mps_running():
        print("detserve: an MPS daemon is already running; using it", flush=True)
        return
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        raise SystemExit("detserve serve: --mps needs nvidia-cuda-mps-control (the CUDA "
                         "driver's MPS binaries) on PATH")
    own = f"-{os.getpid()}" if "CUDA_MPS_PIPE_DIRECTORY" not in os.environ else ""
    pipe = os.environ.setdefault("CUDA_MPS_PIPE_DIRECTORY", MPS_PIPE_DEFAULT + own)
    logs = os.environ.setdefault("CUDA_MPS_LOG_DIRECTORY", MPS_LOG_DEFAULT + own)
    for d in (pipe, logs):
        os.makedirs(d, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    done = subprocess.run([exe, "-d"], capture_output=True, text=True, timeout=30, env=env)
    if done.returncode != 0:
        shutil.rmtree(pipe, ignore_errors=True)
        raise SystemExit(f"detserve serve: the MPS daemon did not start: "
                         f"{(done.stderr or done.stdout).strip()}")
    print(f"detserve: MPS daemon started (pipe directory {pipe})", flush=True)

    def stop() -> None:
        subprocess.run([exe], input="quit\n", text=True, capture_output=True, timeout=30,
                       env=env)
        shutil.rmtree(pipe, ignore_errors=True)

    stack.callback(stop)


def _embedded_redis(stack: ExitStack) -> str:
    from services.redis_server import EmbeddedRedis

    # supervised: restarted (same port and password, empty) if it dies; the cluster's
    # processes write their records again
    redis = stack.enter_context(EmbeddedRedis()).supervise()
    print(f"detserve: embedded Redis at {redis.address} (password-protected, supervised)",
          flush=True)
    return redis.url
