"""The engine: requests in, committed tokens out, deterministic where asked.

A step is schedule -> run -> apply: the scheduler plans a fast batch and maybe a lane
pass; the fast batch goes to the runner, the lane pass to the verifier; the tokens read
back and the lane's decisions go to the scheduler, which applies them and the stop
conditions; the output processor turns what changed into outputs. Only committed tokens
ever leave the engine: fast-path candidates of deterministic requests stay internal until
a lane pass confirms or replaces them. Around it: ``request`` (validation, seeds),
``output_processor`` (text, stop strings, deltas), ``stats`` (read on demand), ``faults``
(test-only fault injection).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import platform
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from detserve.block_manager import BlockManager
from detserve.config import LANE_WAIT_STEPS, EngineConfig
from detserve.executor.attention import RowSegment
from detserve.executor.gemm_classes import Alignment, auto_alignment, shared_chunk
from detserve.executor.kv_pool import KVPool
from detserve.executor.runner import LaunchedBatch, ModelRunner
from detserve.faults import FastPathFaults
from detserve.kernels.config import DECODE_LANE_AUTO
from detserve.lane import LanePass, LaneResult, LaneSegment
from detserve.model.llama import LlamaModel
from detserve.model.loader import ModelInfo, load_model, read_model_config
from detserve.model.tokenizer import Tokenizer
from detserve.numerics import LaneNumerics, device_kind
from detserve.output_processor import OutputProcessor
from detserve.outputs import RequestOutput
from detserve.parallel.executor import make_runner, tensor_parallel_model
from detserve.parallel.layout import tree_shapes
from detserve.parallel.shard import rank_weights
from detserve.params import SamplingParams
from detserve.request import SeedPolicy, new_sequence, prompt_ids
from detserve.scheduler import FastItem, LaneItem, Scheduler, SchedulerOutput
from detserve.sequence import PLACEHOLDER, Sequence
from detserve.stats import StepClock, report
from detserve.verifier import InProcessVerifier, ThreadedVerifier, Verifier

log = logging.getLogger(__name__)


@dataclass
class _Launch:
    """A fast batch queued on the device, its tokens not yet read back."""

    items: list[FastItem]
    batch: LaunchedBatch
    rows: dict[int, int]                  # id(sequence) -> its row of the sampled tokens
    offsets: dict[int, int] = field(default_factory=dict)  # fault injection per row
    fed: torch.Tensor | None = None       # the tokens the next step is fed (on the device)
    dropped: set[int] = field(default_factory=set)  # id(sequence): rows after a stop


class LLMEngine:
    def __init__(self, config: EngineConfig, *,
                 verifier_factory: Callable[[ModelRunner], Verifier] | None = None,
                 loaded: tuple[LlamaModel, Tokenizer, ModelInfo] | None = None,
                 kv_storage: Callable[[tuple[int, ...], torch.dtype, str], torch.Tensor]
                 | None = None) -> None:
        """``verifier_factory`` builds the verifier from the runner (default: in-process);
        ``kv_storage(shape, dtype, device)`` allocates the KV pool tensor, e.g. in shared
        memory so a co-located verifier process can map it."""
        self.config = config
        if verifier_factory or kv_storage:
            config.check_outside_lane()
        dtype = getattr(torch, config.dtype)
        device = torch.device(config.device)
        if device.type == "cuda" and device.index is not None:
            # Triton launches on the thread's current device: the engine's is its own (an
            # engine on cuda:1 failed its alignment probe's first Triton product otherwise);
            # plain "cuda" is the current device already
            torch.cuda.set_device(device)
        # at TP > 1 rank 0 loads only its shard (``loaded``, if given, may be the whole model)
        self.model, self.tokenizer, self.model_info = loaded or load_model(
            config.model, dtype=dtype, device=config.device,
            shard=rank_weights(config.model, config.tensor_parallel_size))
        mc = self.model.config
        sc = config.scheduler
        if sc.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {sc.max_model_len} exceeds the model's "
                             f"{mc.max_position_embeddings} positions (max_position_embeddings);"
                             " leave it unset to take the model's")
        # rank 0's shard at TP > 1 (workers started), the model itself at TP=1
        self.model, self._workers = tensor_parallel_model(config, self.model)
        mc = self.model.config  # (a shard's: its heads; the vocabulary whole)
        cc = config.cache
        shape = KVPool.shape_for(mc.num_layers, cc.num_blocks, cc.block_size, mc.num_kv_heads,
                                 mc.head_dim)
        storage = kv_storage(shape, dtype, config.device) if kv_storage else None
        self.pool = KVPool(mc.num_layers, cc.num_blocks, cc.block_size, mc.num_kv_heads,
                           mc.head_dim, dtype, config.device, storage=storage)
        self.blocks = BlockManager(cc.num_blocks, cc.block_size)
        cuda = config.device.startswith("cuda")
        if sc.prefill_batch_tokens is None:
            sc = replace(sc, prefill_batch_tokens=sc.max_num_batched_tokens // 4 if cuda else 0)
        if sc.lane_max_wait_steps is None:
            sc = replace(sc, lane_max_wait_steps=LANE_WAIT_STEPS["cuda" if cuda else "cpu"])
        self.alignment = self._alignment() if cuda and sc.uses_lane else None
        # the lane's GEMM chunk, resolved: the probed one on CUDA (nondeterministic mode has
        # no lane to align with: its decode rows take split-KV attention, the faster kernel)
        self.numerics = LaneNumerics.from_config(
            config, self.alignment.chunk if self.alignment else
            config.lane_gemm_rows if sc.uses_lane else 0,
            portable_products=self.alignment.portable if self.alignment else False)
        if self.alignment is not None:
            self.numerics = replace(self.numerics,
                                    aligned_decode_lane=self._decode_lane(dtype))
        self.runner = make_runner(self.model, self.pool, self.numerics, self.alignment,
                                  self._workers)
        self.outputs = OutputProcessor(self.tokenizer)
        eos = tuple(self.tokenizer.eos_token_ids) or mc.eos_token_ids
        self.scheduler = Scheduler(sc, self.blocks, eos, prefix_caching=cc.enable_prefix_caching,
                                   lane_sizes=self.numerics.lane_sizes,
                                   stop_string_end=self.outputs.stop_string_end)
        if cuda and config.cuda_graphs:
            mode = config.mode
            decode = {"llm42": "fast", "nondeterministic": "fast", "batch_invariant": "bi"}.get(mode)
            self.runner.enable_cuda_graphs(
                decode, lane=mode in ("llm42", "lane_only"),
                max_batch=min(sc.max_num_seqs, config.cuda_graph_max_batch),
                max_blocks=-(-sc.max_model_len // cc.block_size),
                step_rows=min(config.cuda_graph_step_rows, sc.max_num_batched_tokens),
                plain=config.plain_decode_graphs)
        if verifier_factory is None:
            verifier_factory = self._default_verifier_factory(config)
        self.verifier: Verifier = verifier_factory(self.runner)
        self._seqs: dict[str, Sequence] = {}
        self._inflight: dict[int, dict[str, LaneItem]] = {}  # lane passes sent, by pass id
        self._pass_ids = itertools.count()
        self._arrivals = itertools.count()
        self._seeds = SeedPolicy(config.seed)
        self.counters: Counter[str] = Counter()  # read through ``stats()``
        # fault injection (tests and benchmarks) models fast-path drift: never lane or
        # batch-invariant math
        p = config.fastpath_perturbation
        self._faults = (FastPathFaults(p, mc.vocab_size, config.seed)
                        if p > 0 and config.mode in ("llm42", "nondeterministic") else None)
        # plan and queue step n+1 before reading step n's tokens (see ``step``); off on CPU
        # by default, where the host runs the forward itself and nothing would overlap
        self.async_scheduling = (cuda if config.async_scheduling is None
                                 else config.async_scheduling)
        self._launch: _Launch | None = None  # the fast batch whose tokens are unread

    def _alignment(self) -> Alignment | None:
        """On CUDA with ``align_fast_path``: the lane's GEMM chunk and the fast path's decode
        sizes, from this GPU's cuBLAS row classes (``gemm_classes``)."""
        c, sc = self.config, self.config.scheduler
        if not c.align_fast_path:
            return None
        full = min(sc.max_num_seqs, c.cuda_graph_max_batch) if c.cuda_graphs else sc.max_num_seqs
        # eager steps send up to max_num_batched_tokens rows through the layers' products
        # and at most one row per sequence through the lm_head (the last weight)
        weights = self.model.gemm_weights()
        step_rows = [sc.max_num_batched_tokens] * (len(weights) - 1) + [sc.max_num_seqs]
        t0 = time.perf_counter()
        chunk = c.lane_gemm_rows
        if not chunk and c.tp_invariant_lane and not c.portable_lane:
            # the same rows per lane product at every TP size, or no TP invariance: planned
            # from the tree's products alone, the same shapes at every size (portable
            # products have the Triton kernel's bits at any chunk)
            whole = read_model_config(c.model)
            shapes, biased = tree_shapes(whole)
            chunk = shared_chunk(shapes, full, sc.lane_rows, c.device, self.model.dtype,
                                 biased if whole.attention_bias else ())
        got = auto_alignment(weights, full, sc.lane_rows, chunk,
                             step_rows if c.probe_single_calls else (),
                             self.model.gemm_biases(), portable=c.portable_lane)
        log.info("alignment probed over %d product shapes in %.1f s: lane chunk %d",
                 len(weights), time.perf_counter() - t0, got.chunk)
        return got

    def _decode_lane(self, dtype: torch.dtype) -> str:
        """The aligned decode rows' query tile on this GPU (``aligned_decode_lane``,
        resolved): "auto" takes ``DECODE_LANE_AUTO`` where the lane sums with dots and a
        start-up probe at this model's head geometry finds that its decode rows get the
        lane's bits, else the lane's own tile (""). An explicit tile is kept; where the probe
        finds other bits a warning says that its aligned windows will roll back."""
        num = self.numerics
        spec, lane, decode = num.aligned_decode_lane, num.lane_attention, num.decode_attention
        if decode == lane:
            return "" if spec == "auto" else spec
        from detserve.kernels.lane_attention import decode_tile_keeps_bits  # (CUDA only)

        mc = self.model.config
        t0 = time.perf_counter()
        same = decode_tile_keeps_bits(lane, decode, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                                      self.config.cache.block_size, dtype, self.config.device)
        log.info("decode tile %s probed in %.1f s: %s the lane's bits at %d query heads per "
                 "kv head", spec, time.perf_counter() - t0, "keeps" if same else "misses",
                 mc.num_heads // mc.num_kv_heads)
        if spec != "auto":
            if not same:
                log.warning("aligned_decode_lane %s gives decode rows other bits than the "
                            "lane here: windows will roll back", spec)
            return spec
        return DECODE_LANE_AUTO if same else ""

    @staticmethod
    def _default_verifier_factory(config: EngineConfig) -> Callable[[ModelRunner], Verifier]:
        """Lane on its own thread/stream (green context of ``lane_sms`` SMs) when asked or on
        CUDA at TP=1; on CPU the in-process verifier keeps runs reproducible step by step.
        At TP>1 every rank runs its lane passes in a group of their own, in rank 0's order:
        on CUDA in the steps' thread (two threads driving NCCL stalled the ranks)."""
        cuda = config.device.startswith("cuda")
        if cuda and config.tensor_parallel_size > 1:
            return InProcessVerifier
        if config.lane_threaded or cuda:
            return partial(ThreadedVerifier, lane_sms=config.lane_sms)
        return InProcessVerifier

    @property
    def lane_gemm_rows(self) -> int:
        """The lane's GEMM row chunk as resolved (0: none)."""
        return self.numerics.lane_gemm_rows

    @classmethod
    def from_args(cls, model: str, mode: str = "llm42", **kw: object) -> LLMEngine:
        return cls(EngineConfig.create(model, mode, **kw))  # type: ignore[arg-type]

    # ---- requests -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                    prompt_token_ids: list[int] | None = None) -> None:
        """Validate and queue a request. Raises ValueError on bad input (engine unchanged)."""
        ids = prompt_ids(request_id, prompt, params, prompt_token_ids,
                         encode=partial(self.tokenizer.encode, add_special_tokens=True),
                         vocab_size=self.model.config.vocab_size,
                         max_model_len=self.config.scheduler.max_model_len, live=self._seqs)
        seq = new_sequence(request_id, ids, params, mode=self.config.mode,
                           arrival=next(self._arrivals), seeds=self._seeds,
                           stop_ids=self.scheduler.stop_ids)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request; its final output (``abort``) comes with the next step."""
        seq = self._seqs.get(request_id)
        return seq is not None and self.scheduler.abort(seq)

    def fail_lane(self, reason: str) -> list[RequestOutput]:
        """Verification cannot continue (``reason``: the verifier's error). Drops the lane
        passes in flight and finishes every deterministic sequence with ``finish_reason``
        ``"error"``: none of its unverified candidates is committed, its blocks are
        released. Non-deterministic sequences go on untouched. Returns the outputs due now
        (the failed sequences', and any the interrupted step had not released yet).

        The caller keeps stepping the engine; the verifier must not return the dropped
        passes' results (one that still does is ignored), and a later lane pass is
        submitted to it as usual."""
        self._inflight.clear()
        failed = self.scheduler.fail_lane()
        self.counters["lane_failures"] += 1
        self.counters["lane_failed_requests"] += len(failed)
        log.warning("verification unavailable (%s): %d deterministic requests failed",
                    reason, len(failed))
        return self._outputs()

    def has_unfinished_requests(self) -> bool:
        # (aborted requests still owe their final output to the next step)
        return self.scheduler.has_work() or bool(self._inflight) or self._launch is not None

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan and run one step; returns the outputs it released.

        schedule -> run -> apply. With asynchronous scheduling the step queues its fast
        batch on the device first and only then reads the previous step's tokens and does
        that step's host work (stop checks, lane submissions and decisions, outputs) while
        the device runs this one: the device never waits for the host between decode
        steps. Its own tokens enter the scheduler's state as placeholders (``Sequence``)
        and are read by the next step, or now where a lane decision needs one. A row
        planned after what turns out to be a stop token is dropped (the step that planned
        it could not know).
        """
        if self._workers is not None:
            self._workers.check()  # a TP engine whose rank was lost stays failed
        clock = StepClock(self.counters)
        plan, yield_to_lane = self._schedule()
        clock.lap("schedule")
        self._run_fast(plan.fast)
        if plan.fast:
            kind = "decode_step" if all(i.end - i.start == 1 for i in plan.fast) else "mixed_step"
            self.counters[f"{kind}s"] += 1
            clock.lap(kind)
        if plan.lane:
            self._submit_lane(plan.lane)
            clock.lap("lane_submit")
        for result in self._poll_lane(plan, yield_to_lane):
            self._apply_lane(result)
        clock.lap("lane_wait")
        outputs = self._outputs()
        clock.lap("output")
        return outputs

    def _schedule(self) -> tuple[SchedulerOutput, bool]:
        """The step's plan, and whether it gives the GPU to the lane pass in flight instead
        of a decode step (a full weight read) for the few sequences not waiting on it: the
        lane and the fast path share the GPU, so that is time the lane's queue gets back."""
        c = self.counters
        in_flight = self.verifier.in_flight() > 0
        c["lane_in_flight_at_plan"] += in_flight
        yield_to_lane = in_flight and self._lane_bound()
        plan = self.scheduler.schedule(fast=not yield_to_lane)
        c["steps"] += 1
        for seq in plan.preempted:
            c["preemptions"] += 1
            c["preempted_tokens"] += seq.num_committed
        return plan, yield_to_lane

    def _run_fast(self, items: list[FastItem]) -> None:
        """Queue the step's fast batch, then read the previous step's tokens (the device
        runs this one meanwhile). Fast first: a sequence whose window just left for the
        lane may decode past it in this step, writing its last candidate's K/V; the lane
        pass, queued behind this step's kernels, then overwrites that position."""
        prev, self._launch = self._launch, None
        launch = self._launch_fast(items, prev) if items else None
        if prev is not None:
            self._settle(prev)
        if launch is None:
            return
        for item in launch.items:  # its rows enter the scheduler's state as placeholders
            if not self.scheduler.place(item):
                launch.dropped.add(id(item.seq))
                self.counters["dropped_rows"] += 1
        if self.async_scheduling:
            self._launch = launch
        else:
            self._settle(launch)

    def _submit_lane(self, items: list[LaneItem]) -> None:
        """Send the step's lane pass."""
        if self._launch is not None and not self.verifier.stream_ordered:
            # a verifier in another process sees the K/V only once it is written: the
            # batch in flight may write a slot the pass writes too (see Sequence)
            self._settle(self._launch)
        self.verifier.submit(self._lane_pass(items))

    def _poll_lane(self, plan: SchedulerOutput, yield_to_lane: bool) -> list[LaneResult]:
        """The passes decided since the last step (waiting for one where the step has
        nothing better to do)."""
        wait = False
        if self.verifier.in_flight():
            # nothing else to run, or most sequences wait on the lane: let its pass have the
            # GPU rather than run the next decode step (a full weight read) for the few others;
            # but a prompt's next chunk goes out first (it queues behind the pass in flight)
            wait = yield_to_lane or (not self.scheduler.lane_prefill_ready()
                                     and (not plan.fast or self._lane_bound()))
            self.counters["lane_bound_waits"] += yield_to_lane or (wait and bool(plan.fast))
        elif self._inflight and not plan.fast and not plan.lane:
            # passes submitted that no verifier works on (one is being looked for), nothing
            # else to run: let the verifier wait a little rather than spin
            wait = True
        return self.verifier.poll(wait=wait)

    def _lane_bound(self) -> bool:
        """Most sequences wait on a lane that shares the device: a step is better given to
        its pass. A lane on a device of its own gains nothing from the fast path's idling."""
        return self.verifier.shares_device and self.scheduler.lane_bound()

    def _outputs(self) -> list[RequestOutput]:
        """The outputs of the sequences the step changed (the scheduler applies the stop
        conditions first); finished requests are forgotten."""
        outputs = []
        for seq, new in self.scheduler.take_updates():
            rid = seq.request_id
            if self._seqs.get(rid) is not seq:
                continue
            outputs.append(self.outputs.build(seq, new))
            if seq.finished:
                del self._seqs[rid]
        return outputs

    def _launch_fast(self, items: list[FastItem], prev: _Launch | None) -> _Launch:
        """Queue the fast batch on the device. A row whose input token is a placeholder
        takes it from ``prev``'s tokens on the device."""
        segs = [RowSegment(tuple(i.seq.token_ids[i.start:i.end]), i.start, tuple(i.seq.block_table))
                for i in items]
        feed = None
        waiting = [(n, i) for n, i in enumerate(items) if i.seq.token_ids[i.start] == PLACEHOLDER]
        if waiting:
            assert prev is not None and prev.fed is not None, "placeholder with no launch"
            assert all(i.end - i.start == 1 for _, i in waiting), "placeholder inside a chunk"
            feed = (prev.fed, [(n, prev.rows[id(i.seq)]) for n, i in waiting])
            self.counters["fed_rows"] += len(waiting)
        specs = [i.seq.spec if i.sample else None for i in items]
        # decode rows the lane will verify need the lane's bits (see ModelRunner._padded)
        align = any(i.seq.uses_lane and i.end - i.start == 1 for i in items)
        sched = self.scheduler
        batch = self.runner.launch_batch(
            segs, specs, batch_invariant=self.config.mode == "batch_invariant",
            align_decode=align, feed=feed,
            penalties=sched.penalty_rows(items), prompt_rows=sched.prompt_rows(items))
        c = self.counters
        c["fast_passes"] += 1
        c["fast_rows"] += sum(i.end - i.start for i in items)
        c["fast_tokens"] += len(batch.want)
        launch = _Launch(items, batch, {id(items[n].seq): j for j, n in enumerate(batch.want)})
        launch.fed = batch.tokens
        if self._faults is not None:
            # drawn per sampled row in batch order; the next step is fed the perturbed
            # tokens, as it would read them on the host
            launch.offsets = self._faults.draw(len(batch.want))
            c["perturbed_tokens"] += len(launch.offsets)
            if launch.offsets and batch.tokens is not None:
                launch.fed = self._faults.perturb(batch.tokens, launch.offsets)
        return launch

    def _settle(self, launch: _Launch) -> None:
        """Read the launch's tokens back and hand them to the scheduler."""
        if launch is self._launch:
            self._launch = None
        results = launch.batch.result()
        for n, lps in launch.batch.prompt_result().items():
            item = launch.items[n]
            self.scheduler.on_prompt_logprobs(item.seq, item.start, lps)
        vocab = self.model.config.vocab_size
        for item, res in zip(launch.items, results, strict=True):
            if res is None or id(item.seq) in launch.dropped:
                continue
            offset = launch.offsets.get(launch.rows[id(item.seq)], 0)
            self.scheduler.on_token_read(item, (res[0] + offset) % vocab, res[1] or None)

    def _lane_pass(self, items: list[LaneItem]) -> LanePass:
        """The pass of ``items``, registered as in flight and counted."""
        segs = []
        for n, it in enumerate(items):
            seq = it.seq
            if it.kind == "window":  # planned while its last candidate was a placeholder
                it = items[n] = replace(it, candidates=tuple(seq.token_ids[it.start + 1:it.end]))
                assert PLACEHOLDER not in it.candidates, "window sent before its tokens were read"
            history = (tuple(seq.token_ids[seq.num_prompt:it.start])
                       if seq.spec.penalized else ())
            targets = seq.prompt_targets(it.start, it.end) if it.kind == "prefill" else ()
            segs.append(LaneSegment(seq.request_id, it.kind, it.start,
                                    tuple(seq.token_ids[it.start:it.end]), tuple(seq.block_table),
                                    it.candidates, tuple(it.sample_rows), seq.spec, history,
                                    seq.params.prompt_logprobs if targets else None, targets))
        lane_pass = LanePass(next(self._pass_ids), self.config.scheduler.lane_rows, tuple(segs))
        self._inflight[lane_pass.pass_id] = {it.seq.request_id: it for it in items}
        c = self.counters
        c["verify_passes"] += 1
        c["lane_rows"] += lane_pass.rows
        c["lane_padding_rows"] += lane_pass.padding_rows
        c["lane_computed_rows"] += self.runner.lane_run_rows(lane_pass.used_rows)
        c["lane_prefill_rows"] += sum(it.rows for it in items if it.kind == "prefill")
        c["windows"] += sum(it.kind == "window" for it in items)
        return lane_pass

    def _apply_lane(self, result: LaneResult) -> None:
        """Hand a pass's decisions to the scheduler (a window whose run past it is still on
        the device has that token read first: whether the run goes on depends on it)."""
        items = self._inflight.pop(result.pass_id, None)
        if items is None:  # dropped by ``fail_lane``: its sequences have finished
            return
        self.counters["lane_seconds_us"] += int(result.elapsed_s * 1e6)
        for d in result.decisions:
            it = items[d.request_id]
            seq = it.seq
            launch = self._launch
            if (launch is not None and it.kind == "window" and seq.finish_reason != "abort"
                    and it.end < seq.num_tokens and seq.token_ids[it.end] == PLACEHOLDER):
                self._settle(launch)
                self.counters["decision_syncs"] += 1
            rejected = self.scheduler.on_lane_decision(it, list(d.tokens), d.logprobs,
                                                       d.prompt_logprobs)
            if rejected:
                self.counters["rollbacks"] += 1
                self.counters["tokens_rolled_back"] += rejected

    # ---- introspection --------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Counters and figures of the engine so far (``detserve.stats``), built now."""
        return report(self.counters, self.scheduler, self.runner, self.blocks)

    def determinism_profile(self) -> dict[str, object]:
        """What two deterministic responses must share to be comparable bit for bit."""
        dev = self.config.device
        if dev.startswith("cuda"):
            import triton

            d = torch.device(dev)
            props = torch.cuda.get_device_properties(d)
            kind = device_kind(self.config.mode, torch.cuda.get_device_name(d),
                               (props.major, props.minor), props.multi_processor_count,
                               triton.__version__, self.numerics.portable_products)
        else:
            kind = f"cpu-{platform.machine()}-{torch.get_num_threads()}threads"
        prof: dict[str, object] = {
            "model": self.model_info.name,
            "weights_sha256": self.model_info.weights_hash,
            "dtype": self.config.dtype,
            "mode": self.config.mode,
            "kernels": f"{self.runner.kernel_set}/torch-{torch.__version__}",
            "device": kind,
            **self.numerics.profile(self.config.mode),
        }
        if "tp_invariant_lane" not in prof:  # the lane's bits depend on the TP size
            prof["tp_size"] = self.config.tensor_parallel_size
        if "tp_invariant_lane" in prof or "lane_products" in prof:
            prof["kernels"] = f"{self.runner.lane_kernels}/torch-{torch.__version__}"
        if dev.startswith("cuda"):
            prof["cuda_graphs"] = self.config.cuda_graphs  # the lane's GEMMs replayed or eager
        blob = json.dumps(prof, sort_keys=True).encode()
        prof["fingerprint"] = hashlib.sha256(blob).hexdigest()[:16]
        # reported always; in the fingerprint only where the lane's bits depend on it
        prof["tp_size"] = self.config.tensor_parallel_size
        return prof

    def close(self) -> None:
        """Stop the verifier (its worker thread holds the runner and the KV pool) and the
        tensor-parallel workers."""
        self.verifier.close()
        if self._workers is not None:
            self._workers.close()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
