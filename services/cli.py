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

from detserve.config import DTYPE_CHOICES, MODES, SchedulerConfig
from services.serve_config import APP_NAME, DEFAULT_ARGS


def register_detserve_commands(subcommand: Callable[..., Any]) -> None:
    subcommand("serve", "serve the OpenAI-compatible API locally (Ray Serve)", _args)(_serve)


def _args(p: argparse.ArgumentParser) -> None:
    d = DEFAULT_ARGS
    p.add_argument("--model", default=d["model"],
                   help="HF folder, .gguf file, or 'smollm2' (fetched once; default)")
    p.add_argument("--mode", default=d["mode"], choices=MODES)
    p.add_argument("--device", default=d["device"], choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=d["dtype"], choices=DTYPE_CHOICES,
                   help="auto (default): float32 on CPU; on CUDA the checkpoint's bfloat16 or "
                        "float16, else bfloat16")
    p.add_argument("--verify-window", "-W", type=int, default=d["verify_window"])
    p.add_argument("--verify-group", "-G", type=int, default=d["verify_group"])
    p.add_argument("--num-decoders", type=int, default=d["num_decoders"])
    p.add_argument("--num-verifiers", type=int, default=d["num_verifiers"],
                   help="verifier replicas; 0 verifies inside each decoder")
    p.add_argument("--verifier-gpu-fraction", type=float, default=None,
                   help="GPU share of a co-located verifier (default: 0 on CPU, 0.25 on CUDA)")
    p.add_argument("--max-model-len", type=int, default=d["max_model_len"])
    p.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"])
    p.add_argument("--fastpath-perturbation", type=float, default=0.0,
                   help="fault injection: probability of corrupting a fast-path token")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens a streamed chunk gathers before it is sent (first and last "
                        "chunks go at once); > 1 costs the decoder fewer messages per step")
    p.add_argument("--no-pipeline-lane-prefill", action="store_true",
                   help="send a long deterministic prompt's next chunk to the verifier only "
                        "once the previous chunk came back (default: chunks pipeline)")
    p.add_argument("--no-lane-partial-windows", action="store_true",
                   help="a lane pass's spare rows stay padding instead of verifying the "
                        "candidates so far of deterministic sequences mid-window (default: "
                        "they do)")
    p.add_argument("--lane-bound-fraction", type=float, default=None,
                   help="a decoder step gives the GPU to the lane pass in flight when more "
                        "than this share of its sequences wait on the lane (1: never; "
                        f"default {SchedulerConfig.lane_bound_fraction})")
    p.add_argument("--parked-seq-headroom", type=float, default=None,
                   help="while deterministic sequences are parked on the lane, a decoder runs "
                        "as many more, up to this share of --max-num-seqs (0: none; "
                        f"default {SchedulerConfig.parked_seq_headroom})")
    p.add_argument("--lane-prefill-ahead", type=int, default=None,
                   help="a lane pass's spare rows take the prompts of deterministic requests "
                        "still queued, admitted ahead of the queue while at most this many "
                        "lane sequences wait for their prompt's lane prefill (0: off; "
                        f"default {SchedulerConfig.lane_prefill_ahead})")
    p.add_argument("--lane-prefill-lookahead", type=int, default=None,
                   help="--lane-prefill-ahead takes prompts among the first this many queued "
                        "requests, so a deterministic request moves ahead of at most that "
                        "many others; the queue's length or more lets deterministic traffic "
                        "pass all others (a priority policy; default "
                        f"{SchedulerConfig.lane_prefill_lookahead})")
    p.add_argument("--prefill-batch-tokens", type=int, default=None,
                   help="while others decode, new prompts wait until this many of their "
                        "tokens are pending (at most 8 steps): fewer eager steps with prefill "
                        "rows; 0: never wait (default: max_num_batched_tokens / 4 on CUDA, 0 "
                        "on CPU)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="decoder replicas' Python thread switch interval in seconds (default: "
                        "Python's 0.005): how long their event loop may keep the GIL from the "
                        "engine thread")
    p.add_argument("--verifier-confine", action="store_true",
                   help="cuda: confine each verifier's lane kernels to its GPU share (an MPS "
                        "thread percentage under the MPS daemon, else a green context). Off "
                        "by default: the lane uses every SM, since without MPS the two "
                        "processes' kernels time-slice, and under a capped MPS share cuBLAS "
                        "picks other reduction orders than the decoder's (windows roll back)")
    p.add_argument("--mps", action="store_true",
                   help="cuda: start a CUDA MPS control daemon for this server unless one "
                        "runs (stopped on exit), so that the decoders' and the verifiers' "
                        "kernels run side by side on a shared GPU instead of time-slicing "
                        "(an 8B served llm42 run went from 0.87x to 0.99x of the offline "
                        "engine: docs/benchmarks/gpu/README.md)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: --model)")
    p.add_argument("--deterministic-model-name", default=None,
                   help="a second name of the model, listed by /v1/models, whose requests "
                        "are all deterministic (default: the served name + ':deterministic')")
    p.add_argument("--deterministic-by-default", action="store_true",
                   help="requests that do not say otherwise are deterministic (a request "
                        "opts out with is_deterministic: false or the header "
                        "X-Detserve-Deterministic: false)")
    p.add_argument("--host", default="0.0.0.0", help="HTTP bind address")
    p.add_argument("--port", type=int, default=d["http_port"], help="HTTP port")
    p.add_argument("--grpc-port", type=int, default=d["grpc_port"])
    p.add_argument("--redis-url", default=None,
                   help="use this Redis instead of starting an embedded one")


def serve_config_from(a: argparse.Namespace, redis_url: str) -> dict[str, Any]:
    from services.serve_config import default_serve_config

    fraction = a.verifier_gpu_fraction
    if fraction is None:
        fraction = 0.25 if a.device == "cuda" and a.num_verifiers else 0.0
    overrides: dict[str, Any] = dict(
        model=a.model, mode=a.mode, device=a.device, dtype=a.dtype,
        verify_window=a.verify_window, verify_group=a.verify_group,
        num_decoders=a.num_decoders, num_verifiers=a.num_verifiers,
        verifier_gpu_fraction=fraction, redis_url=redis_url, http_port=a.port,
        grpc_port=a.grpc_port, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs)
    if a.fastpath_perturbation:
        overrides["fastpath_perturbation"] = a.fastpath_perturbation
    if a.stream_interval != 1:
        overrides["stream_interval"] = a.stream_interval
    if a.no_pipeline_lane_prefill:
        overrides["pipeline_lane_prefill"] = False
    if a.no_lane_partial_windows:
        overrides["lane_partial_windows"] = False
    if a.switch_interval is not None:
        overrides["switch_interval"] = a.switch_interval
    if a.verifier_confine:
        overrides["verifier_confine"] = True
    for name in ("served_model_name", "deterministic_model_name"):
        if getattr(a, name) is not None:
            overrides[name] = getattr(a, name)
    if a.deterministic_by_default:
        overrides["deterministic_by_default"] = True
    for name in ("lane_bound_fraction", "parked_seq_headroom"):
        if getattr(a, name) is not None:
            overrides[name] = getattr(a, name)
    for name in ("lane_prefill_ahead", "lane_prefill_lookahead", "prefill_batch_tokens"):
        if getattr(a, name) is not None:
            overrides[name] = getattr(a, name)
    return default_serve_config(http_host=a.host, **overrides)


def _serve(a: argparse.Namespace) -> int:
    from ray import serve

    from services.app import compose
    from services.local import start_local_serve

    for port in (a.port, a.grpc_port):
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
        serve.run(compose(args, replica_cpus=min(1.0, cpus / replicas)), name=APP_NAME,
                  route_prefix="/")
        host = "127.0.0.1" if a.host == "0.0.0.0" else a.host
        print(f"detserve: serving {args['model']} ({args['mode']}) at "
              f"http://{host}:{args['http_port']}/v1 and grpc {host}:{args['grpc_port']}; "
              "Ctrl-C stops", flush=True)
        _wait_for_signal()
        print("detserve: shutting down", flush=True)
    return 0


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
    """Start the CUDA MPS control daemon (``--mps``) unless one runs; ``stack`` stops it."""
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
    pipe = os.environ.setdefault("CUDA_MPS_PIPE_DIRECTORY", MPS_PIPE_DEFAULT)
    logs = os.environ.setdefault("CUDA_MPS_LOG_DIRECTORY", MPS_LOG_DEFAULT)
    for d in (pipe, logs):
        os.makedirs(d, exist_ok=True)
    done = subprocess.run([exe, "-d"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        shutil.rmtree(pipe, ignore_errors=True)
        raise SystemExit(f"detserve serve: the MPS daemon did not start: "
                         f"{(done.stderr or done.stdout).strip()}")
    print(f"detserve: MPS daemon started (pipe directory {pipe})", flush=True)

    def stop() -> None:
        subprocess.run([exe], input="quit\n", text=True, capture_output=True, timeout=30)
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
