"""The paged KV cache tensors (owned by the executor; ids are the block manager's)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from detserve.executor.transfer import upload


class KVPool:
    """One tensor ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``.

    A single allocation so it can be exported as one handle (shared memory / CUDA IPC) to a
    co-located verifier. Slot ``s`` is position ``s % block_size`` of block ``s // block_size``.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 storage: Tensor | None = None) -> None:
        shape = self.shape_for(num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        if storage is not None:
            if tuple(storage.shape) != shape or storage.dtype != dtype:
                raise ValueError(f"KV storage {tuple(storage.shape)}/{storage.dtype} != {shape}/{dtype}")
            self.data = storage
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @staticmethod
    def shape_for(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_dim: int) -> tuple[int, ...]:
        return (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)

    def k(self, layer: int) -> Tensor:
        return self.data[layer, 0]

    def v(self, layer: int) -> Tensor:
        return self.data[layer, 1]

    def write(self, layer: int, k: Tensor, v: Tensor, slots: Tensor) -> None:
        """Store rows' K/V at their slots (every slot valid: callers drop padding rows)."""
        kc = self.k(layer).view(-1, *k.shape[1:])
        vc = self.v(layer).view(-1, *v.shape[1:])
        kc[slots] = k.to(kc.dtype)
        vc[slots] = v.to(vc.dtype)

    def gather(self, layer: int, block_table: list[int], length: int) -> tuple[Tensor, Tensor]:
        """Contiguous K/V [length, kv_heads, head_dim] of one sequence."""
        nb = -(-length // self.block_size)
        idx = torch.tensor(block_table[:nb], dtype=torch.long, device=self.data.device)
        k = self.k(layer)[idx].flatten(0, 1)[:length]
        v = self.v(layer)[idx].flatten(0, 1)[:length]
        return k, v

    def slots_of(self, spans: Iterable[tuple[Sequence[int], int, int]]) -> Tensor:
        """The slots of several (block table, start, end) position ranges, in order, on the
        pool's device: worked out on the host and uploaded once, without waiting for the
        device (a transfer's slots must not hold the host up for the step still running)."""
        parts = []
        for block_table, start, end in spans:
            if end > start:
                pos = torch.arange(start, end)
                table = torch.tensor(block_table, dtype=torch.long)
                parts.append(table[pos // self.block_size] * self.block_size
                             + pos % self.block_size)
        host = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
        return upload(host, self.data.device)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def empty_rows(self, n: int, kv_heads: int | None = None) -> Tensor:
        """A buffer for ``n`` rows as ``read_rows`` returns them (what a transfer receives),
        of ``kv_heads`` heads (default this pool's: a TP rank's are the whole model's
        rows only when they arrive)."""
        d = self.data
        return torch.empty((d.shape[0], 2, n, d.shape[4] if kv_heads is None else kv_heads,
                            d.shape[5]), dtype=d.dtype, device=d.device)

    def read_rows(self, slots: Tensor) -> Tensor:
        """K/V of every layer at ``slots``: ``[layers, 2, len(slots), kv_heads, head_dim]``,
        contiguous (what a transfer sends)."""
        flat = self.data.flatten(2, 3)
        return flat.index_select(2, slots)

    def write_rows(self, slots: Tensor, rows: Tensor) -> None:
        """Store ``rows`` (as ``read_rows`` returns them) at ``slots``."""
        self.data.flatten(2, 3).index_copy_(2, slots, rows.to(self.data.dtype))
