"""CUDA execution through the Triton kernels in ``detserve.kernels``.

Same contracts as the plain-torch paths in ``attention.py`` and ``ops.py``:
- fast path: split-KV paged decode attention and varlen paged prefill attention (whatever
  split the context length suggests: shape-dependent reductions are allowed here);
- lane and batch-invariant mode: ``lane_attention`` (tiles and spans aligned to absolute
  positions, no split by length or batch), and for batch-invariant mode a persistent
  no-split-K matmul and one-row-per-program RMSNorm, so every row's bits are independent
  of the batch.
Every path rotates q/k and writes the K/V with one fused kernel (``rope_kv_write``, bitwise
equal to the model's RoPE), and normalises with the one-row-per-program RMSNorm.
Metadata tensors are built once per forward (``GpuMeta``), not once per layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from detserve.executor.attention import RowBatch
from detserve.executor.kv_pool import KVPool
from detserve.executor.ops import TorchOps, add_then_rmsnorm, linear_in_row_chunks, silu_mul
from detserve.executor.transfer import upload
from detserve.kernels._utils import num_sms
from detserve.kernels.batch_invariant import add_rmsnorm_bi, matmul_bi, rmsnorm_bi
from detserve.kernels.config import KERNEL_VERSION, TABLE, LaneConfig
from detserve.kernels.decode_attention import choose_num_splits, decode_attention
from detserve.kernels.kv_write import rope_kv_write
from detserve.kernels.lane_attention import lane_attention, lane_spans
from detserve.kernels.prefill_attention import prefill_attention
from detserve.kernels.silu_mul import silu_mul_fused

__all__ = ["KERNEL_VERSION", "DecodeInputs", "GpuFastOps", "GpuLaneOps", "GpuMeta", "Rope",
           "TritonBatchInvariantOps", "fast_attention_gpu",
           "fast_decode_attention",
           "lane_attention_gpu", "rope_write"]

Rope = tuple[Tensor, Tensor]  # the model's fp32 cos/sin tables, indexed by position


class GpuFastOps(TorchOps):
    """Fast path: cuBLAS for products (any reduction order), one kernel per RMSNorm, and
    SiLU-and-multiply and the residual add before a norm as torch's kernels or fused ones
    (``fused_silu_mul``, ``fused_add_rmsnorm``)."""

    name = "cublas+rmsnorm-row"

    def __init__(self, fused_silu_mul: bool = True, fused_add_rmsnorm: bool = True) -> None:
        self.fused_silu_mul = fused_silu_mul
        self.fused_add_rmsnorm = fused_add_rmsnorm

    def silu_mul(self, gate_up: Tensor, out: Tensor | None = None) -> Tensor:
        if self.fused_silu_mul:
            return silu_mul_fused(gate_up, out=out)
        return silu_mul(gate_up, out=out)

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return rmsnorm_bi(x, weight, eps)

    def add_rmsnorm(self, x: Tensor, delta: Tensor, weight: Tensor,
                    eps: float) -> tuple[Tensor, Tensor]:
        """Torch's add then the one-row RMSNorm, or both in that kernel (the norm's bits
        either way)."""
        if self.fused_add_rmsnorm:
            return add_rmsnorm_bi(x, delta, weight, eps)
        return add_then_rmsnorm(self, x, delta, weight, eps)


class GpuLaneOps(GpuFastOps):
    """The lane: cuBLAS products on chunks of exactly ``rows`` rows (a fixed shape, so a
    fixed reduction order) and row-wise RMSNorm. ``rows`` is the whole pass, or a chunk
    whose cuBLAS bits equal the fast path's at its full decode batch (``gemm_classes``).
    ``one_call`` (per weight shape): the row counts at which one call over all the rows was
    probed to give each row the chunk's bits; those run as one call
    (``ops.linear_in_row_chunks``)."""

    def __init__(self, rows: int,
                 one_call: Mapping[tuple[int, int], frozenset[int]] | None = None,
                 fused_silu_mul: bool = True, fused_add_rmsnorm: bool = True) -> None:
        if rows <= 0:
            raise ValueError("rows must be positive")
        super().__init__(fused_silu_mul, fused_add_rmsnorm)
        self.rows = rows
        self.one_call = dict(one_call or {})
        self.name = f"cublas-fixed{rows}+rmsnorm-row"

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return linear_in_row_chunks(x, weight, bias, self.rows, self.one_call)


class TritonBatchInvariantOps(GpuFastOps):
    """batch_invariant mode: the persistent no-split-K matmul for products; the norm and
    the elementwise ops are the fast path's (one row per program, or elementwise: a row's
    bits in any batch)."""

    name = "triton-bi"

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return matmul_bi(x, weight, bias)


@dataclass(frozen=True)
class DecodeInputs:
    """A step's decode rows as the decode kernels take them (built once per step)."""

    tables: Tensor          # int32 block table of each decode row's sequence
    context_lens: Tensor    # int32
    row_seq: Tensor         # int32: row of ``tables`` of each decode row
    row_pos: Tensor         # int32: position of each decode row
    num_splits: int         # split-KV's splits; aligned: the lane kernel's spans


@dataclass
class GpuMeta:
    seg_tables: Tensor      # int32 [S + 1, T] (last row: scratch, for padding rows)
    context_lens: Tensor    # int32 [S]: start + rows of each segment
    row_seg: Tensor         # int32 [N]: segment of each row (padding: S)
    lane_pos: Tensor        # int32 [N]: position, -1 for padding rows
    decode_rows: Tensor     # long: rows of one-row segments
    decode_segs: Tensor     # long: their segments
    max_decode_ctx: int
    prefill_rows: Tensor    # long: rows of multi-row segments, in order
    prefill_segs: Tensor    # long
    cu_seqlens: Tensor      # int32 [P+1]
    max_q_len: int
    all_decode: bool        # every segment is one row, in segment order
    # the decode rows are exactly rows [a, b), the prefill rows exactly rows [c, d) (the
    # scheduler puts decode rows first): attention then reads and writes row slices, with
    # no gather or scatter of q and of its output per layer
    decode_span: tuple[int, int] | None = None
    prefill_span: tuple[int, int] | None = None
    # per-step tensors derived on the first layer and reused by the others
    _decode: dict[tuple[int, bool], DecodeInputs] = field(default_factory=dict, repr=False)
    _prefill: tuple[Tensor, Tensor] | None = field(default=None, repr=False)

    @classmethod
    def build(cls, batch: RowBatch) -> GpuMeta:
        """Kernel metadata from the batch's segment tables (built once, in ``build_rows``)."""
        dev = batch.input_ids.device
        segs = batch.segments
        lens = [s.start + len(s.input_ids) for s in segs]
        dec_rows: list[int] = []
        dec_segs: list[int] = []
        pre_rows: list[int] = []
        pre_segs: list[int] = []
        cu = [0]
        for i, (s, off) in enumerate(zip(segs, batch.seg_offsets, strict=True)):
            m = len(s.input_ids)
            if m == 1:
                dec_rows.append(off)
                dec_segs.append(i)
            else:
                pre_rows.extend(range(off, off + m))
                pre_segs.append(i)
                cu.append(cu[-1] + m)

        def t(x: list[int], dtype: torch.dtype = torch.long) -> Tensor:
            return upload(x, dev, dtype)

        lane_pos = batch.lane_positions.to(torch.int32)
        return cls(batch.seg_tables.to(torch.int32), t(lens, torch.int32),
                   batch.row_seg.to(torch.int32), lane_pos, t(dec_rows), t(dec_segs),
                   max((lens[i] for i in dec_segs), default=0), t(pre_rows), t(pre_segs),
                   t(cu, torch.int32),
                   max((len(segs[i].input_ids) for i in pre_segs), default=0),
                   all_decode=len(dec_rows) == batch.num_rows == len(segs),
                   decode_span=_span(dec_rows), prefill_span=_span(pre_rows))

    def decode_inputs(self, num_kv_heads: int, device: torch.device, aligned: bool,
                      lane_cfg: LaneConfig = TABLE.lane) -> DecodeInputs:
        """The decode rows' kernel inputs (the same for every layer of the step)."""
        key = (num_kv_heads, aligned)
        got = self._decode.get(key)
        if got is not None:
            return got
        rows, segs = self.decode_rows, self.decode_segs
        if aligned:
            splits = lane_spans(self.max_decode_ctx, lane_cfg)
        else:
            splits = choose_num_splits(len(rows), num_kv_heads, self.max_decode_ctx,
                                       num_sms(device))
        if self.all_decode:  # the common case: the step's own tables and rows
            tables, ctx, row_seq, row_pos = (self.seg_tables, self.context_lens, self.row_seg,
                                             self.lane_pos)
        else:
            tables, ctx, row_pos = self.seg_tables[segs], self.context_lens[segs], self.lane_pos[rows]
            row_seq = torch.arange(len(rows), dtype=torch.int32, device=device)
        got = self._decode[key] = DecodeInputs(tables, ctx, row_seq, row_pos, splits)
        return got

    def prefill_inputs(self) -> tuple[Tensor, Tensor]:
        """Block tables and context lengths of the prefill segments."""
        if self._prefill is None:
            self._prefill = (self.seg_tables[self.prefill_segs],
                             self.context_lens[self.prefill_segs])
        return self._prefill


def _span(rows: list[int]) -> tuple[int, int] | None:
    """(a, b) if ``rows`` are exactly a, a+1, ..., b-1 (and not empty)."""
    if rows and rows[-1] - rows[0] == len(rows) - 1:
        return rows[0], rows[-1] + 1
    return None


def rope_write(pool: KVPool, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
               slots: Tensor, rope: Rope) -> Tensor:
    """RoPE on q (in place) and k, K/V into the cache (slots < 0 skipped); returns q."""
    return rope_kv_write(q, k, v, positions, rope[0], rope[1], pool.k(layer), pool.v(layer),
                         slots)


def fast_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor,
                          context_lens: Tensor, row_seq: Tensor, row_pos: Tensor,
                          num_splits: int, aligned: bool, out: Tensor | None = None,
                          lane_cfg: LaneConfig = TABLE.lane) -> Tensor:
    """Fast-path decode attention, one token per row (row i: sequence ``row_seq[i]`` at
    position ``row_pos[i]`` = context length - 1, or -1 for a padding row).

    With ``aligned``, every row goes through the lane's own kernel (one row per program,
    ``num_splits`` spans launched: enough for the longest context). The lane kernel's bits
    do not depend on the rows around a row, nor on the spans launched, so the token gets
    exactly the attention the lane will recompute for it, and its window can verify; a long
    context still runs in parallel, span by span. Else split-KV with ``num_splits``.
    Writes ``out`` when given. Graph-safe: no host sync. ``lane_cfg``: the lane kernel's
    config, the lane's own.
    """
    if not aligned:
        return decode_attention(q, k_cache, v_cache, tables, context_lens,
                                num_splits=num_splits, out=out)
    return lane_attention(q, k_cache, v_cache, tables, row_seq, row_pos, rows_per_program=1,
                          max_spans=num_splits, out=out, cfg=lane_cfg)


def fast_attention_gpu(pool: KVPool, layer: int, q: Tensor, k: Tensor, v: Tensor,
                       batch: RowBatch, meta: GpuMeta, rope: Rope, aligned: bool = True,
                       lane_cfg: LaneConfig = TABLE.lane) -> Tensor:
    q = rope_write(pool, layer, q, k, v, batch.positions, batch.slots, rope)
    kc, vc = pool.k(layer), pool.v(layer)
    dec = meta.decode_inputs(kc.shape[2], q.device, aligned, lane_cfg) \
        if meta.decode_rows.numel() else None

    def decode(qd: Tensor, out: Tensor | None = None) -> Tensor:
        assert dec is not None
        return fast_decode_attention(qd, kc, vc, dec.tables, dec.context_lens, dec.row_seq,
                                     dec.row_pos, dec.num_splits, aligned, out, lane_cfg)

    if dec is not None and meta.all_decode:  # the common case: no gather/scatter of q
        return decode(q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if dec is not None:
        if meta.decode_span is not None:
            a, b = meta.decode_span
            decode(q[a:b], out[a:b])
        else:
            out[meta.decode_rows] = decode(q[meta.decode_rows])
    if meta.prefill_rows.numel():
        tables, ctx = meta.prefill_inputs()
        if meta.prefill_span is not None:
            a, b = meta.prefill_span
            prefill_attention(q[a:b], kc, vc, tables, meta.cu_seqlens, ctx,
                              max_q_len=meta.max_q_len, out=out[a:b])
        else:
            out[meta.prefill_rows] = prefill_attention(
                q[meta.prefill_rows], kc, vc, tables, meta.cu_seqlens, ctx,
                max_q_len=meta.max_q_len)
    return out


def lane_attention_gpu(pool: KVPool, layer: int, q: Tensor, k: Tensor, v: Tensor,
                       batch: RowBatch, meta: GpuMeta, rope: Rope,
                       lane_cfg: LaneConfig = TABLE.lane) -> Tensor:
    q = rope_write(pool, layer, q, k, v, batch.positions, batch.slots, rope)
    return lane_attention(q.contiguous(), pool.k(layer), pool.v(layer), meta.seg_tables,
                          meta.row_seg, meta.lane_pos, cfg=lane_cfg)
