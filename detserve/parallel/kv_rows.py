"""A tensor-parallel engine's K/V as whole heads, for a verifier outside it (K/V transfer).

Each rank's pool holds only its K/V heads (``TPLayout.kv_heads``: the whole model's head
behind each local one, some replicated). A dedicated verifier holds whole-head rows
``[layers, 2, positions, kv_heads, head_dim]``. ``ShardedKV`` offers the transfer
(``services/verifier/transfer.py``) what it uses of a ``KVPool`` over all ranks:
- write (every pass's pulled rows): rank 0 sends the workers ``WriteKV`` (the spans: each
  rank works out its own slots), broadcasts the rows on the steps' group, and every rank
  stores its heads;
- read (pushes: prefix-cache hits, failover): ``ReadKV``; every rank reads its heads,
  padded to one width, into an all-gather on the steps' group; rank 0 takes each whole
  head from the first rank that holds it (a replicated head has the same bits on each:
  the same column of the same QKV product of the same residual rows).
Both run on the engine's thread, as the fast steps do, so the group's collectives keep one
order on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from detserve.executor.kv_pool import KVPool
from detserve.executor.runner import ModelRunner
from detserve.parallel.executor import TPRunner, Workers
from detserve.parallel.layout import TPLayout
from detserve.parallel.messages import ReadKV, Span, WriteKV
from detserve.parallel.shard import TensorParallel
from detserve.parallel.worker import gather_heads


@dataclass(frozen=True)
class Slots:
    """The positions of a transfer: the spans (sent to the workers) and rank 0's slots."""

    spans: tuple[Span, ...]
    local: Tensor

    def __len__(self) -> int:
        return len(self.local)


def spans_of(spans: Iterable[tuple[Sequence[int], int, int]]) -> tuple[Span, ...]:
    return tuple((tuple(t), a, b) for t, a, b in spans if b > a)


class ShardedKV:
    """Rank 0's pool and its workers' as one pool of whole heads (``KVPool``'s transfer
    methods). Every method sends the workers a message: rank 0's engine thread only."""

    def __init__(self, pool: KVPool, workers: Workers, layout: TPLayout) -> None:
        self.pool, self.workers = pool, workers
        heads = [TPLayout(layout.config, layout.size, r).kv_heads for r in range(layout.size)]
        self.kv_heads = layout.config.num_kv_heads
        self.width = max(len(h) for h in heads)
        # each whole head: the first (rank, local head) that holds it
        where: dict[int, int] = {}
        for r, hs in enumerate(heads):
            for j, h in enumerate(hs):
                where.setdefault(h, r * self.width + j)
        if sorted(where) != list(range(self.kv_heads)):
            raise ValueError(f"the ranks hold K/V heads {sorted(where)}, not all "
                             f"{self.kv_heads}")
        dev = pool.device
        self._gather_index = torch.tensor([where[h] for h in range(self.kv_heads)],
                                          dtype=torch.long, device=dev)
        self._mine = torch.tensor(heads[0], dtype=torch.long, device=dev)

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def slots_of(self, spans: Iterable[tuple[Sequence[int], int, int]]) -> Slots:
        kept = spans_of(spans)
        return Slots(kept, self.pool.slots_of(kept))

    def empty_rows(self, n: int) -> Tensor:
        return self.pool.empty_rows(n, self.kv_heads)

    def write_rows(self, slots: Slots, rows: Tensor) -> None:
        """Store whole-head ``rows`` at ``slots`` on every rank."""
        if not len(slots):
            return

        def write() -> None:
            self.workers.share(rows)
            self.pool.write_rows(slots.local, rows.index_select(3, self._mine))

        self.workers.run(WriteKV(slots.spans, self.kv_heads), write)

    def read_rows(self, slots: Slots) -> Tensor:
        """Whole-head rows at ``slots``, gathered from every rank."""
        def read() -> Tensor:
            parts = gather_heads(self.pool, self.workers.group, slots.local, self.width)
            # [layers, 2, n, ranks * width, head_dim] -> the whole heads in order
            return torch.cat(parts, dim=3).index_select(3, self._gather_index)

        return self.workers.run(ReadKV(slots.spans, self.width), read)


def transfer_pool(runner: ModelRunner) -> KVPool | ShardedKV:
    """What K/V transfer to a verifier outside the engine reads and writes: the runner's
    pool, or at TP>1 every rank's as whole heads."""
    if not isinstance(runner, TPRunner):
        return runner.pool
    parallel = cast(TensorParallel, runner.model.parallel)
    return ShardedKV(runner.pool, runner.workers, parallel.layout)
