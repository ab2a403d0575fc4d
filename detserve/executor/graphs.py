"""CUDA graphs: one captured forward per fixed row count, replayed with new inputs.

A decoding step of an 8B model launches ~15 kernels per layer; run eagerly from Python that
costs more than the kernels themselves. Graphs remove the launch cost:

- ``DecodeGraphs``: fast-path (or batch-invariant) batches of one new token per sequence,
  padded up to the next captured size. Padding rows write no K/V (slot -1) and attend to
  nothing. For the fast path the padded shape may change cuBLAS's reduction order, which
  the fast path allows; batch-invariant kernels give a row the same bits at any size, so
  replaying a bigger graph changes nothing there.
- ``StepGraphs``: steps that carry prompt chunks (alone or beside decode rows), padded
  to the next captured row count, with the lane's attention kernel for every row.
- ``LaneGraph``: the lane pass, always exactly G*W rows. Every lane pass of the engine
  runs through the same graph, so ``lane_only`` and DVR keep sharing one arithmetic.

Inputs live in static tensors that are overwritten before each replay; outputs are static
tensors the caller reads before the next replay (the engine and the lane thread each own
their graphs and never replay them concurrently with themselves). Each owner captures
into its own memory pool so the decode and lane graphs may run at the same time on
different streams.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from detserve.block_manager import SCRATCH_BLOCK
from detserve.executor.attention import RowBatch, RowSegment
from detserve.executor.gemm_classes import decode_buckets, smallest_at_least
from detserve.executor.gpu import Rope, fast_decode_attention, rope_write
from detserve.executor.kv_pool import KVPool
from detserve.kernels._utils import num_sms
from detserve.kernels.config import TABLE, LaneConfig
from detserve.kernels.decode_attention import choose_num_splits
from detserve.kernels.lane_attention import lane_attention, lane_spans
from detserve.model.llama import LlamaModel, Ops, RowReduce

__all__ = ["DecodeGraphs", "GraphCaptureError", "LaneGraph", "StepGraphs", "capture_graph",
           "step_layout", "step_sizes"]


class GraphCaptureError(RuntimeError):
    """A CUDA graph could not be captured (nothing was replayed from it)."""


def capture_graph(fn: Callable[[], Tensor], pool: Any) -> tuple[torch.cuda.CUDAGraph, Tensor]:
    """Warm ``fn`` up (compiles kernels, creates library handles), then capture it.

    Capture is thread-local so that another thread's host syncs (the engine sampling while
    the lane thread captures, or the reverse) do not invalidate it.
    """
    cur = torch.cuda.current_stream()
    side = cur if cur != torch.cuda.default_stream(cur.device) else torch.cuda.Stream(cur.device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        fn()
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
        out = fn()
    cur.wait_stream(side)
    return graph, out


def _upload_tables(dst: Tensor, segments: Sequence[RowSegment]) -> None:
    """The segments' block tables into the first rows of ``dst`` [rows, width] (int32), as
    one flat buffer (much cheaper than a nested list per step), each row padded to the full
    width with the scratch block; one non-blocking copy."""
    n, width = len(segments), dst.shape[1]
    if not n:
        return
    flat = array("i")
    for s in segments:
        flat.extend(s.block_table)
        flat.extend([SCRATCH_BLOCK] * (width - len(s.block_table)))
    dst[:n].copy_(torch.frombuffer(flat, dtype=torch.int32).view(n, width).pin_memory(),
                  non_blocking=True)


def _feed_prev(prev: Tensor, feed: tuple[Tensor, list[tuple[int, int]]] | None
               ) -> list[tuple[int, int]]:
    """Asynchronous scheduling: copy the previous launch's tokens into ``prev`` on the
    device and return the (segment, row of ``prev``) pairs whose input comes from there."""
    if feed is None:
        return []
    tokens, pairs = feed
    if tokens.numel() > prev.numel():
        raise ValueError("more fed tokens than the graphs' buffer holds")
    prev[:tokens.numel()].copy_(tokens, non_blocking=True)
    return pairs


class DecodeGraphs:
    """Graphs of single-token decode forwards (plus the lm_head) at ``decode_buckets`` sizes.

    ``kind``: "fast" (``fast_decode_attention``: the lane's kernel if ``aligned``, else
    split-KV) or "bi" (batch-invariant ops and position-aligned lane attention).
    """

    def __init__(self, model: LlamaModel, pool: KVPool, ops: Ops, kind: str, max_batch: int,
                 max_blocks: int, aligned: bool = True,
                 buckets: Sequence[int] | None = None,
                 lane_cfg: LaneConfig = TABLE.lane, reduce: RowReduce = "all_reduce") -> None:
        """``buckets``: captured sizes (default ``decode_buckets(max_batch)``); some must
        hold ``max_batch`` sequences, and may be larger (an alignment's padded sizes).
        ``reduce``: how row-parallel products sum over TP ranks (the eager path's)."""
        if kind not in ("fast", "bi"):
            raise ValueError(f"unknown decode graph kind {kind!r}")
        dev = model.embed_tokens.device
        self.model, self.pool, self.ops, self.kind = model, pool, ops, kind
        self.reduce = reduce
        self.aligned = aligned
        self.lane_cfg = lane_cfg  # the lane attention kernel's (bi rows and aligned rows)
        self.block_size = pool.block_size
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.buckets = sorted(buckets) if buckets else decode_buckets(max_batch)
        if self.buckets[-1] < max_batch:
            raise ValueError(f"no captured size holds {max_batch} sequences")
        size = self.buckets[-1]
        self.rope: Rope = (model.rope_cos, model.rope_sin)  # type: ignore[assignment]
        # ids, positions, K/V slots, and where an id comes from: -1 (``ids``) or a row of
        # ``prev``, the previous launch's sampled tokens (asynchronous scheduling feeds them
        # on the device). Uploaded whole, as one contiguous copy, every replay
        self.longs = torch.zeros((4, size), dtype=torch.long, device=dev)
        self.prev = torch.zeros(size, dtype=torch.long, device=dev)
        self.ints = torch.zeros((2, size), dtype=torch.int32, device=dev)   # ctx, lane pos
        self.tables = torch.full((size, max_blocks), SCRATCH_BLOCK, dtype=torch.int32,
                                 device=dev)
        self.row_seq = torch.arange(size, dtype=torch.int32, device=dev)
        # GPU time of the replays (CUDA events around each; read once the next step runs,
        # when the previous step's results have long been synchronised)
        self.gpu_seconds = 0.0
        self.timed_replays = 0
        # replays not yet added (with asynchronous scheduling several may be in flight)
        self._timing: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._mempool = torch.cuda.graph_pool_handle()
        # (bucket, splits) -> graph. A bucket whose longest context needs several splits
        # (or spans) also gets a graph of one, replayed while every context fits one.
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.last: torch.cuda.CUDAGraph | None = None  # the graph replayed last (benchmarks)
        self._hkv, self._sms = model.config.num_kv_heads, num_sms(dev)
        max_ctx = max_blocks * self.block_size
        # the most splits (split-KV) or spans (the lane kernel: aligned or bi rows) a
        # bucket needs; with more than one, the bucket also gets a graph of one
        self._lane = kind == "bi" or aligned
        self._splits = {b: lane_spans(max_ctx, lane_cfg) if self._lane
                        else choose_num_splits(b, self._hkv, max_ctx, self._sms)
                        for b in self.buckets}

    def _forward(self, b: int, splits: int) -> Tensor:
        pos, slots, src = self.longs[1, :b], self.longs[2, :b], self.longs[3, :b]
        ids = torch.where(src >= 0, self.prev[src.clamp(min=0)], self.longs[0, :b])
        ctx, lane_pos, tables = self.ints[0, :b], self.ints[1, :b], self.tables[:b]
        row_seq = self.row_seq[:b]
        pool, rope, fast = self.pool, self.rope, self.kind == "fast"

        def attn(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            q = rope_write(pool, layer, q, k, v, pos, slots, rope)
            kc, vc = pool.k(layer), pool.v(layer)
            if fast:
                return fast_decode_attention(q, kc, vc, tables, ctx, row_seq, lane_pos, splits,
                                             self.aligned, lane_cfg=self.lane_cfg)
            return lane_attention(q.contiguous(), kc, vc, tables, row_seq, lane_pos,
                                  max_spans=splits, cfg=self.lane_cfg)

        hidden = self.model(ids, pos, attn, self.ops, rope_in_attention=True,
                            tp_reduce=self.reduce)
        return self.model.logits(hidden, self.ops)

    def capture(self) -> None:
        """Capture every bucket, largest first (smaller ones reuse its pool memory)."""
        self.longs.zero_()
        self.longs[2:].fill_(-1)  # warm-up rows write no K/V ...
        self.ints[0].zero_()     # ... and attend to nothing
        self.ints[1].fill_(-1)
        for b in reversed(self.buckets):
            variants = {self._splits[b], 1}
            for splits in sorted(variants, reverse=True):
                self._graphs[(b, splits)] = capture_graph(partial(self._forward, b, splits),
                                                     self._mempool)

    def bucket(self, n: int) -> int | None:
        return smallest_at_least(self.buckets, n)

    def _fill(self, segments: list[RowSegment], src: list[int]) -> int:
        """Upload the replay's inputs: three contiguous copies (the static buffers' whole
        rows), since a copy into part of a row costs a second operation on the device."""
        n = len(segments)
        b = self.bucket(max(n, 1)) or self.max_batch
        size, bs = self.buckets[-1], self.block_size
        ids, pos, slots = [], [], []
        for s in segments:
            p = s.start
            ids.append(max(s.input_ids[0], 0))  # (a placeholder's id comes from ``prev``)
            pos.append(p)
            slots.append(s.block_table[p // bs] * bs + p % bs)
        pad = size - n
        longs = torch.tensor([ids + [0] * pad, pos + [0] * pad, slots + [-1] * pad,
                              src + [-1] * (size - len(src))],
                             dtype=torch.long, pin_memory=True)
        ints = torch.tensor([[p + 1 for p in pos] + [0] * pad, pos + [-1] * pad],
                            dtype=torch.int32, pin_memory=True)
        self.longs.copy_(longs, non_blocking=True)
        self.ints.copy_(ints, non_blocking=True)
        # rows past ``n`` keep old tables, read by no one (context 0)
        _upload_tables(self.tables, segments)
        return b

    def run(self, segments: list[RowSegment],
            feed: tuple[Tensor, list[tuple[int, int]]] | None = None) -> Tensor:
        """fp32 logits [n, vocab] of the segments' next tokens (a view of a static buffer).
        ``feed`` (tokens on the device, [(segment, row of tokens)]): those segments' input
        token, taken on the device (their ``input_ids`` hold a placeholder)."""
        n = len(segments)
        if not 0 < n <= self.max_batch or any(len(s.input_ids) != 1 for s in segments):
            raise ValueError("decode graphs take 1..max_batch single-token segments")
        if any(len(s.block_table) > self.max_blocks for s in segments):
            raise ValueError("block table longer than the graphs' max_blocks")
        src: list[int] = []
        if feed is not None:
            src = [-1] * n
            for i, j in _feed_prev(self.prev, feed):
                src[i] = j
        b = self._fill(segments, src)
        splits = 1
        if self._splits[b] > 1:
            max_ctx = context_of(segments)  # (single-token segments)
            need = lane_spans(max_ctx, self.lane_cfg) if self._lane \
                else choose_num_splits(b, self._hkv, max_ctx, self._sms)
            splits = 1 if need == 1 else self._splits[b]
        graph, logits = self._graphs[(b, splits)]
        self.settle_timing()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        self._timing.append((start, end))
        self.last = graph
        return logits[:n]

    def settle_timing(self) -> None:
        """Add the GPU time of the replays that have finished to ``gpu_seconds``."""
        while self._timing and self._timing[0][1].query():
            start, end = self._timing.popleft()
            self.gpu_seconds += start.elapsed_time(end) / 1e3
            self.timed_replays += 1


def step_sizes(max_rows: int) -> list[int]:
    """Captured row counts of steps with prompt chunks: 16, 32, 48, 64, 96, then steps of 64
    to 256, of 128 to 1024, of 256 beyond, and ``max_rows`` (the token budget) itself: a
    step runs at most 1.5x its rows (past 16)."""
    sizes = [16, 32, 48, 64, 96, *range(128, 257, 64), *range(384, 1025, 128),
             *range(1280, max_rows, 256)]
    return sorted({s for s in sizes if s < max_rows} | {max_rows})


def span_variants(max_blocks: int, block_size: int, cfg: LaneConfig) -> tuple[int, ...]:
    """The lane kernel's span counts graphs are captured at: one, and the most a table of
    ``max_blocks`` needs (when more). A graph of one runs every step or pass whose contexts
    fit the first span, so short contexts launch no idle span programs."""
    most = lane_spans(max_blocks * block_size, cfg)
    return (1,) if most == 1 else (1, most)


def context_of(segments: Sequence[RowSegment]) -> int:
    """The longest context a step's segments attend over (its last row's included)."""
    return max((s.start + len(s.input_ids) for s in segments), default=1)


def spans_for(variants: tuple[int, ...], context: int, cfg: LaneConfig) -> int:
    """The smallest of ``variants`` whose spans hold a context of ``context`` positions."""
    need = lane_spans(context, cfg)
    return next(v for v in variants if v >= need)


def step_layout(segments: Sequence[RowSegment], src: Mapping[int, int], size: int,
                block_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """A step's rows as the graph's inputs, padded to ``size``: ``longs`` = [ids, positions,
    K/V slots, source row in the previous launch's tokens or -1], ``ints`` = [segment of the
    row, position if the row is a segment's only one (a decode row) else -1, position if it
    is one of several (a prompt chunk's) else -1]. ``src``: segment -> row of the previous
    launch's tokens that gives its (single) input. Padding rows write no K/V (slot -1) and
    attend to nothing (both positions -1)."""
    longs: list[list[int]] = [[], [], [], []]
    ints: list[list[int]] = [[], [], []]
    for i, seg in enumerate(segments):
        n = len(seg.input_ids)
        for r in range(n):
            p = seg.start + r
            longs[0].append(max(seg.input_ids[r], 0))  # (a placeholder's id comes from src)
            longs[1].append(p)
            longs[2].append(seg.block_table[p // block_size] * block_size + p % block_size)
            longs[3].append(src.get(i, -1) if r == 0 else -1)
            ints[0].append(i)
            ints[1].append(p if n == 1 else -1)
            ints[2].append(-1 if n == 1 else p)
    pad = size - len(longs[0])
    if pad < 0:
        raise ValueError(f"{len(longs[0])} rows do not fit a step of {size}")
    for row, fill in zip(longs + ints, (0, 0, -1, -1, 0, -1, -1), strict=True):
        row.extend([fill] * pad)
    return longs, ints


class StepGraphs:
    """Fast-path (or batch-invariant) steps that carry prompt chunks, as graphs.

    Run eagerly, such a step of the 8B shape launches ~2,000 kernels from Python, ~23 ms of
    host time whatever the chunk's size, where a decode step is one graph replay. Here every
    row, a decode row or a prompt chunk's, is one query token of a segment (a sequence's
    consecutive positions); the step is padded to the next of ``sizes``; padding rows write
    no K/V and attend to nothing. Attention is the lane's kernel, which takes any mix of
    segments in a fixed launch grid: decode rows one per program (as the decode graphs run
    them), a chunk's rows several per program so that they read each KV tile once; a row's
    bits do not depend on which (``lane_attention``'s invariant). ``decode_cfg``: the
    kernel's config for the decode rows (``EngineConfig.aligned_decode_lane``; default
    ``lane_cfg``, the lane's own, which the prompt rows always take).

    ``ops``: the products' reduction policy. ``head_ops`` (optional, the fast path aligned
    with the lane): a second graph per size above ``head`` whose products run the step's
    first ``head`` rows as a call of their own (``HeadPaddedOps``), so that leading decode
    rows get the bits of that bucket's decode graph, and with them the lane's.
    """

    def __init__(self, model: LlamaModel, pool: KVPool, ops: Ops, sizes: Sequence[int],
                 max_blocks: int, head_ops: Ops | None = None, head: int = 0,
                 lane_cfg: LaneConfig = TABLE.lane, decode_cfg: LaneConfig | None = None,
                 reduce: RowReduce = "all_reduce") -> None:
        dev = model.embed_tokens.device
        self.model, self.pool, self.max_blocks = model, pool, max_blocks
        self.reduce = reduce  # as ``DecodeGraphs``'
        self.sizes = sorted(sizes)
        self.head = head if head_ops is not None else 0
        self.lane_cfg = lane_cfg  # prompt rows
        self.decode_cfg = decode_cfg or lane_cfg  # decode rows (one row a program)
        self.rope: Rope = (model.rope_cos, model.rope_sin)  # type: ignore[assignment]
        rows = self.sizes[-1]
        self.longs = torch.zeros((4, rows), dtype=torch.long, device=dev)
        self.ints = torch.zeros((3, rows), dtype=torch.int32, device=dev)
        self.prev = torch.zeros(rows, dtype=torch.long, device=dev)
        self.tables = torch.full((rows, max_blocks), SCRATCH_BLOCK, dtype=torch.int32,
                                 device=dev)
        self._mempool = torch.cuda.graph_pool_handle()
        self._ops = {False: ops, True: head_ops}
        self.spans = span_variants(max_blocks, pool.block_size, lane_cfg)
        # (size, aligned, spans) -> graph
        self._graphs: dict[tuple[int, bool, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.replays = 0
        self.aligned_replays = 0  # of which the products split at ``head``

    def _forward(self, n: int, ops: Ops, spans: int) -> Tensor:
        pos, slots, src = self.longs[1, :n], self.longs[2, :n], self.longs[3, :n]
        ids = torch.where(src >= 0, self.prev[src.clamp(min=0)], self.longs[0, :n])
        row_seg, one_pos, many_pos = self.ints[0, :n], self.ints[1, :n], self.ints[2, :n]
        single = (one_pos >= 0)[:, None, None]
        pool, rope, tables = self.pool, self.rope, self.tables

        def attn(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            q = rope_write(pool, layer, q, k, v, pos, slots, rope).contiguous()
            kc, vc = pool.k(layer), pool.v(layer)
            one = lane_attention(q, kc, vc, tables, row_seg, one_pos, rows_per_program=1,
                                 max_spans=spans, cfg=self.decode_cfg)
            many = lane_attention(q, kc, vc, tables, row_seg, many_pos, max_spans=spans,
                                  cfg=self.lane_cfg)
            return torch.where(single, one, many)

        return self.model(ids, pos, attn, ops, rope_in_attention=True, tp_reduce=self.reduce)

    def capture(self) -> None:
        """Capture every size and variant, largest first (smaller ones reuse its memory)."""
        self.longs.zero_()
        self.longs[2:].fill_(-1)  # warm-up rows write no K/V ...
        self.ints[0].zero_()
        self.ints[1:].fill_(-1)   # ... and attend to nothing
        for n in reversed(self.sizes):
            for aligned in (True, False):
                ops = self._ops[aligned]
                if ops is not None and (not aligned or n > self.head):
                    for spans in reversed(self.spans):
                        self._graphs[(n, aligned, spans)] = capture_graph(
                            partial(self._forward, n, ops, spans), self._mempool)

    def size_for(self, segments: Sequence[RowSegment], head: int | None) -> int | None:
        """The captured size that runs these segments, or None (they run eagerly).
        ``head``: the leading decode rows that need the lane's bits (the aligned variant),
        or None."""
        rows = sum(len(s.input_ids) for s in segments)
        if any(len(s.block_table) > self.max_blocks for s in segments):
            return None
        if head is not None:
            if head > self.head:
                return None
            rows = max(rows, self.head + 1)
        n = smallest_at_least(self.sizes, rows)
        return n if n is not None and (n, head is not None, 1) in self._graphs else None

    def run(self, segments: Sequence[RowSegment], size: int, aligned: bool,
            feed: tuple[Tensor, list[tuple[int, int]]] | None = None) -> Tensor:
        """Final-normed hidden states [size, hidden] of the step's rows, in segment order
        (a static buffer; ``size`` from ``size_for``). ``feed``: as ``DecodeGraphs.run``."""
        src = dict(_feed_prev(self.prev, feed))
        longs, ints = step_layout(segments, src, size, self.pool.block_size)
        self.longs[:, :size].copy_(torch.tensor(longs, dtype=torch.long, pin_memory=True),
                                   non_blocking=True)
        self.ints[:, :size].copy_(torch.tensor(ints, dtype=torch.int32, pin_memory=True),
                                  non_blocking=True)
        _upload_tables(self.tables, segments)
        spans = spans_for(self.spans, context_of(segments), self.lane_cfg)
        graph, hidden = self._graphs[(size, aligned, spans)]
        graph.replay()
        self.replays += 1
        self.aligned_replays += aligned
        return hidden


class LaneGraph:
    """The lane pass as graphs, one per row count it runs at (``sizes``: the whole pass, or
    each multiple of the lane's GEMM chunk up to it and sizes between), all captured on the
    first pass on the lane's own stream (inside its green context when it has one), largest
    first: a capture in the middle of a run would hold that pass up for a whole capture."""

    def __init__(self, model: LlamaModel, pool: KVPool, ops: Ops, sizes: Sequence[int],
                 max_blocks: int, lane_cfg: LaneConfig = TABLE.lane,
                 reduce: RowReduce = "ordered") -> None:
        dev = model.embed_tokens.device
        self.model, self.pool, self.ops = model, pool, ops
        self.reduce = reduce  # as ``DecodeGraphs``'
        self.lane_cfg = lane_cfg
        self.sizes = sorted(sizes)
        rows = self.sizes[-1]
        self.max_blocks = max_blocks
        self.rope: Rope = (model.rope_cos, model.rope_sin)  # type: ignore[assignment]
        self.longs = torch.zeros((3, rows), dtype=torch.long, device=dev)   # ids, pos, slots
        self.ints = torch.zeros((2, rows), dtype=torch.int32, device=dev)   # row seg, lane pos
        # a pass has at most ``rows`` segments, plus the scratch row for padding
        self.tables = torch.full((rows + 1, max_blocks), SCRATCH_BLOCK, dtype=torch.int32,
                                 device=dev)
        self._mempool = torch.cuda.graph_pool_handle()
        self.spans = span_variants(max_blocks, pool.block_size, lane_cfg)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}

    def _forward(self, n: int, spans: int) -> Tensor:
        ids, pos, slots = self.longs[0, :n], self.longs[1, :n], self.longs[2, :n]
        row_seg, lane_pos = self.ints[0, :n], self.ints[1, :n]
        pool, rope, tables = self.pool, self.rope, self.tables

        def attn(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            q = rope_write(pool, layer, q, k, v, pos, slots, rope)
            return lane_attention(q.contiguous(), pool.k(layer), pool.v(layer), tables,
                                  row_seg, lane_pos, max_spans=spans, cfg=self.lane_cfg)

        return self.model(ids, pos, attn, self.ops, rope_in_attention=True,
                          tp_reduce=self.reduce)

    def run(self, batch: RowBatch) -> Tensor:
        """Final-normed hidden states [rows, hidden] of the pass (a static buffer)."""
        n = batch.num_rows
        if n not in self.sizes:
            raise ValueError(f"lane pass has {n} rows, graphs have {self.sizes}")
        segs, width = batch.seg_tables.shape
        if width > self.max_blocks:
            raise ValueError("block table longer than the lane graph's max_blocks")
        if not self._graphs:
            # blank rows: no K/V written (slot -1), attention on the scratch block only
            self.longs.zero_()
            self.longs[2].fill_(-1)
            self.ints.zero_()
            for size in reversed(self.sizes):
                for spans in reversed(self.spans):
                    self._capture(size, spans)
        self.longs[0, :n].copy_(batch.input_ids)
        self.longs[1, :n].copy_(batch.positions)
        self.longs[2, :n].copy_(batch.slots)
        self.ints[0, :n].copy_(batch.row_seg)
        self.ints[1, :n].copy_(batch.lane_positions)
        self.tables[:segs, :width].copy_(batch.seg_tables)
        spans = spans_for(self.spans, width * self.pool.block_size, self.lane_cfg)
        graph, hidden = self._graphs[(n, spans)]
        graph.replay()
        return hidden

    def _capture(self, n: int, spans: int) -> None:
        try:
            self._graphs[(n, spans)] = capture_graph(partial(self._forward, n, spans),
                                                     self._mempool)
        except RuntimeError as e:
            raise GraphCaptureError("lane graph capture failed") from e
