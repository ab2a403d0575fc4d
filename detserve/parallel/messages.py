"""The messages rank 0 sends its tensor-parallel workers over their pipes (one dataclass
per kind; ``executor`` describes the protocol)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from detserve.config import EngineConfig
from detserve.executor.attention import RowSegment
from detserve.executor.gemm_classes import Alignment
from detserve.executor.runner import PenaltyRow, PromptRows
from detserve.lane import LanePass
from detserve.numerics import LaneNumerics
from detserve.sampler import SamplingSpec

# a fresh worker imports torch and loads the whole checkpoint before it answers
STARTUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to join: the engine's config, its rank and device, the store's
    address and the group's name, and rank 0's thread count (a CPU product's bits may
    depend on it)."""

    config: EngineConfig
    rank: int
    device: str
    host: str
    port: int
    group: str
    threads: int


@dataclass(frozen=True)
class Start:
    """Build the runner: rank 0's resolved numerics and GEMM alignment (CUDA)."""

    numerics: LaneNumerics
    alignment: Alignment | None


@dataclass(frozen=True)
class FeedRows:
    """A step fed tokens still on the device: rank 0 broadcasts the tensor right after
    this message (``shape`` and ``dtype`` say what to receive); ``pairs`` as in ``Feed``."""

    shape: tuple[int, ...]
    dtype: str
    pairs: list[tuple[int, int]]


@dataclass(frozen=True)
class BatchStep:
    """``ModelRunner.launch_batch``'s arguments."""

    segments: list[RowSegment]
    sample_specs: list[SamplingSpec | None]
    batch_invariant: bool
    align_decode: bool
    feed: FeedRows | None
    penalties: Sequence[PenaltyRow | None]
    prompt_rows: Sequence[PromptRows | None]


@dataclass(frozen=True)
class LaneStep:
    lane_pass: LanePass


@dataclass(frozen=True)
class EnableGraphs:
    """``ModelRunner.enable_cuda_graphs``' arguments: every rank captures at once (the
    captures run the collectives)."""

    decode: str | None
    lane: bool
    max_batch: int
    max_blocks: int
    step_rows: int
    plain: bool


# (block table, start, end): positions of one sequence, as ``KVPool.slots_of`` takes them
Span = tuple[tuple[int, ...], int, int]


@dataclass(frozen=True)
class WriteKV:
    """Store whole-head K/V rows at ``spans``: rank 0 broadcasts the rows
    ``[layers, 2, positions, kv_heads, head_dim]`` (``kv_heads`` the whole model's) right
    after this message; each rank keeps its own heads (``parallel.kv_rows``)."""

    spans: tuple[Span, ...]
    kv_heads: int


@dataclass(frozen=True)
class ReadKV:
    """Read the K/V rows at ``spans``: each rank reads its heads, pads them to ``width``
    heads and joins an all-gather, from which rank 0 assembles whole heads."""

    spans: tuple[Span, ...]
    width: int


@dataclass(frozen=True)
class Stop:
    pass


Message = Start | BatchStep | LaneStep | EnableGraphs | WriteKV | ReadKV | Stop
