"""Attention over the paged KV cache: the fast path and the tile-ordered (lane) path.

Both write the pass's K/V into the cache first, then attend. ``fast_attention`` lets the
backend reduce however it likes (batched SDPA; any shape). ``tiled_attention`` is what the
lane and batch-invariant mode use: a query at absolute position p reduces over KV tiles
[t*bs, (t+1)*bs) in increasing t with an online softmax, every tensor op on exactly
``chunk_rows`` rows. Tiles past p are fully masked and leave the running state bit-for-bit
unchanged, so the result for a row depends only on the row itself, not on how many rows
or tiles the pass holds, nor on how its sequence was chunked into passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from detserve.block_manager import SCRATCH_BLOCK
from detserve.executor.kv_pool import KVPool
from detserve.executor.transfer import upload


@dataclass(frozen=True)
class RowSegment:
    """Consecutive positions [start, start + len(input_ids)) of one sequence."""

    input_ids: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]


@dataclass
class RowBatch:
    input_ids: Tensor   # [N] long
    positions: Tensor   # [N] long
    slots: Tensor       # [N] long; -1 for padding rows
    seg_tables: Tensor  # [S + 1, T] long: each segment's block table, then a scratch row
    row_seg: Tensor     # [N] long: segment of each row; padding rows -> the scratch row S
    segments: list[RowSegment]
    seg_offsets: list[int]  # first row of each segment
    num_real: int           # rows before the padding (padding rows are always last)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def lane_positions(self) -> Tensor:
        """[N] position of every row, -1 for padding rows (the lane kernel's row_pos)."""
        real = torch.arange(self.num_rows, device=self.positions.device) < self.num_real
        return torch.where(real, self.positions, -1)

    @property
    def row_tables(self) -> Tensor:
        """[N, T] block table of every row (padding rows: the scratch block)."""
        return self.seg_tables[self.row_seg]


def build_rows(segments: list[RowSegment], block_size: int, device: torch.device | str,
               pad_to: int | None = None) -> RowBatch:
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    row_seg: list[int] = []
    offsets: list[int] = []
    for i, seg in enumerate(segments):
        offsets.append(len(ids))
        n = len(seg.input_ids)
        if seg.start + n > len(seg.block_table) * block_size:
            raise ValueError("block table too short for the segment")
        ids.extend(seg.input_ids)
        for p in range(seg.start, seg.start + n):
            pos.append(p)
            slots.append(seg.block_table[p // block_size] * block_size + p % block_size)
        row_seg.extend([i] * n)
    n_real = len(ids)
    if pad_to is not None:
        if n_real > pad_to:
            raise ValueError(f"{n_real} rows do not fit a pass of {pad_to}")
        pad = pad_to - n_real
        ids += [0] * pad
        pos += [0] * pad
        slots += [-1] * pad
        row_seg += [len(segments)] * pad
    width = max((len(s.block_table) for s in segments), default=1)
    tables = torch.full((len(segments) + 1, width), SCRATCH_BLOCK, dtype=torch.long)
    for i, seg in enumerate(segments):
        tables[i, :len(seg.block_table)] = torch.tensor(seg.block_table, dtype=torch.long)

    def as_long(xs: list[int]) -> Tensor:
        return upload(xs, device)

    return RowBatch(as_long(ids), as_long(pos), as_long(slots), upload(tables, device),
                    as_long(row_seg), list(segments), offsets, n_real)


def write_kv(pool: KVPool, layer: int, k: Tensor, v: Tensor, batch: RowBatch) -> None:
    """The pass's K/V into the cache before anyone attends (padding rows are not written)."""
    n = batch.num_real
    pool.write(layer, k[:n], v[:n], batch.slots[:n])


def _expand_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def fast_attention(pool: KVPool, layer: int, q: Tensor, k: Tensor, v: Tensor,
                   batch: RowBatch) -> Tensor:
    write_kv(pool, layer, k, v, batch)
    n, heads, dim = q.shape
    groups = heads // k.shape[1]
    out = torch.empty_like(q)
    decode = [i for i, s in enumerate(batch.segments) if len(s.input_ids) == 1]
    if decode:
        rows = torch.tensor([batch.seg_offsets[i] for i in decode], device=q.device)
        pos = batch.positions[rows]
        length = int(pos.max()) + 1
        nb = -(-length // pool.block_size)
        tab = batch.seg_tables[torch.tensor(decode, device=q.device), :nb]
        kk = pool.k(layer)[tab].flatten(1, 2)[:, :length].transpose(1, 2)  # [B, Hkv, L, D]
        vv = pool.v(layer)[tab].flatten(1, 2)[:, :length].transpose(1, 2)
        mask = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(
            q[rows].unsqueeze(2), _expand_kv(kk, groups).to(q.dtype),
            _expand_kv(vv, groups).to(q.dtype), attn_mask=mask[:, None, None, :])
        out[rows] = o.squeeze(2)
    for i, seg in enumerate(batch.segments):
        m = len(seg.input_ids)
        if m == 1:
            continue
        r0 = batch.seg_offsets[i]
        length = seg.start + m
        kk, vv = pool.gather(layer, list(seg.block_table), length)
        qpos = torch.arange(seg.start, length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(
            q[r0:r0 + m].transpose(0, 1).unsqueeze(0),
            _expand_kv(kk.transpose(0, 1).unsqueeze(0), groups).to(q.dtype),
            _expand_kv(vv.transpose(0, 1).unsqueeze(0), groups).to(q.dtype),
            attn_mask=mask)
        out[r0:r0 + m] = o[0].transpose(0, 1)
    return out


def tiled_attention(pool: KVPool, layer: int, q: Tensor, k: Tensor, v: Tensor,
                    batch: RowBatch, chunk_rows: int, per_head: bool = False) -> Tensor:
    """``per_head``: one query head at a time, on its K/V head's tiles, so that every tensor
    op has the same shape whatever the number of heads (on CPU even an elementwise exp's
    bits depend on where an element falls in the vectorized loop): the TP-invariant lane's,
    whose ranks hold different numbers of heads and may replicate a K/V head per query head."""
    write_kv(pool, layer, k, v, batch)
    heads = q.shape[1]
    groups = heads // k.shape[1]
    if per_head:
        return torch.cat([_tiled_rows(pool, layer, q[:, h:h + 1], batch, chunk_rows, h // groups)
                          for h in range(heads)], dim=1)
    return _tiled_rows(pool, layer, q, batch, chunk_rows, None)


def _tiled_rows(pool: KVPool, layer: int, q: Tensor, batch: RowBatch, chunk_rows: int,
                kv_head: int | None) -> Tensor:
    """Attention of ``q``'s heads (all of the pool's K/V heads', or only ``kv_head``'s) in
    chunks of exactly ``chunk_rows`` rows."""
    n, heads, dim = q.shape
    kv_heads = pool.k(layer).shape[2] if kv_head is None else 1
    groups = heads // kv_heads
    pad = (-n) % chunk_rows
    qg = q.float().reshape(n, kv_heads, groups, dim)
    pos, tables = batch.positions, batch.row_tables
    if pad:
        qg = torch.cat([qg, qg.new_zeros((pad, kv_heads, groups, dim))])
        pos = torch.cat([pos, pos.new_zeros(pad)])
        tables = torch.cat([tables, tables.new_full((pad, tables.shape[1]), SCRATCH_BLOCK)])
    outs = [
        _tiled_chunk(pool, layer, qg[r:r + chunk_rows], pos[r:r + chunk_rows],
                     tables[r:r + chunk_rows], kv_head)
        for r in range(0, n + pad, chunk_rows)
    ]
    return torch.cat(outs)[:n].reshape(n, heads, dim).to(q.dtype)


def _tiled_chunk(pool: KVPool, layer: int, q: Tensor, pos: Tensor, tables: Tensor,
                 kv_head: int | None = None) -> Tensor:
    rows, kv_heads, groups, dim = q.shape
    bs = pool.block_size
    scale = dim ** -0.5
    kc, vc = pool.k(layer), pool.v(layer)
    if kv_head is not None:
        kc, vc = kc[:, :, kv_head:kv_head + 1], vc[:, :, kv_head:kv_head + 1]
    m = q.new_full((rows, kv_heads, groups, 1), float("-inf"))
    denom = q.new_zeros((rows, kv_heads, groups, 1))
    acc = q.new_zeros((rows, kv_heads, groups, dim))
    offs = torch.arange(bs, device=q.device)
    for t in range(int(pos.max()) // bs + 1):
        blk = tables[:, t]
        kt = kc[blk].float().permute(0, 2, 3, 1)  # [rows, Hkv, D, bs]
        vt = vc[blk].float().permute(0, 2, 1, 3)  # [rows, Hkv, bs, D]
        s = torch.matmul(q, kt) * scale            # [rows, Hkv, g, bs]
        valid = (t * bs + offs)[None, :] <= pos[:, None]
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new)
        denom = denom * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, vt)
        m = m_new
    return acc / denom
