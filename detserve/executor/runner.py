"""Runs the model for fast batches, batch-invariant batches and lane passes."""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

from detserve.executor.attention import (
    RowBatch,
    RowSegment,
    build_rows,
    fast_attention,
    tiled_attention,
)
from detserve.executor.gemm_classes import (
    Alignment,
    probe_lane_one_calls,
    smallest_at_least,
)
from detserve.executor.kv_pool import KVPool
from detserve.executor.ops import FixedShapeOps, TorchOps, pad_rows
from detserve.executor.transfer import upload
from detserve.lane import LaneDecision, LanePass, LaneResult, decide
from detserve.model.llama import LlamaModel, Ops, RowReduce
from detserve.numerics import LaneNumerics, lane_run_rows
from detserve.outputs import TokenLogprob
from detserve.sampler import (
    PickedRows,
    PromptLogprobs,
    SamplingSpec,
    launch_rows,
    token_counts,
)

if TYPE_CHECKING:
    from detserve.executor.graphs import DecodeGraphs, LaneGraph, StepGraphs

log = logging.getLogger(__name__)
CPU_KERNEL_SET = "torch-ref-1"  # the CPU path: torch's ops, in fixed row chunks for the lane


# a launch's sampled tokens on the device and [(segment of the new launch, row of those
# tokens)]: where a segment's input token comes from (``ModelRunner.launch_batch``)
Feed = tuple[Tensor, list[tuple[int, int]]]
# a penalized row's history (``sampler.token_counts``): the generated tokens before its
# segment's last input token, and whether that input is itself a generated token
PenaltyRow = tuple[tuple[int, ...], bool]
# a segment whose prompt logprobs are asked for: (top alternatives, the prompt tokens its
# first rows predict)
PromptRows = tuple[int, tuple[int, ...]]


class LaunchedBatch:
    """A fast-path forward queued on the device; ``result()`` waits for its tokens,
    ``prompt_result()`` for the prompt logprobs of the segments that asked for them."""

    def __init__(self, num_segments: int, want: list[int], picked: PickedRows | None,
                 prompt: dict[int, PromptLogprobs] | None = None) -> None:
        self.prompt = prompt or {}  # segment -> its prompt logprobs
        self.want = want  # segments that sample, in the order of ``tokens``' rows
        self.picked = picked
        self._n = num_segments
        # run before the host reads anything back (a TP runner waits there, with its
        # deadline, for every rank's part of the step)
        self.before_read: Callable[[], None] | None = None

    @property
    def tokens(self) -> Tensor | None:
        """The sampled tokens on the device (row j: segment ``want[j]``), or None."""
        return self.picked.tokens if self.picked is not None else None

    def prompt_result(self) -> dict[int, list[TokenLogprob]]:
        """Segment -> the logprobs of the prompt tokens its rows predict, from the first."""
        if self.before_read is not None:
            self.before_read()
        return {i: p.result() for i, p in self.prompt.items()}

    def result(self) -> list[tuple[int, TokenLogprob | None] | None]:
        """One (token, logprob) or None per segment."""
        if self.before_read is not None:
            self.before_read()
        results: list[tuple[int, TokenLogprob | None] | None] = [None] * self._n
        if self.picked is not None:
            for i, res in zip(self.want, self.picked.result(), strict=True):
                results[i] = res
        return results


class LaneLaunch:
    """A lane pass queued on the device; ``finish()`` waits for its tokens and decides."""

    def __init__(self, lane_pass: LanePass, picked: PickedRows | None, t0: float,
                 prompt: dict[int, PromptLogprobs] | None = None, cuda: bool = False) -> None:
        self.lane_pass, self.picked, self._t0 = lane_pass, picked, t0
        self.prompt = prompt or {}  # segment -> its prompt logprobs
        self.before_read: Callable[[], None] | None = None  # as ``LaunchedBatch``'s
        # behind every copy the pass queued: once it completes, finish() reads without waiting
        self._queued: torch.cuda.Event | None = None
        if cuda:
            self._queued = torch.cuda.Event()
            self._queued.record()

    def ready(self) -> bool:
        """Whether the pass's results are on the host (``finish`` would not wait)."""
        return self._queued is None or self._queued.query()

    def finish(self) -> LaneResult:
        if self.before_read is not None:
            self.before_read()
        picked = self.picked.result() if self.picked is not None else []
        prompt = {i: tuple(p.result()) for i, p in self.prompt.items()}
        decisions = []
        j = 0
        for s, seg in enumerate(self.lane_pass.segments):
            n = len(seg.sample_rows)
            tokens = [t for t, _ in picked[j:j + n]]
            lps = [lp for _, lp in picked[j:j + n]]
            j += n
            if seg.kind == "window":
                acc = decide(seg.candidates, tokens)
                tokens, lps = tokens[:acc + 1], lps[:acc + 1]
            else:
                acc = 0
            decisions.append(LaneDecision(seg.request_id, seg.kind, seg.start, acc,
                                          tuple(tokens), tuple(lps), prompt.get(s, ())))
        return LaneResult(self.lane_pass.pass_id, tuple(decisions),
                          self.lane_pass.padding_rows, time.perf_counter() - self._t0)


class HeadPaddedOps:
    """``base`` with each product of the first ``head`` rows run as a call of exactly
    ``padded`` rows (zero rows appended), and the remaining rows as a call of their own;
    except where ``single_call`` (per weight shape, an ``Alignment``'s) lists the call's row
    count: there one call over all rows already gives the head the padded call's bits.
    ``pads`` (an ``Alignment``'s): products that run a ``padded``-row head at more rows."""

    def __init__(self, base: Ops, head: int, padded: int,
                 single_call: Mapping[tuple[int, int], frozenset[int]] | None = None,
                 counts: Counter[str] | None = None,
                 pads: Mapping[tuple[int, int], Mapping[int, int]] | None = None) -> None:
        if not 0 < head <= padded:
            raise ValueError("need 0 < head <= padded")
        self.base, self.head, self.padded = base, head, padded
        self.single_call = single_call or {}
        self.pads = pads or {}
        self.counts = Counter[str]() if counts is None else counts  # products: one / split

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        one = x.shape[0] in self.single_call.get((weight.shape[0], weight.shape[1]), ())
        self.counts["one" if one or x.shape[0] == self.head else "split"] += 1
        if one:
            return self.base.linear(x, weight, bias)
        h = self.head
        padded = self.pads.get((weight.shape[0], weight.shape[1]), {}).get(self.padded,
                                                                            self.padded)
        out = self.base.linear(pad_rows(x[:h], padded), weight, bias)[:h]
        if x.shape[0] == h:
            return out
        return torch.cat([out, self.base.linear(x[h:], weight, bias)])

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return self.base.rmsnorm(x, weight, eps)

    def add_rmsnorm(self, x: Tensor, delta: Tensor, weight: Tensor,
                    eps: float) -> tuple[Tensor, Tensor]:
        return self.base.add_rmsnorm(x, delta, weight, eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return self.base.silu_mul(gate_up)


class PaddedProductOps:
    """``base`` with the products that ``pads`` lists (weight shape (N, K) -> {rows: padded
    rows}) run on their padded row count. The rows sit in a zeroed buffer of that many rows,
    kept per (K, rows, padded rows) so that a CUDA graph replays no allocation (calls run in stream
    order, so the layers share it): the activation (``silu_mul``, elementwise, whose output
    only the MLP's down product reads) writes its rows straight into the buffer of a product
    with its width, and any other input is copied in. So an activation's output lives only
    until the next activation of its width and rows: a caller multiplies it first (the
    TP-invariant tree's leaves, ``TensorParallel.mlp``). For decode graphs whose
    bucket is in the lane chunk's class for some products and not for others."""

    def __init__(self, base: Ops, pads: Mapping[tuple[int, int], Mapping[int, int]]) -> None:
        self.base, self.pads = base, pads
        self._by_width: dict[tuple[int, int], int] = {  # (K, rows) -> padded rows
            (k, n): p for (_, k), table in pads.items() for n, p in table.items()}
        self._buffers: dict[tuple[int, int, int], Tensor] = {}  # (K, rows, padded)
        # the activation may write into a buffer only where the base's is elementwise and
        # takes one (TorchOps and its GPU subclasses: torch's kernels or the fused one)
        self._own_silu = isinstance(base, TorchOps)

    def _buffer(self, like: Tensor, rows: int, width: int, padded: int) -> Tensor:
        """The zeroed [padded, width] buffer for ``rows`` rows of that width (``like``'s
        dtype and device)."""
        buf = self._buffers.get((width, rows, padded))
        if buf is None:
            buf = self._buffers[(width, rows, padded)] = like.new_zeros((padded, width))
        return buf

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        n = x.shape[0]
        padded = self.pads.get((weight.shape[0], weight.shape[1]), {}).get(n)
        if padded is None or padded <= n:
            return self.base.linear(x, weight, bias)
        buf = self._buffer(x, n, x.shape[1], padded)
        if x.data_ptr() != buf.data_ptr():
            buf[:n].copy_(x)
        return self.base.linear(buf, weight, bias)[:n]

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return self.base.rmsnorm(x, weight, eps)

    def add_rmsnorm(self, x: Tensor, delta: Tensor, weight: Tensor,
                    eps: float) -> tuple[Tensor, Tensor]:
        return self.base.add_rmsnorm(x, delta, weight, eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        n, width = gate_up.shape[0], gate_up.shape[1] // 2
        padded = self._by_width.get((width, n))
        if padded is None or not self._own_silu:
            return self.base.silu_mul(gate_up)
        return cast(TorchOps, self.base).silu_mul(gate_up, out=self._buffer(gate_up, n, width,
                                                                              padded)[:n])


class ModelRunner:
    """Owns the model and the KV pool tensors.

    ``numerics`` names everything that decides a lane row's bits: the fixed pass of
    ``lane_rows`` (G*W) rows, the lm_head's chunk of ``window`` (W) rows, and the row chunk
    of every lane product (``lane_gemm_rows`` when > 0; on CUDA also of the lm_head; on CPU
    also of the lane's attention), so a row's logits never depend on the pass's other rows;
    a pass runs only the chunks its rows fill. ``alignment`` (CUDA, llm42 with an aligned
    fast path): the fast path's decode buckets, per-product pads and unsplit step sizes,
    with which its decode rows get the lane's bits (``HeadPaddedOps``,
    ``PaddedProductOps``); its decode rows that need no split then take the lane's
    attention kernel (``gpu.fast_decode_attention``).
    """

    def __init__(self, model: LlamaModel, pool: KVPool, numerics: LaneNumerics,
                 alignment: Alignment | None = None) -> None:
        self.model = model
        self.pool = pool
        self.numerics = numerics
        self.device = model.embed_tokens.device
        self.cuda = self.device.type == "cuda"
        self.lane_rows = numerics.lane_rows
        self.window = numerics.verify_window
        self.sampling = numerics.sampling  # how launch_rows picks many rows (every pass alike)
        self.fast_ops: Ops = TorchOps()
        self.lane_chunk = numerics.lane_chunk  # row chunk of the lane's products
        self.lane_ops: Ops = FixedShapeOps(self.lane_chunk)
        self.lane_logit_ops: Ops = FixedShapeOps(self.window)
        self.bi_rows = numerics.batch_invariant_rows
        self.bi_ops: Ops = FixedShapeOps(self.bi_rows)
        self.lane_gemm_rows = numerics.lane_gemm_rows
        # CUDA: the lane attention kernel's config (the lane's, and batch_invariant's decode
        # rows'), and the same kernel for the fast path's aligned decode rows
        self.lane_attn = numerics.lane_attention
        self.decode_attn = numerics.decode_attention
        self.align_fast_path = alignment is not None
        self.decode_buckets = alignment.buckets if alignment is not None else None
        self.single_call = dict(alignment.single_call) if alignment is not None else {}
        self.decode_pads = dict(alignment.pads) if alignment is not None else {}
        # eager steps' products with padded decode rows: run as one call or split in two
        self.head_products: Counter[str] = Counter()
        # CUDA: lane products run as one call at these row counts (probed)
        self.lane_one_call: dict[tuple[int, int], frozenset[int]] = {}
        self.kernel_set = CPU_KERNEL_SET
        self.kernel_family = CPU_KERNEL_SET  # the set less what names this rank's shapes
        self.decode_graphs: DecodeGraphs | None = None
        # with an aligned fast path: graphs of the plain fast path, for decode steps whose
        # rows the lane will not verify (``enable_cuda_graphs(plain=True)``)
        self.plain_graphs: DecodeGraphs | None = None
        self.step_graphs: StepGraphs | None = None
        self.lane_graph: LaneGraph | None = None
        if self.cuda:
            from detserve.executor import gpu

            fused = (numerics.fused_silu_mul, numerics.fused_add_rmsnorm)
            self.fast_ops = gpu.GpuFastOps(*fused)
            if numerics.lane_gemm_rows and numerics.lane_one_calls:
                t0 = time.perf_counter()
                self.lane_one_call = probe_lane_one_calls(
                    model.gemm_weights(), numerics.lane_gemm_rows, list(numerics.lane_sizes),
                    model.gemm_biases())
                log.info("lane one calls probed at %d sizes in %.1f s",
                         len(numerics.lane_sizes), time.perf_counter() - t0)
            # the probe's verdicts are part of the numerics too: a verifier's runner must
            # have found the same (they name this rank's product shapes; a product runs as
            # one call only where the probe found the chunk's bits)
            self.kernel_family = gpu.KERNEL_VERSION + numerics.kernel_tags()
            self.kernel_set = self.kernel_family + "".join(
                f"+one{n}x{k}@{','.join(map(str, sorted(v)))}"
                for (n, k), v in sorted(self.lane_one_call.items()))
            self.lane_ops = gpu.GpuLaneOps(self.lane_chunk, self.lane_one_call, *fused)
            if numerics.lane_gemm_rows:
                self.lane_logit_ops = gpu.GpuLaneOps(numerics.lane_gemm_rows,
                                                     self.lane_one_call, *fused)
            self.bi_ops = gpu.TritonBatchInvariantOps(*fused)

    def enable_cuda_graphs(self, decode: str | None, lane: bool, max_batch: int,
                           max_blocks: int, step_rows: int = 0, plain: bool = False) -> None:
        """Capture decode graphs now ("fast" or "bi", up to ``max_batch`` sequences), with
        ``step_rows`` > 0 also graphs of the same kind for steps with prompt chunks of up to
        that many rows, and prepare the lane graph (captured by the lane's thread on its
        first pass). ``plain`` (fast graphs aligned with the lane): also capture the plain
        fast path's, for decode steps with no row the lane will verify."""
        from detserve.executor.graphs import DecodeGraphs, LaneGraph, StepGraphs, step_sizes

        if not self.cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        if decode is not None:
            ops = self.bi_ops if decode == "bi" else self.fast_ops
            buckets = self.decode_buckets if decode == "fast" else None
            graph_ops = (PaddedProductOps(ops, self.decode_pads)
                         if decode == "fast" and self.decode_pads else ops)
            # batch_invariant decode rows give committed bits: the lane's config, always
            one_row = self.decode_attn if decode == "fast" else self.lane_attn
            # (step graphs, like the aligned decode graphs, carry aligned decode rows)
            reduce = self.tp_reduce(decode, aligned=True)
            self.decode_graphs = DecodeGraphs(self.model, self.pool, graph_ops, decode, max_batch,
                                              max_blocks, aligned=self.align_fast_path,
                                              buckets=buckets, lane_cfg=one_row, reduce=reduce)
            self.decode_graphs.capture()
            if decode == "fast" and self.align_fast_path and plain:
                self.plain_graphs = DecodeGraphs(self.model, self.pool, ops, decode, max_batch,
                                                 max_blocks, aligned=False,
                                                 reduce=self.tp_reduce(decode))
                self.plain_graphs.capture()
            if step_rows > 0:
                head = self.decode_graphs.bucket(max_batch) or 0
                head_ops = (HeadPaddedOps(ops, head, head, self.single_call, Counter(),
                                          self.decode_pads)
                            if decode == "fast" and self.decode_buckets and head else None)
                self.step_graphs = StepGraphs(self.model, self.pool, ops, step_sizes(step_rows),
                                              max_blocks, head_ops=head_ops, head=head,
                                              lane_cfg=self.lane_attn, decode_cfg=one_row,
                                              reduce=reduce)
                self.step_graphs.capture()
        if lane:
            self.lane_graph = LaneGraph(self.model, self.pool, self.lane_ops,
                                        self.lane_sizes(), max_blocks, lane_cfg=self.lane_attn,
                                        reduce=self.tp_reduce("lane"))

    @property
    def lane_kernels(self) -> str:
        """The kernels a lane row's bits depend on: the set, or its family with the
        TP-invariant lane or portable products, since the one-call verdicts name this
        rank's product shapes (which follow the TP size) and the card's cuBLAS choices, and
        never change bits."""
        n = self.numerics
        return self.kernel_family if n.tp_invariant_lane or n.portable_products else self.kernel_set

    def lane_sizes(self) -> list[int]:
        """Row counts a lane pass runs at (``LaneNumerics.lane_sizes``)."""
        return list(self.numerics.lane_sizes)

    def lane_run_rows(self, used: int) -> int:
        """Rows a lane pass with ``used`` rows runs: the smallest lane size that holds them."""
        return lane_run_rows(self.numerics.lane_sizes, used)

    def _forward(self, batch: RowBatch, ops: Ops, kind: str, aligned: bool = True) -> Tensor:
        """kind: "fast" (any reduction order), "lane" (fixed M rows), "bi" (batch-invariant).
        ``aligned`` False: no fast decode row here needs the lane's attention bits."""
        attn: Callable[[int, Tensor, Tensor, Tensor], Tensor]
        if self.cuda:
            from detserve.executor import gpu

            meta = gpu.GpuMeta.build(batch)
            fn = gpu.fast_attention_gpu if kind == "fast" else gpu.lane_attention_gpu
            rope = cast(gpu.Rope, (self.model.rope_cos, self.model.rope_sin))
            attn = partial(fn, self.pool, batch=batch, meta=meta, rope=rope,
                           lane_cfg=self.lane_attn)
            if kind == "fast":  # (its decode rows' config of the lane kernel)
                attn = partial(attn, aligned=self.align_fast_path and aligned,
                               lane_cfg=self.decode_attn)
        elif kind == "fast":
            attn = partial(fast_attention, self.pool, batch=batch)
        else:
            rows = self.lane_chunk if kind == "lane" else self.bi_rows
            attn = partial(tiled_attention, self.pool, batch=batch, chunk_rows=rows,
                           per_head=kind == "lane" and self.numerics.tp_invariant_lane)
        return self.model(batch.input_ids, batch.positions,
                          lambda i, q, k, v: attn(i, q, k, v), ops, rope_in_attention=self.cuda,
                          tp_reduce=self.tp_reduce(kind, aligned))

    def tp_reduce(self, kind: str, aligned: bool = False) -> RowReduce:
        """How a forward of ``kind`` sums row-parallel products over TP ranks, eager or
        graphed alike (``LaneNumerics.row_reduce``; ``aligned``: its decode rows must
        carry the lane's bits, where the fast path is aligned at all)."""
        return cast(RowReduce, self.numerics.row_reduce(kind, aligned and self.align_fast_path))

    @torch.inference_mode()
    def run_batch(self, segments: list[RowSegment], sample_specs: list[SamplingSpec | None],
                  batch_invariant: bool = False, align_decode: bool = True
                  ) -> list[tuple[int, TokenLogprob | None] | None]:
        """One fast-path (or batch-invariant) forward; samples the last row of each segment
        whose spec is not None. Returns one (token, logprob) or None per segment.
        ``align_decode=False``: no decode row here will be verified by the lane, so an eager
        step runs its products as one call (no bucket padding) and a decode step replays
        the plain fast path's graphs where there are some (``plain_graphs``)."""
        return self.launch_batch(segments, sample_specs, batch_invariant,
                                 align_decode).result()

    @torch.inference_mode()
    def launch_batch(self, segments: list[RowSegment], sample_specs: list[SamplingSpec | None],
                     batch_invariant: bool = False, align_decode: bool = True,
                     feed: Feed | None = None,
                     penalties: Sequence[PenaltyRow | None] = (),
                     prompt_rows: Sequence[PromptRows | None] = ()) -> LaunchedBatch:
        """``run_batch`` without waiting for the device: the forward and the sampling are
        queued and the result is read later (``LaunchedBatch.result``), so the host can
        plan and queue the next step meanwhile. ``feed`` (tokens on the device, [(segment,
        row of tokens)]) gives those segments' single input token from an earlier launch
        whose tokens have not been read back (their ``input_ids`` hold a placeholder).
        ``penalties`` (per segment, or empty): the history of each penalized segment.
        ``prompt_rows`` (per segment, or empty): (k, the prompt tokens its first rows
        predict) for the segments whose prompt logprobs are asked for (``PromptLogprobs``;
        each row alone in batch_invariant mode)."""
        want = [i for i, s in enumerate(sample_specs) if s is not None]
        ops = self.bi_ops if batch_invariant else self.fast_ops
        # a decode step the lane will verify no row of needs no alignment
        graphs = self.plain_graphs if not align_decode and self.plain_graphs else self.decode_graphs
        prompt: dict[int, PromptLogprobs] = {}
        if (graphs is not None and want and len(segments) <= graphs.max_batch
                and not any(prompt_rows)  # (a graph gives the last rows' logits only)
                and all(len(s.input_ids) == 1 for s in segments)):
            logits = graphs.run(segments, feed)
            if len(want) < len(segments):
                logits = logits[upload(want, self.device)]
        else:
            head = next((i for i, s in enumerate(segments) if len(s.input_ids) != 1),
                        len(segments))
            if not align_decode:
                head = 0
            step_ops = self._padded(ops, head, batch_invariant)
            hidden = self._graphed_step(
                segments, batch_invariant, head if isinstance(step_ops, HeadPaddedOps) else None,
                feed)
            if hidden is None:
                batch = build_rows(segments, self.pool.block_size, self.device)
                if feed is not None:
                    tokens, pairs = feed
                    rows = [batch.seg_offsets[i] for i, _ in pairs]
                    batch.input_ids[upload(rows, self.device)] = tokens[
                        upload([j for _, j in pairs], self.device)]
                hidden = self._forward(batch, step_ops, "bi" if batch_invariant else "fast",
                                       aligned=align_decode)
            offsets = list(itertools.accumulate((len(s.input_ids) for s in segments),
                                                initial=0))
            prompt = self._prompt_logprobs(hidden, offsets, prompt_rows, ops, batch_invariant)
            if not want:
                return LaunchedBatch(len(segments), want, None, prompt)
            last = upload([offsets[i + 1] - 1 for i in want], self.device)
            logits = self.model.logits(hidden[last], self._padded(
                ops, sum(i < head for i in want), batch_invariant))
        specs = [s for s in sample_specs if s is not None]
        positions = [segments[i].start + len(segments[i].input_ids) for i in want]
        # every mode alike: the many-row paths give each row exactly its row-by-row token
        # (a batched argmax, first maximum; one Gumbel pass whose programs never mix rows),
        # so batch_invariant needs no row-by-row sampling, nor do SGLang's and vLLM's
        counts = self._step_counts(segments, want, penalties, feed, logits.shape[-1])
        picked = launch_rows(logits, specs, positions, cfg=self.sampling, counts=counts)
        return LaunchedBatch(len(segments), want, picked, prompt)

    def _prompt_logprobs(self, hidden: Tensor, offsets: list[int],
                         prompt_rows: Sequence[PromptRows | None], ops: Ops, exact: bool
                         ) -> dict[int, PromptLogprobs]:
        """Segment -> ``PromptLogprobs`` of its first rows (``prompt_rows``), from
        ``hidden`` (the step's final-normed rows, segments at ``offsets``)."""
        out: dict[int, PromptLogprobs] = {}
        for i, rows in enumerate(prompt_rows):
            if rows is None:
                continue
            k, targets = rows
            at = upload(list(range(offsets[i], offsets[i] + len(targets))), self.device)
            out[i] = PromptLogprobs(self.model.logits(hidden[at], ops), targets, k, exact)
        return out

    def _step_counts(self, segments: list[RowSegment], want: list[int],
                     penalties: Sequence[PenaltyRow | None], feed: Feed | None, vocab: int
                     ) -> list[Tensor | None]:
        """The token counts of the penalized rows among ``want`` (``sampler.token_counts``):
        their history, and their last input token when it is a generated one, taken from
        ``feed`` on the device when it has not been read back."""
        if not any(penalties):
            return []
        fed = dict(feed[1]) if feed is not None else {}
        out: list[Tensor | None] = []
        for i in want:
            pen = penalties[i]
            if pen is None:
                out.append(None)
                continue
            history, last_generated = pen
            extra = None
            if last_generated and i in fed:
                assert feed is not None
                extra = feed[0][fed[i]]
            elif last_generated:
                history = (*history, segments[i].input_ids[-1])
            out.append(token_counts(history, vocab, self.device, extra))
        return out

    def _graphed_step(self, segments: list[RowSegment], batch_invariant: bool,
                      head: int | None, feed: Feed | None) -> Tensor | None:
        """The step's final-normed hidden states from a step graph of the engine's kind,
        or None when none runs it (no graphs, another kind, or too many rows). ``head``:
        the leading decode rows whose products need the lane's bits, or None."""
        graphs = self.step_graphs
        decode = self.decode_graphs
        if graphs is None or decode is None or (decode.kind == "bi") != batch_invariant:
            return None
        size = graphs.size_for(segments, head)
        return None if size is None else graphs.run(segments, size, head is not None, feed)

    def _padded(self, ops: Ops, head: int, batch_invariant: bool) -> Ops:
        """Eager fast steps: the products of the leading ``head`` single-token rows run on
        their own, padded to their decode bucket, so they get the bits a decode graph of
        that bucket gives them (and with it the lane's); other rows (prefill chunks) run
        separately, except in products whose row count runs the lane chunk's algorithm."""
        if batch_invariant or not self.decode_buckets or not head:
            return ops
        b = smallest_at_least(self.decode_buckets, head)
        return ops if b is None else HeadPaddedOps(ops, head, b, self.single_call,
                                                    self.head_products, self.decode_pads)

    def run_lane(self, lane_pass: LanePass) -> LaneResult:
        """One fixed-shape pass of exactly ``lane_rows`` rows; decides every segment."""
        return self.launch_lane(lane_pass).finish()

    @torch.inference_mode()
    def launch_lane(self, lane_pass: LanePass) -> LaneLaunch:
        """Queue a lane pass on the current stream without waiting for it; ``finish()``
        decides it. The pass runs at the lane size that holds all its rows."""
        t0 = time.perf_counter()
        if lane_pass.rows != self.lane_rows:
            raise ValueError(f"lane pass has {lane_pass.rows} rows, lane is {self.lane_rows}")
        segs = [RowSegment(s.input_ids, s.start, s.block_table) for s in lane_pass.segments]
        batch = build_rows(segs, self.pool.block_size, self.device,
                           pad_to=self.lane_run_rows(lane_pass.used_rows))
        hidden = None
        if self.lane_graph is not None:
            from detserve.executor.graphs import GraphCaptureError

            try:
                hidden = self.lane_graph.run(batch)
            except GraphCaptureError as e:  # before any pass used it: the lane stays eager
                log.warning("lane graph not captured (%s); the lane runs eagerly", e.__cause__)
                self.lane_graph = None
        if hidden is None:
            hidden = self._forward(batch, self.lane_ops, "lane")
        rows = [batch.seg_offsets[i] + r for i, s in enumerate(lane_pass.segments)
                for r in s.sample_rows]
        picked = None
        if rows:
            # (pinned and asynchronous: a blocking copy would wait for the whole stream)
            logits = self.model.logits(hidden[upload(rows, self.device)],
                                       self.lane_logit_ops)
            vocab = logits.shape[-1]
            counts = ([token_counts(s.output_history(r), vocab, self.device)
                       if s.spec.penalized else None
                       for s in lane_pass.segments for r in s.sample_rows]
                      if any(s.spec.penalized for s in lane_pass.segments) else [])
            picked = launch_rows(logits,
                                 [s.spec for s in lane_pass.segments for _ in s.sample_rows],
                                 [s.start + r + 1 for s in lane_pass.segments
                                  for r in s.sample_rows], cfg=self.sampling, counts=counts)
        prompt = self._prompt_logprobs(
            hidden, list(batch.seg_offsets),
            [(s.prompt_logprobs, s.prompt_targets)
             if s.prompt_logprobs is not None and s.prompt_targets else None
             for s in lane_pass.segments], self.lane_logit_ops, exact=True)
        return LaneLaunch(lane_pass, picked, t0, prompt, cuda=self.cuda)
