"""A local serving cluster for the serving tests: Ray, Redis, router, decoders, verifiers.

One cluster per test module (each module's fixture calls ``serving_cluster``). The model is
a tiny random Llama, the lane small (W=8, G=4), so a whole module runs in seconds of
engine time on two CPU cores; start-up (Ray, Serve, replicas) dominates.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from model_helpers import make_random_llama

from services.redis_server import free_port
from services.router.limits import ServingLimits
from services.serve_config import default_serve_config

W, G = 8, 4
MAX_MODEL_LEN = 512


def tiny_model() -> str:
    return str(make_random_llama(max_position_embeddings=1024, num_layers=2))


@dataclass(frozen=True)
class Cluster:
    args: dict[str, Any]
    http_url: str            # http://127.0.0.1:PORT
    grpc_address: str        # 127.0.0.1:PORT
    startup_s: float
    redis: Any = None        # the EmbeddedRedis (tests kill and restart it)

    @property
    def base_url(self) -> str:
        return self.http_url + "/v1"


@contextmanager
def serving_cluster(*, limits: ServingLimits | None = None, **overrides: Any
                    ) -> Iterator[Cluster]:
    """The cluster, started once more (on other ports) if its router could not take the
    ports picked for it: ``free_port`` checks a port when it picks it, and something else
    on the machine may bind it before the router replica does (Ray Serve then reports
    the Router deployment failed, its port "in use"). A router that fails for any other
    reason fails both times."""
    from services.app import compose
    from services.local import start_local_serve
    from services.redis_server import EmbeddedRedis

    t0 = time.monotonic()
    for attempt in (1, 2):
        http_port, grpc_port = free_port(), free_port()
        with ExitStack() as stack:
            redis = stack.enter_context(EmbeddedRedis())
            settings: dict[str, Any] = dict(
                model=tiny_model(), verify_window=W, verify_group=G,
                max_model_len=MAX_MODEL_LEN, max_num_seqs=16, redis_url=redis.url,
                http_port=http_port, grpc_port=grpc_port)
            settings.update(overrides)
            config = default_serve_config(http_host="127.0.0.1", **settings)
            start_local_serve(stack, config, num_cpus=4, log_to_driver=False)
            args = config["applications"][0]["args"]
            try:
                _deploy(compose(args, limits=limits, replica_cpus=0.5))
            except RouterNotDeployed:
                if attempt == 2:
                    raise
                continue
            _wait_ready(f"http://127.0.0.1:{http_port}")
            yield Cluster(args, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}",
                          time.monotonic() - t0, redis)
            return


class RouterNotDeployed(RuntimeError):
    pass


def _deploy(app: Any) -> None:
    from ray import serve

    try:
        serve.run(app, name="detserve", route_prefix="/")
    except RuntimeError as e:
        if "Failed to update the deployments ['Router']" in str(e):
            raise RouterNotDeployed(str(e)) from e
        raise


def tp1_lane_reference(model: str, prompt: str, max_tokens: int) -> Any:
    """The offline TP=1 ``lane_only`` answer (TP-invariant lane) to a deterministic,
    seeded request (temperature 0.8, seed 5, logprobs), at one thread as a decoder replica
    runs: what a served TP decoder must give bit for bit."""
    import torch

    from detserve.llm import LLM
    from detserve.params import SamplingParams

    offline = LLM(model, mode="lane_only", verify_window=W, verify_group=G,
                  max_model_len=MAX_MODEL_LEN, tp_invariant_lane=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (ref,) = offline.generate([prompt], SamplingParams(
            max_tokens=max_tokens, temperature=0.8, seed=5, logprobs=1, ignore_eos=True,
            is_deterministic=True))
    finally:
        torch.set_num_threads(threads)
        offline.close()
    return ref


def _wait_ready(url: str, bound_s: float = 60.0) -> None:
    """Until /health answers 200 (the decoders' links found, a verifier usable), at most
    ``bound_s``: a test's first request then meets the cluster it means to test. A cluster
    that never gets there is left to the tests to report."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and not healthy(url):
        time.sleep(0.2)


def healthy(url: str) -> bool:
    """Whether the server at ``url`` answers /health with 200 now."""
    import httpx

    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
