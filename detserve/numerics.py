"""``LaneNumerics``: every setting, besides the weights, the dtype and the device, that
decides the bits of a lane row and of the fast path's decode rows aligned with it.

Built once from the engine's config with the resolved lane GEMM chunk
(``LaneNumerics.from_config``), handed whole to the ``ModelRunner``, sent whole to a remote
verifier in its hello (``services/verifier/codec.py``), and the source of the runner's
kernel set tag and of the determinism fingerprint's geometry. Two runners built from equal
``LaneNumerics`` on the same device kind and torch give a lane row the same bits.

A field whose value selects kernels of other bits than the reference ones names the tag
that the kernel set then carries (field metadata ``"tag"``: value -> tag); fields without
one give the same bits whatever their value (they travel so that a verifier runs as fast as
its decoder).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any

from detserve.config import SamplerConfig
from detserve.kernels.config import TABLE, LaneConfig, lane_variant
from detserve.parallel.layout import TREE_LAYOUT  # (no torch)

if TYPE_CHECKING:
    from detserve.config import EngineConfig


@dataclass(frozen=True)
class LaneNumerics:
    # the lane's geometry: every pass has verify_window * verify_group rows, and the lm_head
    # runs over verify_window rows at a time
    verify_window: int = 64
    verify_group: int = 8
    block_size: int = 16
    # batch_invariant mode's fixed row chunk (the CPU reference's products and attention)
    batch_invariant_rows: int = 32
    # the lane's product row chunk, resolved (the probed one on CUDA); 0: the whole pass
    lane_gemm_rows: int = 0
    # CUDA: the lane's products at that chunk gave the Triton batch-invariant kernel's bits
    # (``gemm_classes.equals_portable_kernel``): the chunk then changes no bit, and the
    # lane's bits are those of every card in the device's class
    portable_products: bool = False
    # CUDA: probe which lane sizes may run a product as one call over several chunks with
    # the chunk's bits (the probe's verdicts join the kernel set tag)
    lane_one_calls: bool = True
    # CUDA: the lane attention kernel sums probabilities as a matrix product with ones
    lane_dot_sums: bool = field(default=True, metadata={"tag": {False: "+plainsums"}})
    # CUDA: whole KV tiles run without position masks (the same bits)
    lane_full_tiles: bool = True
    # CUDA, aligned fast path: the lane kernel's query tile and launch for decode rows
    # ("BLOCK_M:NUM_WARPS:NUM_STAGES", "auto" or "": the lane's own)
    aligned_decode_lane: str = "auto"
    # CUDA: fused SiLU-and-multiply and residual add + RMSNorm (the same bits as torch's)
    fused_silu_mul: bool = True
    fused_add_rmsnorm: bool = True
    # how many rows are sampled at once; its logprob kernel has bits of its own
    sampling: SamplerConfig = field(default_factory=SamplerConfig)
    # the ranks the row-parallel products are split over, and whether the lane reduces them
    # in the TP-invariant tree (then the lane's bits do not depend on the TP size)
    tensor_parallel_size: int = 1
    tp_invariant_lane: bool = False

    def __post_init__(self) -> None:
        for name in ("verify_window", "verify_group", "block_size", "batch_invariant_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.lane_gemm_rows < 0:
            raise ValueError(f"lane_gemm_rows must be >= 0, got {self.lane_gemm_rows}")
        try:
            lane_variant(TABLE.lane, self.aligned_decode_lane)
        except (TypeError, ValueError) as e:
            raise ValueError(f"aligned_decode_lane: {e}") from None

    @classmethod
    def from_config(cls, config: EngineConfig, lane_gemm_rows: int,
                    portable_products: bool = False) -> LaneNumerics:
        """``config``'s numerics with the lane's resolved GEMM chunk (0: the whole pass)
        and whether its products are the portable kernel's."""
        sc = config.scheduler
        return cls(verify_window=sc.verify_window, verify_group=sc.verify_group,
                   block_size=config.cache.block_size,
                   batch_invariant_rows=config.batch_invariant_rows,
                   lane_gemm_rows=lane_gemm_rows, portable_products=portable_products,
                   lane_one_calls=config.lane_one_calls,
                   lane_dot_sums=config.lane_dot_sums, lane_full_tiles=config.lane_full_tiles,
                   aligned_decode_lane=config.aligned_decode_lane,
                   fused_silu_mul=config.fused_silu_mul,
                   fused_add_rmsnorm=config.fused_add_rmsnorm, sampling=config.sampling,
                   tensor_parallel_size=config.tensor_parallel_size,
                   tp_invariant_lane=config.tp_invariant_lane)

    @property
    def lane_rows(self) -> int:
        return self.verify_window * self.verify_group

    @property
    def lane_chunk(self) -> int:
        """Rows of every lane product call (without one calls)."""
        return self.lane_gemm_rows or self.lane_rows

    @property
    def lane_sizes(self) -> tuple[int, ...]:
        """Row counts a lane pass runs at: the multiples of the GEMM chunk up to the pass
        (the last one may pass it), or the whole pass. A row's bits depend on the chunk,
        not on how many chunks run."""
        c = self.lane_gemm_rows
        if not c:
            return (self.lane_rows,)
        return tuple(k * c for k in range(1, -(-self.lane_rows // c) + 1))

    @property
    def lane_attention(self) -> LaneConfig:
        """The lane attention kernel's config (the lane's and batch_invariant's rows)."""
        return replace(TABLE.lane, full_tiles=self.lane_full_tiles, dot_sums=self.lane_dot_sums)

    @property
    def decode_attention(self) -> LaneConfig:
        """The same kernel for the fast path's aligned decode rows: the lane's tile and
        sums, with the query tile and launch of ``aligned_decode_lane``."""
        return lane_variant(self.lane_attention, self.aligned_decode_lane)

    def row_reduce(self, kind: str, aligned: bool = False) -> str:
        """How a forward of ``kind`` ("fast", "lane" or "bi") sums row-parallel products
        over TP ranks (``llama.RowReduce``): the lane's and batch_invariant's in a fixed
        order (the TP-invariant tree for the lane where asked), the fast path's in any,
        except in forwards with decode rows ``aligned`` with the lane: there as the lane
        sums wherever the backend's all-reduce could add in another order. At two ranks
        every algorithm adds the same two partials, so the cheaper all-reduce stays; at
        more, NCCL's ring or tree order is not the lane's pairwise one, and an aligned
        row would carry the lane's bits only by chance (its window rolled back)."""
        lane = "tree" if self.tp_invariant_lane else "ordered"
        if kind != "fast":
            return lane if kind == "lane" else "ordered"
        if not aligned or (lane == "ordered" and self.tensor_parallel_size <= 2):
            return "all_reduce"
        return lane

    def kernel_tags(self) -> str:
        """The kernel set's tags of these settings: one for each field whose value selects
        kernels of other bits (its metadata ``"tag"``), nested configs included, in field
        order."""
        return _tags(self)

    def profile(self, mode: str) -> dict[str, object]:
        """The determinism fingerprint's entries of these numerics in ``mode`` (the kernel
        set and the device are the runner's)."""
        out: dict[str, object] = {"verify_window": self.verify_window,
                                  "verify_group": self.verify_group,
                                  "block_size": self.block_size}
        if mode == "batch_invariant":
            out["batch_invariant_rows"] = self.batch_invariant_rows
        if self.portable_products and mode in ("llm42", "lane_only"):
            out["lane_products"] = "portable"  # (whatever the chunk: the same bits)
        elif self.lane_gemm_rows:
            out["lane_gemm_rows"] = self.lane_gemm_rows
        if self.tp_invariant_lane and mode in ("llm42", "lane_only"):
            # the same bits at every TP size dividing its leaves, in this layout
            out["tp_invariant_lane"] = TREE_LAYOUT
        return out


def device_kind(mode: str, name: str, capability: tuple[int, int], sms: int,
                triton: str, portable_products: bool = False) -> str:
    """The device entry of a CUDA determinism profile: the compatibility class whose cards
    give a deterministic request the same bits.

    batch_invariant runs every product and attention in this project's Triton kernels, whose
    configs are fixed or derived from the SM count: the bits then depend only on the
    architecture, the SM count and the Triton that compiled them, so cards that share those
    form one class (measured: an H100 SXM and an H200, both sm_90 with 132 SMs, gave the 8B
    shape's deterministic requests the same tokens and logprobs). The lane's products are
    cuBLAS's, whose kernel choice per shape differs between such cards (the same
    measurement: the 8B shape's lane logprobs differed from the first token), so
    llm42 and lane_only name the card itself, unless the start-up probe found that the
    lane's products give the Triton kernel's bits (``portable_products``): then the class
    (measured: the 8B shape with the lane chunk at 512 rows gave an H100 and an H200 the
    same outputs, batch_invariant's)."""
    if mode == "batch_invariant" or (portable_products and mode in ("llm42", "lane_only")):
        return f"sm_{capability[0]}{capability[1]}/{sms}sm/triton-{triton}"
    return name


def lane_run_rows(sizes: Sequence[int], used: int) -> int:
    """Rows a lane pass with ``used`` rows runs: the smallest of ``sizes`` (ascending, a
    ``LaneNumerics.lane_sizes``) that holds them."""
    return next(n for n in sizes if n >= used)


def _tags(obj: Any) -> str:
    out = ""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            out += _tags(value)
        out += f.metadata.get("tag", {}).get(value, "")
    return out
