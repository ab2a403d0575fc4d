"""Tuning constants of the Triton kernels, in one table.

Constants marked *bits* decide a reduction order: changing one changes the bits that the
fixed-shape lane or the ``batch_invariant`` mode produce, so it must come with a bump of
``KERNEL_VERSION`` (part of the determinism-profile fingerprint). The others only move
speed. Every value is a power of two where a kernel uses it as a block size.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# Bump whenever a *bits* constant or the arithmetic of lane_attention / batch_invariant changes.
# kernels-3: the lane's tile sums as matrix products (LaneConfig.dot_sums on by default)
# kernels-4: contexts past LaneConfig.span reduce in spans merged in order
KERNEL_VERSION = "kernels-4"


def _check_pow2(owner: object, **values: int) -> None:
    for name, v in values.items():
        if v < 1 or v & (v - 1):
            raise ValueError(f"{type(owner).__name__}.{name}={v} must be a power of two")


@dataclass(frozen=True)
class MatmulConfig:
    """Persistent matmul tile; one fixed config for every M (no split-K): *bits*."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8  # L2 swizzle of tiles; speed only
    num_warps: int = 4
    num_stages: int = 4  # speed only

    def __post_init__(self) -> None:
        _check_pow2(self, block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                    num_warps=self.num_warps)
        if min(self.block_m, self.block_n, self.block_k) < 16:
            raise ValueError("tl.dot needs every matmul block dim >= 16")


@dataclass(frozen=True)
class RowConfig:
    """One row per program, reduced in chunks of ``block`` columns: *bits*."""

    block: int = 1024
    num_warps: int = 4

    def __post_init__(self) -> None:
        _check_pow2(self, block=self.block, num_warps=self.num_warps)


@dataclass(frozen=True)
class DecodeConfig:
    """Split-KV decode (flash-decoding) on the fast path; speed only."""

    block_n: int = 64  # KV tokens per inner step
    num_warps: int = 4
    num_stages: int = 2
    min_tokens_per_split: int = 256  # never split finer than this
    max_splits: int = 32
    programs_per_sm: int = 2  # stop splitting once batch * kv_heads * splits reaches this * SMs
    reduce_num_warps: int = 4

    def __post_init__(self) -> None:
        _check_pow2(self, block_n=self.block_n, num_warps=self.num_warps)
        if self.block_n < 16:
            raise ValueError("block_n must be >= 16 (tl.dot)")


@dataclass(frozen=True)
class PrefillConfig:
    """Causal paged prefill/extend attention on the fast path; speed only."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        _check_pow2(self, block_m=self.block_m, block_n=self.block_n, num_warps=self.num_warps)
        if min(self.block_m, self.block_n) < 16:
            raise ValueError("prefill blocks must be >= 16 (tl.dot)")


@dataclass(frozen=True)
class LaneConfig:
    """Lane attention: KV tiles of ``tile`` absolute positions, in order: *bits*."""

    tile: int = 64
    # Height of the query tile, (rows x query heads of one kv head): *bits*, as it and
    # num_warps decide the layout of the in-tile reductions.
    block_m: int = 64
    num_warps: int = 4
    num_stages: int = 3
    # Tiles that every live slot of a program sees whole run without the position masks
    # (``_lane_full_tile``): the same operations on the same values, so the same bits with
    # fewer instructions (GPU tests check the bits; timings in docs/benchmarks/gpu);
    # False runs every tile masked
    full_tiles: bool = True
    # A row's sum of probabilities over a tile as a matrix product with ones (of the
    # probabilities as they multiply V) instead of ``tl.sum``: *bits*. The product's order
    # does not depend on how the warps split the tile, so at GQA groups of 4 and 6 every
    # block_m and num_warps gives a row the same bits (tests/test_kernels_lane_attention.py),
    # and the fast path's decode rows take a query tile and a one-row kernel of their own
    # (``_lane_decode_kernel``, ``EngineConfig.aligned_decode_lane``) as fast as split-KV,
    # with the lane's bits. At groups of 8 and 16, tiles under 64 slots gave other bits on
    # an H200, so the engine probes the decode tile at start-up
    # (``lane_attention.decode_tile_keeps_bits``). False: ``tl.sum``, whose bits hold only
    # for tiles whose warps own whole rows
    dot_sums: bool = True
    # Positions [k*span, (k+1)*span) of a row's context reduce in a program of their own,
    # the spans' states then merged in order: *bits* for rows past the first span. Fixed by
    # absolute position, so a long context runs in parallel with the same bits in the lane
    # and on the aligned fast path (where split-KV would split by batch and length)
    span: int = 2048

    def __post_init__(self) -> None:
        _check_pow2(self, tile=self.tile, block_m=self.block_m, num_warps=self.num_warps,
                    span=self.span)
        if min(self.tile, self.block_m) < 16:
            raise ValueError("lane tile and block_m must be >= 16 (tl.dot)")
        if self.span < self.tile:
            raise ValueError(f"lane span {self.span} must hold whole tiles of {self.tile}")


# the decode rows' query tile and launch with dot sums ("auto"): the fastest one-row tile
# `bench_lane_decode` found (docs/benchmarks/gpu/2026-11-26-kernels3 has the figures), taken
# where the engine's start-up probe finds that it keeps the lane's bits
DECODE_LANE_AUTO = "16:2:3"


def lane_variant(base: LaneConfig, spec: str) -> LaneConfig:
    """``base`` with the query tile and launch of ``spec``, "BLOCK_M:NUM_WARPS:NUM_STAGES"
    ("" = ``base``; "auto": ``DECODE_LANE_AUTO`` where ``base`` has dot sums,
    so that any tile keeps its bits, else ``base``): the config the fast path's aligned
    decode rows call the lane kernel with (``EngineConfig.aligned_decode_lane``). Tile
    and sums stay the lane's."""
    if spec == "auto":
        spec = DECODE_LANE_AUTO if base.dot_sums else ""
    if not spec:
        return base
    try:
        block_m, num_warps, num_stages = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"expected BLOCK_M:NUM_WARPS:NUM_STAGES, got {spec!r}") from None
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    return replace(base, block_m=block_m, num_warps=num_warps, num_stages=num_stages)


@dataclass(frozen=True)
class KvWriteConfig:
    num_warps: int = 4


@dataclass(frozen=True)
class KernelTable:
    matmul_bf16: MatmulConfig = field(default_factory=MatmulConfig)
    # fp32 operands take IEEE fp32 dots (no TF32): smaller K step to fit shared memory.
    matmul_fp32: MatmulConfig = field(
        default_factory=lambda: MatmulConfig(block_k=32, num_warps=8, num_stages=3))
    rmsnorm: RowConfig = field(default_factory=lambda: RowConfig(block=1024))
    log_softmax: RowConfig = field(default_factory=lambda: RowConfig(block=4096, num_warps=8))
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    lane: LaneConfig = field(default_factory=LaneConfig)
    kv_write: KvWriteConfig = field(default_factory=KvWriteConfig)


TABLE = KernelTable()
