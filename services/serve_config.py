"""The Ray Serve application config (serveConfigV2) shared by `detserve serve` and KubeRay.

One function, `default_serve_config`, builds the config dict that `serve.run`/`serve deploy`
take locally and that `deploy/k8s` embeds, as YAML, in the RayService's `serveConfigV2`.
Pure dict building and validation: no Ray import, so it runs (and is tested) anywhere.

Contract with the application (`services.app:build_app`):
- `build_app(args)` receives `applications[0]["args"]`, whose keys are `ARG_NAMES` plus
  any of `OPTIONAL_ARGS` that were given: each an option of `EngineConfig` (its nested
  configs' by their own names) or of `ServeConfig`, declared once there with its help.
- Its deployments are named `ROUTER`, `DECODER` and `VERIFIER`. Ray Serve rejects a config
  that overrides a deployment the application does not have, so these names are part of
  the contract as soon as a caller passes `deployments` (the Kubernetes overlays do, to
  place replicas on worker groups and to autoscale decoders).
- The router's gRPC API is served on `grpc_port`, through the servicer functions in
  `GRPC_SERVICER_FUNCTIONS`: by the router replica itself under direct ingress (local
  runs, `ray_serve_env`), by Ray Serve's gRPC proxy otherwise (Kubernetes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from detserve.config import DTYPE_CHOICES, MODES, EngineConfig, opt
from detserve.flags import Option, engine_kwargs, engine_options, options

APP_NAME = "detserve"
IMPORT_PATH = "services.app:build_app"
ROUTE_PREFIX = "/"
ROUTER, DECODER, VERIFIER = "Router", "Decoder", "Verifier"
DEPLOYMENT_NAMES = (ROUTER, DECODER, VERIFIER)
GRPC_SERVICER_FUNCTIONS: tuple[str, ...] = (
    "services.router.grpc_api:add_CompletionsServicer_to_server",
)
# called by Ray Serve in each process before it starts an HTTP server (proxy or direct
# ingress): broken HTTP framing answered with an OpenAI error body
HTTP_PROXY_CALLBACK = "services.router.http_framing:proxy_callback"
DEVICES = ("cpu", "cuda")
LANE_MODES = ("llm42", "lane_only")  # the modes whose lane a Verifier replica may run
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")



@dataclass(frozen=True)
class ServeConfig:
    """The serving options (the engine's are ``EngineConfig``'s): each an app arg and a
    ``detserve serve`` flag of the same name."""

    num_decoders: int = opt(1, "decoder replicas (each an engine)")
    num_verifiers: int = opt(1, "verifier replicas; 0 verifies inside each decoder")
    verifier_gpu_fraction: float = opt(
        0.0, "GPU share of a co-located verifier (0 on CPU, and with dedicated verifiers; "
             "detserve serve: 0.25 on CUDA when not given)")
    dedicated_verifiers: bool = opt(
        False, "each verifier replica gets a device of its own (cuda: a whole GPU; cpu: it "
               "registers as another host) and verifies decoders on other GPUs and hosts, "
               "keeping its own copy of the lane K/V, moved over NCCL (gloo on cpu); off: "
               "each verifier shares a decoder's GPU and maps its KV pool")
    verifier_tensor_parallel_size: int = opt(
        1, "ranks each dedicated verifier replica's lane runs over (cuda: that many whole "
           "GPUs of its own), for lanes that do not fit one GPU; needs dedicated_verifiers "
           "and tp_invariant_lane (whose bits do not depend on the TP size)")
    redis_url: str = opt("redis://127.0.0.1:6379/0",
                         "Redis of the registry (detserve serve: an embedded one when not "
                         "given)")
    http_port: int = opt(8000, "HTTP port of the OpenAI API", aliases=("--port",))
    grpc_port: int = opt(9000, "gRPC port of the Completions API")
    stream_interval: int = opt(
        1, "tokens a streamed chunk gathers before it is sent (first and last chunks go at "
           "once); > 1 costs the decoder fewer messages per step")
    verifier_confine: bool = opt(
        False, "cuda: confine each verifier's lane kernels to its GPU share (an MPS thread "
               "percentage under the MPS daemon, else a green context); off: the lane uses "
               "every SM (services/verifier/deployment.py says why)")
    served_model_name: str | None = opt(
        None, "the model's name in the API (default: --model)")
    deterministic_model_name: str | None = opt(
        None, "a second name of the model, listed by /v1/models, whose requests are all "
              "deterministic (default: the served name + ':deterministic')")
    deterministic_by_default: bool = opt(
        False, "requests that do not say otherwise are deterministic (a request opts out "
               "with is_deterministic: false or the header X-Detserve-Deterministic: false)")
    switch_interval: float = opt(
        0.0, "decoder replicas' Python thread switch interval in seconds (0: Python's own): "
             "how long their event loop may keep the GIL from the engine thread")


# every app arg: the engine's options and the serving ones, by name
OPTIONS: Mapping[str, Option] = {**engine_options(), **options(ServeConfig)}
# the keys every config carries, in this order (the KubeRay manifests list them)
ARG_NAMES = ("model", "mode", "device", "dtype", "verify_window", "verify_group",
             "num_decoders", "num_verifiers", "verifier_gpu_fraction", "redis_url",
             "http_port", "grpc_port", "max_model_len", "max_num_seqs")
# a served engine's length is concrete (the router's limits are built from it), not the
# model's: the offline default
SERVE_ENGINE_DEFAULTS: Mapping[str, Any] = {"max_model_len": 2048}
DEFAULT_ARGS: Mapping[str, Any] = {name: SERVE_ENGINE_DEFAULTS.get(name, OPTIONS[name].default)
                                   for name in ARG_NAMES}
# accepted when given, never added to a default config (absent: the option's default)
OPTIONAL_ARGS: Mapping[str, Any] = {name: o.default for name, o in OPTIONS.items()
                                    if name not in ARG_NAMES}


def engine_config(args: Mapping[str, Any], *, read_checkpoint: bool = True) -> EngineConfig:
    """The decoders' engine config of validated app args. ``read_checkpoint`` False: dtype
    "auto" stands in as float32, so no checkpoint is read (validation, e.g. when rendering
    manifests on a machine without the model)."""
    kw = engine_kwargs(args)
    if not read_checkpoint and kw.get("dtype") == "auto":
        kw["dtype"] = "float32"
    return EngineConfig.create(args["model"], **kw)


def serve_options(args: Mapping[str, Any]) -> ServeConfig:
    """The serving options of validated app args."""
    return ServeConfig(**{k: v for k, v in args.items() if k in ServeConfig.__dataclass_fields__})


@dataclass(frozen=True)
class Autoscaling:
    """Ray Serve `autoscaling_config` of one deployment (a subset of its fields)."""

    min_replicas: int
    max_replicas: int
    initial_replicas: int
    target_ongoing_requests: float = 8.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("min_replicas", "max_replicas", "initial_replicas"):
            _check_int(name, getattr(self, name), lo=0)
        if not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(
                "autoscaling needs min_replicas <= initial_replicas <= max_replicas, got "
                f"{self.min_replicas} <= {self.initial_replicas} <= {self.max_replicas}"
            )
        if self.max_replicas < 1:
            raise ValueError("autoscaling max_replicas must be >= 1")
        for name in ("target_ongoing_requests", "upscale_delay_s", "downscale_delay_s"):
            _check_number(name, getattr(self, name), lo=0.0)
        if self.target_ongoing_requests <= 0:
            raise ValueError("target_ongoing_requests must be > 0")

    def to_dict(self) -> dict[str, Any]:
        return {
            "min_replicas": self.min_replicas,
            "initial_replicas": self.initial_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
        }


@dataclass(frozen=True)
class DeploymentOverride:
    """Per-deployment options that the config sets over what `build_app` chose.

    `ray_actor_options` replaces the code's options as a whole (Ray Serve semantics), so an
    override states the complete placement: CPUs, GPUs (fractional for co-location) and
    custom resources that pin the replica to a worker group.
    """

    name: str
    num_cpus: float
    num_gpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)
    max_ongoing_requests: int | None = None
    autoscaling: Autoscaling | None = None

    def __post_init__(self) -> None:
        if self.name not in DEPLOYMENT_NAMES:
            raise ValueError(
                f"unknown deployment {self.name!r}; expected one of {', '.join(DEPLOYMENT_NAMES)}"
            )
        _check_number("num_cpus", self.num_cpus, lo=0.0)
        _check_number("num_gpus", self.num_gpus, lo=0.0)
        for key, amount in self.resources.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"custom resource names must be non-empty strings, got {key!r}")
            _check_number(f"resources[{key!r}]", amount, lo=0.0)
        if self.max_ongoing_requests is not None:
            _check_int("max_ongoing_requests", self.max_ongoing_requests, lo=1)
        if self.autoscaling is not None and (
            self.max_ongoing_requests is None
            or self.max_ongoing_requests < self.autoscaling.target_ongoing_requests
        ):
            # Serve never scales up a deployment whose replicas refuse requests before
            # reaching the target load; it only logs a warning, so refuse it here.
            raise ValueError(
                f"{self.name}: autoscaling needs max_ongoing_requests >= "
                f"target_ongoing_requests ({self.autoscaling.target_ongoing_requests})"
            )

    def to_dict(self) -> dict[str, Any]:
        actor_options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            actor_options["resources"] = dict(sorted(self.resources.items()))
        out: dict[str, Any] = {"name": self.name, "ray_actor_options": actor_options}
        if self.max_ongoing_requests is not None:
            out["max_ongoing_requests"] = self.max_ongoing_requests
        if self.autoscaling is not None:
            # "auto" tells Serve to ignore the replica count set in code: the autoscaling
            # config (initial_replicas included) decides.
            out["num_replicas"] = "auto"
            out["autoscaling_config"] = self.autoscaling.to_dict()
        return out


def validate_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """Check the application args; returns a plain dict in `ARG_NAMES` order.

    Raises ValueError naming the offending key. Unknown and missing keys are errors, so a
    typo in an overlay cannot silently fall back to a default.
    """
    unknown = sorted(set(args) - set(ARG_NAMES) - set(OPTIONAL_ARGS))
    if unknown:
        raise ValueError(f"unknown serve args {unknown}; expected a subset of "
                         f"{list(ARG_NAMES) + list(OPTIONAL_ARGS)}")
    missing = [name for name in ARG_NAMES if name not in args]
    if missing:
        raise ValueError(f"missing serve args {missing}")
    model = args["model"]
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"model must be a non-empty string, got {model!r}")
    _check_choice("mode", args["mode"], MODES)
    _check_choice("device", args["device"], DEVICES)
    _check_choice("dtype", args["dtype"], DTYPE_CHOICES)
    for name in ("verify_window", "verify_group", "num_decoders", "max_model_len",
                 "max_num_seqs"):
        _check_int(name, args[name], lo=1)
    _check_int("num_verifiers", args["num_verifiers"], lo=0)
    fraction = args["verifier_gpu_fraction"]
    _check_number("verifier_gpu_fraction", fraction, lo=0.0, hi=1.0)
    if args["device"] == "cpu" and fraction != 0.0:
        raise ValueError("verifier_gpu_fraction must be 0 when device is 'cpu'")
    dedicated = bool(args.get("dedicated_verifiers", False))
    if dedicated and fraction != 0.0:
        raise ValueError("verifier_gpu_fraction must be 0 with dedicated_verifiers (each "
                         "verifier has a GPU of its own)")
    if (args["device"] == "cuda" and args["num_verifiers"] > 0 and fraction == 0.0
            and not dedicated):
        raise ValueError("verifier_gpu_fraction must be > 0 when verifiers share the "
                         "decoders' GPUs (or set dedicated_verifiers)")
    redis_url = args["redis_url"]
    if not isinstance(redis_url, str) or not redis_url.startswith(REDIS_SCHEMES):
        raise ValueError(f"redis_url must start with one of {REDIS_SCHEMES}, got {redis_url!r}")
    for name in ("http_port", "grpc_port"):
        _check_int(name, args[name], lo=1, hi=65535)
    if args["http_port"] == args["grpc_port"]:
        raise ValueError("http_port and grpc_port must differ")
    if "stream_interval" in args:
        _check_int("stream_interval", args["stream_interval"], lo=1, hi=4096)
    if "lane_prefill_ahead" in args:  # (queued prompts prefilling in lane rows at once)
        _check_int("lane_prefill_ahead", args["lane_prefill_ahead"], lo=0, hi=4096)
    if "lane_prefill_lookahead" in args:  # (queue positions a prompt may move ahead by)
        _check_int("lane_prefill_lookahead", args["lane_prefill_lookahead"], lo=1, hi=1 << 20)
    if "prefill_batch_tokens" in args:  # (up to a whole model length of prompt tokens)
        _check_int("prefill_batch_tokens", args["prefill_batch_tokens"], lo=0,
                   hi=args["max_model_len"])
    for name in ("served_model_name", "deterministic_model_name"):
        value = args.get(name)
        if value is not None and (not value or any(c.isspace() for c in value)):
            raise ValueError(f"{name} must be a non-empty string without spaces, got {value!r}")
    if args.get("deterministic_model_name") == (args.get("served_model_name") or args["model"]):
        raise ValueError("deterministic_model_name must differ from the served model name")
    for name in ("switch_interval", "lane_bound_fraction", "parked_seq_headroom",
                 "fastpath_perturbation"):
        if name in args:  # (switch_interval in seconds)
            _check_number(name, args[name], lo=0.0, hi=1.0)
    for name, value in args.items():
        OPTIONS[name].check(value)
    try:
        engine = engine_config(args, read_checkpoint=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad engine options: {e}") from None
    _check_verifiers(args, engine)
    return {name: args[name] for name in (*ARG_NAMES, *OPTIONAL_ARGS) if name in args}


def _check_verifiers(args: Mapping[str, Any], engine: EngineConfig) -> None:
    """The verifier replicas against what the decoders' engine can hand them (the engine's
    own rule, ``EngineConfig.check_outside_lane``) and what can reach its K/V: a decoder
    at tensor_parallel_size > 1 shards its pool over its ranks, so only a dedicated
    verifier (K/V transfer) verifies it; without verifier replicas it verifies on its own
    ranks."""
    tp = engine.tensor_parallel_size
    if not verifiers_deployed(args):
        if args["mode"] == "llm42" and tp == 1:
            raise ValueError("mode 'llm42' needs num_verifiers >= 1")
        return
    try:
        engine.check_outside_lane()
    except ValueError as e:
        raise ValueError(f"{e}: num_verifiers must be 0 (--num-verifiers 0; each decoder "
                         "verifies on its own ranks), or set --tp-invariant-lane with "
                         "--dedicated-verifiers") from None
    vtp = int(args.get("verifier_tensor_parallel_size", 1))
    if vtp < 1 or vtp & (vtp - 1):
        raise ValueError("verifier_tensor_parallel_size must be a power of two")
    if vtp > 1 and not (args.get("dedicated_verifiers", False) and engine.tp_invariant_lane):
        raise ValueError(f"verifier_tensor_parallel_size {vtp}: a verifier over several ranks "
                         "shards its K/V (it maps no decoder's pool) and gives the decoders' "
                         "bits only with the TP-invariant lane; set --dedicated-verifiers and "
                         "--tp-invariant-lane")
    if tp > 1 and not args.get("dedicated_verifiers", False):
        # on CUDA, besides: Ray gives an actor more than one GPU only whole, no share is left
        whole = " and holds its GPUs whole" if args["device"] == "cuda" else ""
        raise ValueError(f"a decoder at tensor_parallel_size {tp} shards its KV pool over its "
                         f"ranks (it cannot be mapped){whole}: its verifiers cannot share "
                         "them; set --dedicated-verifiers (K/V transfer), or --num-verifiers 0")


def verifiers_deployed(args: Mapping[str, Any]) -> bool:
    """Whether the app has Verifier replicas: a mode with a lane, and num_verifiers > 0."""
    return bool(args["num_verifiers"] > 0 and args["mode"] in LANE_MODES)


def decoder_gpus(args: Mapping[str, Any]) -> float:
    """GPUs one decoder replica reserves (Ray's ``num_gpus``). On CUDA its engine's ranks
    need ``tensor_parallel_size`` whole GPUs: Ray then makes exactly those visible to the
    replica, and its ranks run on cuda:0..N-1 of them. At TP=1 a co-located verifier
    takes ``verifier_gpu_fraction`` of the decoder's GPU."""
    if args["device"] != "cuda":
        return 0.0
    tp = int(args.get("tensor_parallel_size", 1))
    if tp > 1:
        return float(tp)
    shares = (verifiers_deployed(args) and not args.get("dedicated_verifiers", False)
              and args["verifier_gpu_fraction"] < 1.0)
    return 1.0 - args["verifier_gpu_fraction"] if shares else 1.0


def verifier_gpus(args: Mapping[str, Any]) -> float:
    """GPUs one verifier replica reserves: whole ones when dedicated (one a rank), else
    its share."""
    if args["device"] != "cuda":
        return 0.0
    if args.get("dedicated_verifiers", False):
        return float(args.get("verifier_tensor_parallel_size", 1))
    return args["verifier_gpu_fraction"]


def gpus_needed(args: Mapping[str, Any]) -> float:
    """GPUs the whole app reserves: every decoder's and every deployed verifier's."""
    verifiers = args["num_verifiers"] if verifiers_deployed(args) else 0
    return args["num_decoders"] * decoder_gpus(args) + verifiers * verifier_gpus(args)


def check_gpu_count(args: Mapping[str, Any], available: float) -> None:
    """Raise RuntimeError when a cluster with ``available`` GPUs cannot hold the app's
    replicas: Ray Serve would otherwise keep them pending, and start-up would wait forever.
    (A total that suffices can still fail to pack, e.g. TP=2 decoders on one-GPU nodes;
    Ray Serve reports those replicas as pending.)"""
    needed = gpus_needed(args)
    if needed <= available + 1e-9:
        return
    tp = args.get("tensor_parallel_size", 1)
    parts = [f"{args['num_decoders']} decoders x {decoder_gpus(args):g}"
             + (f" (tensor_parallel_size {tp})" if tp > 1 else "")]
    if verifiers_deployed(args) and verifier_gpus(args):
        parts.append(f"{args['num_verifiers']} verifiers x {verifier_gpus(args):g}")
    raise RuntimeError(f"the app needs {needed:g} GPUs ({' + '.join(parts)}) but this Ray "
                       f"cluster has {available:g}; lower num_decoders or "
                       "tensor_parallel_size, or run where more GPUs are visible")


def default_serve_config(
    *,
    deployments: Sequence[DeploymentOverride] = (),
    http_host: str = "0.0.0.0",
    **overrides: Any,
) -> dict[str, Any]:
    """The serveConfigV2 dict: `DEFAULT_ARGS` updated with `overrides` (app args only).

    `deployments` adds per-deployment overrides (placement, autoscaling); local runs
    usually pass none and let `build_app` decide. The result is plain data
    (str/int/float/bool/list/dict), so `yaml.safe_dump` of it round-trips exactly.
    """
    args = validate_args({**DEFAULT_ARGS, **overrides})
    if not isinstance(http_host, str) or not http_host:
        raise ValueError(f"http_host must be a non-empty string, got {http_host!r}")
    names = [d.name for d in deployments]
    if len(set(names)) != len(names):
        raise ValueError(f"deployment overrides repeat a name: {names}")
    for d in deployments:
        if args["device"] == "cpu" and d.num_gpus != 0:
            raise ValueError(f"{d.name} asks for {d.num_gpus} GPUs but device is 'cpu'")
        if d.name == DECODER and d.autoscaling is not None:
            if d.autoscaling.initial_replicas != args["num_decoders"]:
                raise ValueError(
                    "decoder autoscaling initial_replicas must equal num_decoders "
                    f"({d.autoscaling.initial_replicas} != {args['num_decoders']})"
                )
        if d.name == DECODER and args["device"] == "cuda":
            want = decoder_gpus(args)
            if not math.isclose(d.num_gpus, want):
                raise ValueError(
                    f"Decoder num_gpus {d.num_gpus:g} must be {want:g} (tensor_parallel_size "
                    f"{args.get('tensor_parallel_size', 1)}"
                    + (", less the co-located verifier's share)" if want < 1 else ")"))
        if d.name == VERIFIER and args["device"] == "cuda":
            if args.get("dedicated_verifiers") and not math.isclose(d.num_gpus,
                                                                     verifier_gpus(args)):
                raise ValueError(f"Verifier num_gpus {d.num_gpus:g}: a dedicated verifier has "
                                 f"{verifier_gpus(args):g} GPUs of its own, one a rank "
                                 "(verifier_tensor_parallel_size)")
            if (not args.get("dedicated_verifiers")
                    and not math.isclose(d.num_gpus, args["verifier_gpu_fraction"])):
                raise ValueError(
                    f"Verifier num_gpus {d.num_gpus} must equal verifier_gpu_fraction "
                    f"{args['verifier_gpu_fraction']}"
                )
    app: dict[str, Any] = {
        "name": APP_NAME,
        "route_prefix": ROUTE_PREFIX,
        "import_path": IMPORT_PATH,
        "args": args,
    }
    if deployments:
        app["deployments"] = [d.to_dict() for d in deployments]
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": http_host, "port": args["http_port"]},
        "grpc_options": {
            "port": args["grpc_port"],
            "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS),
        },
        "applications": [app],
    }


# Ray Serve reads these when each of its processes starts: they must be in the environment
# before `ray.init` starts a local cluster (`apply_ray_serve_env`), or in the pods' env.
THROUGHPUT_ENV: Mapping[str, str] = {
    # handle calls between deployments over gRPC instead of Ray actor calls, user code on
    # the replica's own event loop, the handle's router on the caller's loop, GC frozen
    # after start-up, buffered request logs
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
}


def ray_serve_env(http_port: int, grpc_port: int, *, direct_ingress: bool = True
                  ) -> dict[str, str]:
    """Ray Serve settings for the serving path, as environment variables.

    The throughput profile and the HTTP servers' framing errors (``HTTP_PROXY_CALLBACK``),
    plus with ``direct_ingress`` the router replica itself listening
    on ``http_port`` and ``grpc_port`` (no proxy actor between the client and the router:
    every streamed chunk skips one Ray hop and one process). Direct ingress gives each
    ingress replica of a node its own port from a range; the range here is one port wide,
    so it fits one router replica per node, what ``services.app`` deploys. Without a load
    balancer in front nobody needs the drain period Ray Serve holds a stopping replica
    open for, so it is 0. Measured on CPU: docs/benchmarks/serving_overhead_cpu_tiny_direct.md
    (against serving_overhead_cpu_tiny.md, before).
    """
    env = dict(THROUGHPUT_ENV)
    env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] = HTTP_PROXY_CALLBACK
    # the controller gives a starting proxy actor this long before it kills and restarts it
    # (default 5 s): on a loaded small machine the first proxy's worker can take longer to
    # start, and `serve.start`, which waits for that very actor, then fails
    env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] = "60"
    env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1" if direct_ingress else "0"
    if direct_ingress:
        for proto, port in (("HTTP", http_port), ("GRPC", grpc_port)):
            env[f"RAY_SERVE_DIRECT_INGRESS_MIN_{proto}_PORT"] = str(port)
            env[f"RAY_SERVE_DIRECT_INGRESS_MAX_{proto}_PORT"] = str(port + 1)
        env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "0"
    return env


def apply_ray_serve_env(http_port: int, grpc_port: int, *, direct_ingress: bool = True,
                        environ: dict[str, str] | None = None) -> dict[str, str]:
    """Put ``ray_serve_env`` into ``environ`` (default ``os.environ``) before ``ray.init``.

    The ports are always set (one process may start several clusters); the profile keeps
    a value the user already exported (``RAY_SERVE_THROUGHPUT_OPTIMIZED=0`` turns it off,
    ``RAY_SERVE_ENABLE_DIRECT_INGRESS=0`` brings the proxies back). Returns what is in effect.
    """
    import os

    target = os.environ if environ is None else environ
    env = ray_serve_env(http_port, grpc_port, direct_ingress=direct_ingress)
    for key, value in env.items():
        if "_PORT" in key:
            target[key] = value
        else:
            target.setdefault(key, value)
    return {key: target[key] for key in env}


def serve_start_options(config: Mapping[str, Any], env: Mapping[str, str],
                        spare_ports: tuple[int, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``serve.start``'s ``http_options`` and ``grpc_options`` for ``config`` under ``env``.

    With direct ingress Ray Serve still runs a proxy on the head node, at ``http_options``'
    ports (a fallback route to the same router); the router replica must get the configured
    ports, so the proxy is moved to ``spare_ports`` (two free ports, HTTP and gRPC).
    """
    http, grpc = dict(config["http_options"]), dict(config["grpc_options"])
    if env.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1":
        http["port"], grpc["port"] = spare_ports
    return http, grpc


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_int(name: str, value: Any, *, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo:g}, {hi:g}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_number(name: str, value: Any, *, lo: float, hi: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo:g}, {hi:g}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
