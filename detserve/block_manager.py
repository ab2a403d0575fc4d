"""KV block ids, reference counts and the free list (no torch).

The scheduler owns this object; the executor owns the tensors. ``allocate`` returns None
when there is no room: the scheduler decides what to preempt. Block 0 is reserved as the
scratch block that padding rows of a lane pass point at; it is never handed out.
"""

from __future__ import annotations

from collections import deque

SCRATCH_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("need at least 2 blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            assert self._ref[b] == 0, f"block {b} on the free list has refs"
            self._ref[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b == SCRATCH_BLOCK or not 0 < b < self.num_blocks:
                raise ValueError(f"invalid block id {b}")
            if self._ref[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend ``table`` in place to cover ``num_tokens`` positions; False if no room."""
        need = self.blocks_needed(num_tokens) - len(table)
        if need <= 0:
            return True
        got = self.allocate(need)
        if got is None:
            return False
        table.extend(got)
        return True

    def shrink(self, table: list[int], num_tokens: int) -> None:
        """Release the blocks of ``table`` beyond what ``num_tokens`` positions need."""
        keep = self.blocks_needed(num_tokens)
        if len(table) > keep:
            self.free(table[keep:])
            del table[keep:]

    def check_integrity(self, tables: list[list[int]]) -> None:
        """Every block is either free (ref 0) or referenced exactly by the given tables."""
        counts = [0] * self.num_blocks
        for t in tables:
            for b in t:
                counts[b] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("duplicate block on the free list")
        if SCRATCH_BLOCK in free or counts[SCRATCH_BLOCK]:
            raise AssertionError("scratch block was handed out")
        for b in range(1, self.num_blocks):
            if counts[b] != self._ref[b]:
                raise AssertionError(f"block {b}: ref {self._ref[b]} != uses {counts[b]}")
            if (b in free) != (counts[b] == 0):
                raise AssertionError(f"block {b}: free-list membership disagrees with refs")
