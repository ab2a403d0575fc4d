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

from detserve.model.config import ModelConfig

# the TP-invariant lane's leaves: its bits are the same at every TP size dividing this
INVARIANT_LEAVES = 4


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


def product_shapes(config: ModelConfig, size: int, leaves: bool) -> list[tuple[int, int]]:
    """(N, K) of every matrix product the ranks of TP ``size`` run (``LlamaModel``'s fused
    qkv, o, gate/up and down weights of each rank's shard, and its lm_head's), with
    ``leaves`` the TP-invariant tree's too: the row-parallel products' K leaves, the
    column blocks (``shard.column_blocks``) and the vocabulary blocks, which then replace
    the whole lm_head. The shapes whose cuBLAS row classes decide the lane chunk
    (``gemm_classes.shared_chunk``)."""
    out: list[tuple[int, int]] = []
    for rank in range(size):
        layout = TPLayout(config, size, rank)
        c = layout.local_config()
        hidden, d = c.hidden_size, c.head_dim
        lo, hi = layout.vocab
        out += [((c.num_heads + 2 * c.num_kv_heads) * d, hidden), (hidden, c.num_heads * d),
                (2 * c.intermediate_size, hidden), (hidden, c.intermediate_size)]
        if not leaves:
            out.append((hi - lo, hidden))
            continue
        heads, mlp = layout.leaves(config.num_heads), layout.leaves(config.intermediate_size)
        out += [(hidden, (b - a) * d) for a, b in heads]
        out += [(hidden, b - a) for a, b in mlp]
        out += [((b - a) * d, hidden) for a, b in heads] + [(d, hidden)]
        out += [(b - a, hidden) for a, b in mlp]
        out += [(b - a, hidden) for a, b in layout.leaves(config.vocab_size)]
    return out


def invariant_sizes(config: ModelConfig) -> list[int]:
    """The TP sizes the TP-invariant lane spans for this model: those dividing the leaf
    count that its heads, MLP columns and vocabulary split over."""
    out = []
    for size in range(1, INVARIANT_LEAVES + 1):
        if INVARIANT_LEAVES % size == 0:
            try:
                TPLayout(config, size, 0)
            except ValueError:
                continue
            out.append(size)
    return out


def qkv_shapes(config: ModelConfig, size: int, leaves: bool) -> list[tuple[int, int]]:
    """The shapes among ``product_shapes`` that add the qkv bias (where the model has one):
    every rank's qkv and, with ``leaves``, its query and K/V blocks."""
    out: list[tuple[int, int]] = []
    for rank in range(size):
        layout = TPLayout(config, size, rank)
        c = layout.local_config()
        out.append(((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size))
        if leaves:
            out += [((b - a) * c.head_dim, c.hidden_size)
                    for a, b in layout.leaves(config.num_heads)]
            out.append((c.head_dim, c.hidden_size))
    return out
