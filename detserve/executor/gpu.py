"""CUDA execution through the Triton kernels in ``detserve.kernels``.

Same contracts as the plain-torch paths in ``attention.py`` and ``ops.py``:
- fast path: split-KV paged decode attention and varlen paged prefill attention (whatever
  split the context length suggests: shape-dependent reductions are allowed here);
- lane and batch-invariant mode: ``lane_attention`` (tiles aligned to absolute positions,
  no split), and for batch-invariant mode a persistent no-split-K matmul and one-row-per-
  program RMSNorm, so every row's bits are independent of the batch.
Every path rotates q/k and writes the K/V with one fused kernel (``rope_kv_write``, bitwise
equal to the model's RoPE), and normalises with the one-row-per-program RMSNorm.
Metadata tensors are built once per forward (``GpuMeta``), not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from detserve.executor.attention import RowBatch
from detserve.executor.kv_pool import KVPool
from detserve.executor.ops import TorchOps, _silu_mul, run_in_row_chunks
from detserve.kernels._utils import num_sms
from detserve.kernels.batch_invariant import matmul_bi, rmsnorm_bi
from detserve.kernels.config import KERNEL_VERSION, TABLE
from detserve.kernels.decode_attention import choose_num_splits, decode_attention
from detserve.kernels.kv_write import rope_kv_write
from detserve.kernels.lane_attention import lane_attention
from detserve.kernels.prefill_attention import prefill_attention

__all__ = ["KERNEL_VERSION", "GpuFastOps", "GpuLaneOps", "GpuMeta", "Rope",
           "TritonBatchInvariantOps", "fast_attention_gpu", "fast_decode_attention",
           "lane_attention_gpu", "rope_write"]

Rope = tuple[Tensor, Tensor]  # the model's fp32 cos/sin tables, indexed by position


class GpuFastOps(TorchOps):
    """Fast path: cuBLAS for products (any reduction order), one kernel per RMSNorm."""

    name = "cublas+rmsnorm-row"

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return rmsnorm_bi(x, weight, eps)


class GpuLaneOps(GpuFastOps):
    """The lane: cuBLAS products on chunks of exactly ``rows`` rows (a fixed shape, so a
    fixed reduction order) and row-wise RMSNorm. ``rows`` is the whole pass, or a chunk
    whose cuBLAS bits equal the fast path's at its full decode batch (``gemm_classes``)."""

    def __init__(self, rows: int) -> None:
        if rows <= 0:
            raise ValueError("rows must be positive")
        self.rows = rows
        self.name = f"cublas-fixed{rows}+rmsnorm-row"

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return run_in_row_chunks(lambda c: F.linear(c, weight, bias), x, self.rows)


class TritonBatchInvariantOps:
    name = "triton-bi"

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return matmul_bi(x, weight, bias)

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return rmsnorm_bi(x, weight, eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return _silu_mul(gate_up)  # elementwise: the same bits for a row in any batch


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
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        lane_pos = batch.lane_positions.to(torch.int32)
        return cls(batch.seg_tables.to(torch.int32), t(lens, torch.int32),
                   batch.row_seg.to(torch.int32), lane_pos, t(dec_rows), t(dec_segs),
                   max((lens[i] for i in dec_segs), default=0), t(pre_rows), t(pre_segs),
                   t(cu, torch.int32),
                   max((len(segs[i].input_ids) for i in pre_segs), default=0),
                   all_decode=len(dec_rows) == batch.num_rows == len(segs))


def rope_write(pool: KVPool, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
               slots: Tensor, rope: Rope) -> Tensor:
    """RoPE on q (in place) and k, K/V into the cache (slots < 0 skipped); returns q."""
    return rope_kv_write(q, k, v, positions, rope[0], rope[1], pool.k(layer), pool.v(layer),
                         slots)


def fast_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor,
                          context_lens: Tensor, row_seq: Tensor, row_pos: Tensor,
                          num_splits: int, aligned: bool) -> Tensor:
    """Fast-path decode attention, one token per row (row i: sequence ``row_seq[i]`` at
    position ``row_pos[i]`` = context length - 1, or -1 for a padding row).

    With ``aligned``, every row whose context is at most ``aligned_min_tokens_per_split``
    goes through the lane's own kernel (one row per program). The lane kernel's bits do not
    depend on the rows around a row, so the token gets exactly the attention the lane will
    recompute for it, and its window can verify. Longer rows in batches too small to fill
    the GPU take split-KV (``num_splits`` > 1) instead. Graph-safe: no host sync.
    """
    if not aligned:
        return decode_attention(q, k_cache, v_cache, tables, context_lens, num_splits=num_splits)
    if num_splits == 1:
        return lane_attention(q, k_cache, v_cache, tables, row_seq, row_pos, rows_per_program=1)
    short = context_lens <= TABLE.decode.aligned_min_tokens_per_split
    near = lane_attention(q, k_cache, v_cache, tables, row_seq, torch.where(short, row_pos, -1),
                          rows_per_program=1)
    far = decode_attention(q, k_cache, v_cache, tables, torch.where(short, 0, context_lens),
                           num_splits=num_splits)
    return torch.where(short[:, None, None], near, far)


def fast_attention_gpu(pool: KVPool, layer: int, q: Tensor, k: Tensor, v: Tensor,
                       batch: RowBatch, meta: GpuMeta, rope: Rope, aligned: bool = True) -> Tensor:
    q = rope_write(pool, layer, q, k, v, batch.positions, batch.slots, rope)
    kc, vc = pool.k(layer), pool.v(layer)
    out = torch.empty_like(q)
    if meta.decode_rows.numel():
        rows, segs = meta.decode_rows, meta.decode_segs
        splits = choose_num_splits(len(rows), kc.shape[2], meta.max_decode_ctx, num_sms(q.device),
                                   aligned=aligned)
        if meta.all_decode:  # the common case: no gather/scatter of q
            return fast_decode_attention(q, kc, vc, meta.seg_tables, meta.context_lens,
                                         meta.row_seg, meta.lane_pos, splits, aligned)
        seq = torch.arange(len(rows), dtype=torch.int32, device=q.device)
        out[rows] = fast_decode_attention(q[rows], kc, vc, meta.seg_tables[segs],
                                          meta.context_lens[segs], seq, meta.lane_pos[rows],
                                          splits, aligned)
    if meta.prefill_rows.numel():
        out[meta.prefill_rows] = prefill_attention(
            q[meta.prefill_rows], kc, vc, meta.seg_tables[meta.prefill_segs], meta.cu_seqlens,
            meta.context_lens[meta.prefill_segs], max_q_len=meta.max_q_len)
    return out


def lane_attention_gpu(pool: KVPool, layer: int, q: Tensor, k: Tensor, v: Tensor,
                       batch: RowBatch, meta: GpuMeta, rope: Rope) -> Tensor:
    q = rope_write(pool, layer, q, k, v, batch.positions, batch.slots, rope)
    return lane_attention(q.contiguous(), pool.k(layer), pool.v(layer), meta.seg_tables,
                          meta.row_seg, meta.lane_pos)
