"""Which part of every weight a tensor-parallel rank holds (no torch).

Query heads, MLP columns and vocabulary rows are cut into contiguous ranges at
``i * n // size``; a rank's K/V heads are those its query heads read. Where a rank's query
heads do not start and end on K/V group boundaries (SmolLM2: 9 query heads in 3 groups at
TP=2: heads 0-3 and 4-8), each of its K/V heads is replicated so that its local query heads
map onto local K/V heads in equal groups: a local group size ``gcd(g, first, end)``.

The TP-invariant lane cuts the row-parallel products' K (heads for o_proj, MLP columns for
down_proj) into ``tree_leaves(size)`` leaves at ``j * n // leaves``. Because
``(r * leaves // size) * n // leaves == r * n // size``, a rank's range is exactly the union
of its leaves at every TP size that divides the leaf count: the tree's top levels are the
TP split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import accumulate

from detserve.model.config import ModelConfig

# the TP-invariant lane's leaves: its bits are the same at every TP size dividing this
INVARIANT_LEAVES = 4
# the tree's layout, named in the determinism fingerprint: a new name whenever its leaves,
# its blocks or their order change, since its responses' bits do (v2: column blocks of a
# TP=4 rank's products)
TREE_LAYOUT = f"tree{INVARIANT_LEAVES}-v2"


def tree_leaves(size: int) -> int:
    """Leaves of the row-parallel tree at TP ``size`` (a power of two)."""
    return max(INVARIANT_LEAVES, size)


def cut(n: int, parts: int, i: int) -> tuple[int, int]:
    """The ``i``-th of ``parts`` contiguous ranges of ``range(n)``."""
    return i * n // parts, (i + 1) * n // parts


@dataclass(frozen=True)
class TPLayout:
    config: ModelConfig  # the whole model's
    size: int
    rank: int

    def __post_init__(self) -> None:
        c = self.config
        if self.size < 1 or self.size & (self.size - 1):
            raise ValueError(f"tensor_parallel_size must be a power of two, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside 0..{self.size - 1}")
        for name, n in (("query heads", c.num_heads), ("MLP columns", c.intermediate_size),
                        ("vocabulary rows", c.vocab_size)):
            if n < self.size:
                raise ValueError(f"{n} {name} do not split over {self.size} ranks")

    @property
    def heads(self) -> tuple[int, int]:
        """This rank's query heads [first, end)."""
        return cut(self.config.num_heads, self.size, self.rank)

    @property
    def group(self) -> int:
        """Local query heads per local K/V head."""
        g = self.config.num_heads // self.config.num_kv_heads
        return math.gcd(g, *self.heads)

    @property
    def kv_heads(self) -> tuple[int, ...]:
        """The whole model's K/V head behind each local K/V head (repeats: replicated)."""
        first, end = self.heads
        g = self.config.num_heads // self.config.num_kv_heads
        return tuple(h // g for h in range(first, end, self.group))

    @property
    def mlp(self) -> tuple[int, int]:
        return cut(self.config.intermediate_size, self.size, self.rank)

    @property
    def vocab(self) -> tuple[int, int]:
        return cut(self.config.vocab_size, self.size, self.rank)

    def vocab_ranges(self) -> list[tuple[int, int]]:
        return [cut(self.config.vocab_size, self.size, r) for r in range(self.size)]

    def local_config(self) -> ModelConfig:
        """The rank's model shapes: its head and MLP counts; the vocabulary stays whole (the
        embedding and lm_head hold ``vocab`` rows of it)."""
        first, end = self.heads
        lo, hi = self.mlp
        return replace(self.config, num_heads=end - first, num_kv_heads=len(self.kv_heads),
                       intermediate_size=hi - lo)

    def leaves(self, n: int) -> list[tuple[int, int]]:
        """This rank's leaves of a K of ``n`` units (heads or columns), relative to its own
        range, in tree order."""
        total = tree_leaves(self.size)
        per = total // self.size
        first = cut(n, self.size, self.rank)[0]
        return [(a - first, b - first)
                for a, b in (cut(n, total, j) for j in range(self.rank * per, (self.rank + 1) * per))]


@dataclass(frozen=True)
class ColumnBlocks:
    """How a rank keeps and multiplies a column-parallel weight under the TP-invariant
    tree. ``order``: the rank's own output rows (its natural layout's indices) in the
    order they are kept (None: as they are); ``blocks``: the tree's calls, row ranges of
    the kept weight, in order."""

    order: tuple[int, ...] | None
    blocks: tuple[tuple[int, int], ...]

    def restore(self) -> list[int] | None:
        """Where each natural row's output sits in a product of the kept weight (None: in
        place)."""
        if self.order is None:
            return None
        where = [0] * len(self.order)
        for i, row in enumerate(self.order):
            where[row] = i
        return where


def _spans(widths: list[int]) -> tuple[tuple[int, int], ...]:
    """Consecutive ranges of these ``widths`` from 0."""
    ends = list(accumulate(widths))
    return tuple(zip([0, *ends[:-1]], ends, strict=True))


def leaf_major_qkv(config: ModelConfig, leaves: int) -> bool:
    """Whether every one of ``leaves`` leaves of the query heads reads K/V heads of its
    own (the K/V heads split evenly over the leaves): its query, K and V rows then form one
    call, the product a rank of that many holds."""
    return config.num_heads % leaves == 0 and config.num_kv_heads % leaves == 0


def column_blocks(layout: TPLayout) -> tuple[ColumnBlocks, ColumnBlocks]:
    """The tree's blocks of a rank's fused qkv and gate/up weights: what a rank of the
    largest TP size the tree spans holds of each, so that every output column comes from a
    call of the same shape at every TP size it spans (cuBLAS picks its algorithm, split-K
    included, from the call's shape). gate/up: each MLP leaf's gate then up rows, kept
    leaf by leaf (one call a leaf). qkv: where the K/V heads split over the leaves, each
    leaf's query, K and V rows kept together (one call a leaf); else (a K/V head read by
    two leaves, replicated at some TP sizes) its query heads by leaves, then each local K
    and V head alone, kept as they are."""
    c, d = layout.config, layout.config.head_dim
    local = layout.local_config()
    heads = layout.leaves(c.num_heads)
    q_size, kv = local.num_heads * d, local.num_kv_heads
    if leaf_major_qkv(c, tree_leaves(layout.size)):
        g = local.num_heads // kv  # (no K/V head is replicated: whole groups a leaf)
        order: list[int] = []
        widths = []
        for a, b in heads:
            k_rows = range(a // g * d, b // g * d)
            order += [*range(a * d, b * d), *(q_size + r for r in k_rows),
                      *(q_size + kv * d + r for r in k_rows)]
            widths.append((b - a) * d + 2 * len(k_rows))
        qkv = ColumnBlocks(tuple(order), _spans(widths))
    else:
        q = [(a * d, b * d) for a, b in heads]
        k = [(q_size + i * d, q_size + (i + 1) * d) for i in range(kv)]
        v = [(q_size + (kv + i) * d, q_size + (kv + i + 1) * d) for i in range(kv)]
        qkv = ColumnBlocks(None, (*q, *k, *v))
    mlp, inter = layout.leaves(c.intermediate_size), local.intermediate_size
    gate_up = [r for a, b in mlp for r in (*range(a, b), *range(inter + a, inter + b))]
    return qkv, ColumnBlocks(tuple(gate_up), _spans([2 * (b - a) for a, b in mlp]))


def tree_shapes(config: ModelConfig) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(N, K) of every product the TP-invariant tree runs, the same at every TP size it
    spans (a rank's are some of them): the column-parallel products' blocks
    (``column_blocks``; the lm_head by vocabulary leaves) and the row-parallel products'
    K leaves (o by the query head leaves, down by the MLP leaves). Second, those that
    add the qkv bias where the model has one (the qkv blocks). The shapes whose cuBLAS row
    classes decide the tree's lane chunk (``gemm_classes.shared_chunk``)."""
    layout = TPLayout(config, 1, 0)  # (TP=1 holds every leaf)
    hidden, d = config.hidden_size, config.head_dim
    qkv, gate_up = column_blocks(layout)
    biased = [(b - a, hidden) for a, b in qkv.blocks]
    shapes = [*biased, *((b - a, hidden) for a, b in gate_up.blocks),
              *((b - a, hidden) for a, b in layout.leaves(config.vocab_size)),
              *((hidden, (b - a) * d) for a, b in layout.leaves(config.num_heads)),
              *((hidden, b - a) for a, b in layout.leaves(config.intermediate_size))]
    return shapes, biased
