"""Build a decoder's ``LLMEngine`` from the application args, with its verifier.

With ``num_verifiers == 0`` (or a mode without a lane) the engine verifies in-process. Otherwise
the KV pool is exported (shared memory on CPU, CUDA IPC on GPU) and lane passes go to the
Verifier pool through ``services.verifier.client``; when that package is not installed the
engine falls back to the in-process verifier, logging why.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from detserve.config import SCHEDULER_FIELDS, EngineConfig, SchedulerConfig
from detserve.engine import LLMEngine
from detserve.model.loader import load_model
from services.cluster_auth import ClusterAuth

log = logging.getLogger(__name__)
LANE_MODES = ("llm42", "lane_only")


@dataclass(frozen=True)
class DecoderSettings:
    """The app args a decoder needs, validated by ``services.serve_config`` beforehand."""

    model: str
    mode: str
    device: str
    dtype: str
    verify_window: int
    verify_group: int
    max_model_len: int
    max_num_seqs: int
    num_verifiers: int
    redis_url: str
    fastpath_perturbation: float = 0.0
    seed: int = 0
    pipeline_lane_prefill: bool = True
    lane_partial_windows: bool = SchedulerConfig.lane_partial_windows
    lane_bound_fraction: float = SchedulerConfig.lane_bound_fraction
    parked_seq_headroom: float = SchedulerConfig.parked_seq_headroom
    lane_prefill_ahead: int = SchedulerConfig.lane_prefill_ahead
    lane_prefill_lookahead: int = SchedulerConfig.lane_prefill_lookahead
    # the replica's Python thread switch interval (s; 0: Python's own, 5 ms): how long the
    # event loop may hold the GIL while the engine thread waits for it after a GPU step
    switch_interval: float = 0.0
    stream_interval: int = 1  # a stream's chunk carries >= this many new tokens (not the last)
    prefill_batch_tokens: int | None = None  # None: the engine's default for its device

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> DecoderSettings:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in args.items() if k in names})

    @property
    def remote_verifier(self) -> bool:
        return self.num_verifiers > 0 and self.mode in LANE_MODES

    def engine_config(self) -> EngineConfig:
        # every scheduler option these settings carry, by name
        scheduler = {name: getattr(self, name) for name in SCHEDULER_FIELDS
                     if name in self.__dataclass_fields__}
        return EngineConfig.create(
            self.model, self.mode, device=self.device, dtype=self.dtype,
            fastpath_perturbation=self.fastpath_perturbation, seed=self.seed, **scheduler)


def build_engine(settings: DecoderSettings, decoder_id: str, auth: ClusterAuth
                 ) -> tuple[LLMEngine, Callable[[], None]]:
    """The engine and a ``close()`` that releases what it exported; ``auth``: what the
    verifiers ask of their callers."""
    config = settings.engine_config()
    remote = _remote_modules() if settings.remote_verifier else None
    if remote is None:
        if settings.remote_verifier:
            log.warning("services.verifier is not available: decoder %s verifies in-process",
                        decoder_id)
        engine = LLMEngine(config)
        return engine, engine.verifier.close
    kv_handle, client, registry = remote
    reg = registry.Registry(settings.redis_url)
    try:
        epoch = reg.next_epoch(decoder_id)  # makes any earlier pool of this id stale
    finally:
        reg.close()
    exporter = kv_handle.KVExporter(decoder_id, epoch)
    loaded = load_model(config.model, dtype=config.dtype, device=config.device)
    factory = client.make_verifier_factory(settings.redis_url, decoder_id, exporter,
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
