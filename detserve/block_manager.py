"""KV block ids, reference counts and the free list (no torch).

The scheduler owns this object; the executor owns the tensors. ``allocate`` returns None
when there is no room: the scheduler decides what to preempt. Block 0 is reserved as the
scratch block that padding rows of a lane pass point at; it is never handed out.

Prefix caching (lane sequences only): a full block whose K/V the lane wrote is registered
under a digest of its tokens and of everything before it. Such K/V is a pure function of
those tokens (the lane's arithmetic does not depend on the pass), so another request with
the same prefix may share the block instead of recomputing it. Freed registered blocks
stay findable until they are handed out again (least recently freed first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

SCRATCH_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("need at least 2 blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._ref = [0] * num_blocks
        self._digest_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

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
        out = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in out:
            assert self._ref[b] == 0, f"block {b} on the free list has refs"
            self._ref[b] = 1
            digest = self._digest_of.pop(b, None)  # its old contents are about to go
            if digest is not None:
                del self._block_of[digest]
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b == SCRATCH_BLOCK or not 0 < b < self.num_blocks:
                raise ValueError(f"invalid block id {b}")
            if self._ref[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

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

    def chain_digests(self, tokens: Sequence[int], num_blocks: int,
                      start: list[bytes] | None = None) -> list[bytes]:
        """Digests of the first ``num_blocks`` full blocks of ``tokens`` (each covers all
        tokens up to the end of its block). ``start`` is an already computed prefix."""
        out = list(start or [])
        bs = self.block_size
        for i in range(len(out), num_blocks):
            h = hashlib.sha256(out[-1] if out else b"detserve-kv")
            h.update(b"".join(t.to_bytes(4, "little") for t in tokens[i * bs:(i + 1) * bs]))
            out.append(h.digest())
        return out

    def match(self, digests: Sequence[bytes]) -> list[int]:
        """Take a reference on the longest run of registered blocks for ``digests``."""
        out = []
        for d in digests:
            b = self._block_of.get(d)
            if b is None:
                break
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
            out.append(b)
        return out

    def register(self, block: int, digest: bytes) -> None:
        """Make a full, lane-written block findable. The first block with a digest wins."""
        if digest in self._block_of or block in self._digest_of:
            return
        self._block_of[digest] = block
        self._digest_of[block] = digest

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
        for b, d in self._digest_of.items():
            if self._block_of.get(d) != b:
                raise AssertionError(f"block {b}: prefix-cache maps disagree")
