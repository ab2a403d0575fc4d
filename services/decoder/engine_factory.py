"""Build a decoder's ``LLMEngine`` from the application args, with its verifier.

With ``num_verifiers == 0`` (or a mode without a lane) the engine verifies in-process. Otherwise
the KV pool is exported (shared memory on CPU, CUDA IPC on GPU) and lane passes go to the
Verifier pool through ``services.verifier.client``; when that package is not installed the
engine falls back to the in-process verifier, logging why. At ``tensor_parallel_size`` > 1
the same wiring holds (the serve config admits only dedicated verifiers, with
``tp_invariant_lane``): the exported pool is rank 0's, and the client moves K/V over every
rank by transfer, never asking a verifier to map it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from detserve.config import EngineConfig
from detserve.engine import LLMEngine
from detserve.model.loader import load_model
from detserve.parallel.shard import rank_weights
from services.cluster_auth import ClusterAuth
from services.serve_config import LANE_MODES, ServeConfig, engine_config, serve_options

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecoderSettings:
    """What a decoder needs of the app args (validated by ``services.serve_config``
    beforehand): its engine config and the serving options."""

    engine: EngineConfig
    serve: ServeConfig

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> DecoderSettings:
        return cls(engine_config(args), serve_options(args))

    @property
    def remote_verifier(self) -> bool:
        return self.serve.num_verifiers > 0 and self.engine.mode in LANE_MODES


def build_engine(settings: DecoderSettings, decoder_id: str, auth: ClusterAuth
                 ) -> tuple[LLMEngine, Callable[[], None]]:
    """The engine and a ``close()`` that releases what it exported; ``auth``: what the
    verifiers ask of their callers."""
    config = settings.engine
    remote = _remote_modules() if settings.remote_verifier else None
    if remote is None:
        if settings.remote_verifier:
            log.warning("services.verifier is not available: decoder %s verifies in-process",
                        decoder_id)
        engine = LLMEngine(config)
        return engine, engine.close  # (its verifier, and tensor-parallel workers if any)
    kv_handle, client, registry = remote
    reg = registry.Registry(settings.serve.redis_url)
    try:
        epoch = reg.next_epoch(decoder_id)  # makes any earlier pool of this id stale
    finally:
        reg.close()
    exporter = kv_handle.KVExporter(decoder_id, epoch)
    loaded = load_model(config.model, dtype=config.dtype, device=config.device,
                        shard=rank_weights(config.model, config.tensor_parallel_size))
    factory = client.make_verifier_factory(settings.serve.redis_url, decoder_id, exporter,
                                           loaded[2].weights_hash, auth=auth)
    engine = LLMEngine(config, loaded=loaded, kv_storage=exporter, verifier_factory=factory)

    def close() -> None:
        engine.verifier.close()
        exporter.close()

    return engine, close


def _remote_modules() -> tuple[Any, Any, Any] | None:
    try:
        return (importlib.import_module("services.kv_handle"),
                importlib.import_module("services.verifier.client"),
                importlib.import_module("services.registry"))
    except ModuleNotFoundError as e:
        log.warning("remote verification unavailable: %s", e)
        return None
