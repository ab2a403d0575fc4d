"""The Ray Serve application: ``build_app(args)`` (the contract of services.serve_config).

    Router(decoder handle[, verifier pool])  <- HTTP :8000 and gRPC :9000 ingress
    Decoder x num_decoders                   <- one engine each (tensor_parallel_size GPUs
                                                when device == cuda)
    Verifier x num_verifiers                 <- lane executors (services.verifier)

Replica placement set here is the local default; KubeRay overlays override it per
deployment. The Verifier deployment is bound only when ``services.verifier.deployment``
is importable; decoders then reach it through the Redis registry, and otherwise verify
in-process.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from services.decoder.deployment import Decoder
from services.router.deployment import Router
from services.router.limits import ServingLimits
from services.serve_config import decoder_gpus, validate_args, verifier_gpus, verifiers_deployed

log = logging.getLogger(__name__)
REQUEST_ROUTER = "services.router.request_router:PinningRouter"


def build_app(args: Mapping[str, Any]) -> serve.Application:
    return compose(args)


def compose(args: Mapping[str, Any], *, limits: ServingLimits | None = None,
            replica_cpus: float = 1.0) -> serve.Application:
    """``build_app`` with knobs tests and benchmarks need: router limits, and the CPUs each
    replica reserves (a fraction packs a whole cluster onto a small machine)."""
    args = validate_args(args)
    decoder = _decoder(args, replica_cpus).bind(args)
    verifier = _verifier(args, replica_cpus)
    router = Router.options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": replica_cpus})
    return router.bind(args, decoder, limits, verifier)  # type: ignore[no-any-return]


def _decoder(args: Mapping[str, Any], num_cpus: float) -> Any:
    return Decoder.options(  # type: ignore[attr-defined]
        num_replicas=args["num_decoders"],
        max_ongoing_requests=4 * args["max_num_seqs"],
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": decoder_gpus(args)},
        request_router_config=RequestRouterConfig(
            request_router_class=REQUEST_ROUTER),  # type: ignore[arg-type]
    )


def _verifier(args: Mapping[str, Any], num_cpus: float) -> Any:
    if not verifiers_deployed(args):
        return None
    try:
        module = importlib.import_module("services.verifier.deployment")
    except ModuleNotFoundError as e:
        if e.name not in ("services.verifier", "services.verifier.deployment"):
            raise
        log.warning("no verifier deployment (%s): decoders verify in-process", e)
        return None
    dedicated = bool(args.get("dedicated_verifiers", False))
    gpus = verifier_gpus(args)
    return module.Verifier.options(
        num_replicas=args["num_verifiers"],
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": gpus},
    ).bind(model=args["model"], redis_url=args["redis_url"], dtype=args["dtype"],
           device=args["device"], sm_fraction=0.0 if dedicated else gpus,
           confine=bool(args.get("verifier_confine", False)),
           dedicated_blocks=_dedicated_blocks(args) if dedicated else 0,
           tensor_parallel_size=int(args.get("verifier_tensor_parallel_size", 1)))


def _dedicated_blocks(args: Mapping[str, Any]) -> int:
    """A dedicated verifier's own KV pool: on CUDA what its GPU holds after the model
    (-1: measured there); on CPU as many blocks as all the decoders' pools."""
    if args["device"] == "cuda":
        return -1
    from services.serve_config import engine_config

    return args["num_decoders"] * engine_config(args, read_checkpoint=False).cache.num_blocks
