"""The engine: requests in, committed tokens out, deterministic where asked.

Per step: the scheduler plans a fast batch and maybe a lane pass; the lane pass goes to the
verifier, the fast batch to the runner; lane decisions are applied as they come back.
Only committed tokens ever leave the engine: fast-path candidates of deterministic
requests stay internal until a lane pass confirms or replaces them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import platform
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from detserve.block_manager import BlockManager
from detserve.config import EngineConfig
from detserve.executor.attention import RowSegment
from detserve.executor.gemm_classes import Alignment, auto_alignment
from detserve.executor.kv_pool import KVPool
from detserve.executor.runner import (
    LaneLaunch,
    LaunchedBatch,
    ModelRunner,
    PenaltyRow,
    PromptRows,
)
from detserve.executor.transfer import upload
from detserve.lane import LanePass, LaneResult, LaneSegment
from detserve.model.llama import LlamaModel
from detserve.model.loader import ModelInfo, load_model
from detserve.model.tokenizer import Tokenizer
from detserve.numerics import LaneNumerics
from detserve.outputs import RequestOutput
from detserve.params import SamplingParams
from detserve.sampler import SamplingSpec
from detserve.scheduler import LANE_STATES, FastItem, LaneItem, Scheduler, SchedulerOutput
from detserve.sequence import PLACEHOLDER, Sequence
from detserve.verifier import InProcessVerifier, ThreadedVerifier, Verifier


@dataclass
class _Launch:
    """A fast batch queued on the device, its tokens not yet read back."""

    items: list[FastItem]
    batch: LaunchedBatch
    rows: dict[int, int]                  # id(sequence) -> its row of the sampled tokens
    offsets: dict[int, int] = field(default_factory=dict)  # fault injection per row
    fed: torch.Tensor | None = None       # the tokens the next step is fed (on the device)
    dropped: set[int] = field(default_factory=set)  # id(sequence): rows after a stop
    lane: LaneLaunch | None = None        # the lane pass these rows rode in, undecided


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
        dtype = getattr(torch, config.dtype)
        self.model, self.tokenizer, self.model_info = loaded or load_model(
            config.model, dtype=dtype, device=config.device)
        mc = self.model.config
        sc = config.scheduler
        if sc.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {sc.max_model_len} exceeds the model's "
                             f"{mc.max_position_embeddings} positions")
        cc = config.cache
        shape = KVPool.shape_for(mc.num_layers, cc.num_blocks, cc.block_size, mc.num_kv_heads,
                                 mc.head_dim)
        storage = kv_storage(shape, dtype, config.device) if kv_storage else None
        self.pool = KVPool(mc.num_layers, cc.num_blocks, cc.block_size, mc.num_kv_heads,
                           mc.head_dim, dtype, config.device, storage=storage)
        self.blocks = BlockManager(cc.num_blocks, cc.block_size)
        eos = tuple(self.tokenizer.eos_token_ids) or mc.eos_token_ids
        cuda = config.device.startswith("cuda")
        if sc.prefill_batch_tokens is None:
            sc = replace(sc, prefill_batch_tokens=sc.max_num_batched_tokens // 4 if cuda else 0)
        self.alignment = self._alignment() if cuda and sc.uses_lane else None
        # the lane's GEMM chunk, resolved: the probed one on CUDA (nondeterministic mode has
        # no lane to align with: its decode rows take split-KV attention, the faster kernel)
        self.lane_gemm_rows = (self.alignment.chunk if self.alignment else
                               config.lane_gemm_rows if sc.uses_lane else 0)
        self.numerics = LaneNumerics.from_config(config, self.lane_gemm_rows)
        self.runner = ModelRunner(self.model, self.pool, self.numerics, self.alignment)
        self.scheduler = Scheduler(sc, self.blocks, eos, prefix_caching=cc.enable_prefix_caching,
                                   lane_sizes=self.numerics.lane_sizes)
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
        # unfinished sequences with penalties / asking for prompt logprobs: while there are
        # none, a step spends no host time on them (a loop over its rows)
        self._with: Counter[str] = Counter()
        # sequences whose committed tokens or state changed since the last step's outputs,
        # with their committed count before the change (only these get an output)
        self._touched: dict[str, int] = {}
        self._inflight: dict[int, dict[str, LaneItem]] = {}
        self._pass_ids = itertools.count()
        self._arrivals = itertools.count()
        self._perturb_rng = random.Random(config.seed)
        self._seed_rng = random.Random(config.seed ^ 0x5EED)
        self.counters: Counter[str] = Counter()
        # fault injection models fast-path drift: it hits every fast-path token (lane-verified
        # candidates and final non-deterministic tokens alike), never lane or batch-invariant math
        self._perturbs_fast_path = config.mode in ("llm42", "nondeterministic")
        # plan and queue step n+1 before reading step n's tokens (see ``step``); off on CPU
        # by default, where the host runs the forward itself and nothing would overlap
        self.async_scheduling = (cuda if config.async_scheduling is None
                                 else config.async_scheduling)
        self._launch: _Launch | None = None  # the fast batch whose tokens are unread
        self._lane_done: list[LaneResult] = []  # decided passes that carried riders
        self.lane_riders = (config.lane_riders and config.mode == "llm42"
                            and config.lane_sms is None
                            and getattr(self.verifier, "runner", None) is self.runner)

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
        return auto_alignment(weights, full, sc.lane_rows, c.lane_gemm_rows,
                              step_rows if c.probe_single_calls else (),
                              self.model.gemm_biases())

    @staticmethod
    def _default_verifier_factory(config: EngineConfig) -> Callable[[ModelRunner], Verifier]:
        """Lane on its own thread/stream (green context of ``lane_sms`` SMs) when asked or on
        CUDA; on CPU the in-process verifier keeps runs reproducible step by step."""
        if config.lane_threaded or config.device.startswith("cuda"):
            return partial(ThreadedVerifier, lane_sms=config.lane_sms)
        return InProcessVerifier

    @classmethod
    def from_args(cls, model: str, mode: str = "llm42", **kw: object) -> LLMEngine:
        return cls(EngineConfig.create(model, mode, **kw))  # type: ignore[arg-type]

    # ---- requests -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                    prompt_token_ids: list[int] | None = None) -> None:
        """Validate and queue a request. Raises ValueError on bad input (engine unchanged)."""
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._seqs:
            raise ValueError(f"duplicate request_id {request_id!r}")
        if prompt_token_ids is None:
            if not isinstance(prompt, str) or not prompt:
                raise ValueError("prompt must be a non-empty string")
            prompt_token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model.config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        limit = self.config.scheduler.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; the context holds {limit} "
                             "(prompt plus at least one generated token)")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError("stop_token_ids out of vocabulary range")
        if any(t >= vocab for t in params.logit_bias or ()):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        mode = self.config.mode
        uses_lane = mode == "lane_only" or (mode == "llm42" and params.is_deterministic)
        deterministic = uses_lane or mode == "batch_invariant"
        seq = Sequence(request_id, ids, params, uses_lane=uses_lane,
                       deterministic=deterministic, arrival=next(self._arrivals))
        seq.stats.arrival_time = time.monotonic()
        self._seqs[request_id] = seq
        seq_seed = params.seed
        if seq_seed is None:
            seq_seed = self.config.seed if deterministic else self._seed_rng.getrandbits(63)
        seq.spec = SamplingSpec(
            temperature=float(params.temperature), top_p=float(params.top_p), top_k=params.top_k,
            seed=seq_seed, logprobs=params.logprobs, min_tokens=params.min_tokens,
            prompt_len=len(ids), stop_ids=tuple(sorted(self.scheduler.stop_ids(seq))),
            logit_bias=params.logit_bias_pairs, presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty)
        self._with["penalties"] += seq.spec.penalized
        self._with["prompt_logprobs"] += params.prompt_logprobs is not None
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        seq = self._seqs.get(request_id)
        if seq is None or seq.finished:
            return False
        seq.finish_reason = "abort"
        if not seq.in_lane:  # else released when its lane pass returns
            self._touch(seq)  # its final output goes out with the next step
            self._finish(seq, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        # (aborted requests still owe their final output to the next step)
        return (self.scheduler.has_work() or bool(self._inflight) or bool(self._touched)
                or self._launch is not None)

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan and run one step; returns the outputs it released (see ``_step``)."""
        return self._step()

    def _step(self) -> list[RequestOutput]:
        """Plan and run one step; returns the outputs it released.

        With asynchronous scheduling the step queues its fast batch on the device first
        and only then reads the previous step's tokens and does that step's host work
        (stop checks, lane submissions and decisions, outputs) while the device runs this
        one: the device never waits for the host between decode steps. Its own tokens
        enter the scheduler's state as placeholders (``Sequence``) and are read by the
        next step, or now where a lane decision needs one. A row planned after what turns
        out to be a stop token is dropped (the step that planned it could not know).
        """
        clock = time.perf_counter
        c = self.counters
        t0 = clock()
        # most sequences wait on the lane and a pass is in flight: this step gives the GPU
        # to the lane instead of a decode step (a full weight read) for the few others; the
        # lane and the fast path share the GPU, so that is time the lane's queue gets back
        in_flight = self.verifier.in_flight() > 0
        c["lane_in_flight_at_plan"] += in_flight
        yield_to_lane = in_flight and self.scheduler.lane_bound()
        out = self.scheduler.schedule(fast=not yield_to_lane,
                                      riders=self.lane_riders and not in_flight)
        t1 = clock()
        c["schedule_us"] += int((t1 - t0) * 1e6)
        c["steps"] += 1
        for seq in out.preempted:
            c["preemptions"] += 1
            c["preempted_tokens"] += seq.num_committed
        # fast first: a sequence whose window just left for the lane may decode past it in
        # this step, writing its last candidate's K/V; the lane pass, queued behind this
        # step's kernels, then overwrites that position with its own K/V
        prev, self._launch = self._launch, None
        ride = self.lane_riders and not in_flight and self._riders_fit(out)
        launch: _Launch | None
        if ride:  # (the pass's windows need their candidates read: this step waits for prev)
            if prev is not None:
                self._settle(prev)
            launch = self._launch_riders(out)
        else:
            launch = self._launch_fast(out.fast, prev) if out.fast else None
            if prev is not None:
                self._settle(prev)
        if launch is not None:
            self._place(launch)
            if self.async_scheduling:
                self._launch = launch
            else:
                self._settle(launch)
            t2 = clock()
            decode_only = all(i.end - i.start == 1 for i in out.fast)
            c["decode_steps" if decode_only else "mixed_steps"] += 1
            c["decode_step_us" if decode_only else "mixed_step_us"] += int((t2 - t1) * 1e6)
            t1 = t2
        if out.lane and not ride:
            if self._launch is not None and not self.verifier.stream_ordered:
                # a verifier in another process sees the K/V only once it is written: the
                # batch in flight may write a slot the pass writes too (see Sequence)
                self._settle(self._launch)
            self._submit_lane(out.lane)
        wait = False
        if self.verifier.in_flight():
            # nothing else to run, or most sequences wait on the lane: let its pass have the
            # GPU rather than run the next decode step (a full weight read) for the few others;
            # but a prompt's next chunk goes out first (it queues behind the pass in flight)
            wait = yield_to_lane or (not self.scheduler.lane_prefill_ready()
                                     and (not out.fast or self.scheduler.lane_bound()))
            c["lane_bound_waits"] += yield_to_lane or (wait and bool(out.fast))
        results = self.verifier.poll(wait=wait)
        if results and self._launch is not None and self._launch.lane is not None:
            self._settle(self._launch)  # its pass ran first: its decisions go first
        # passes that carried riders, then the verifier's (submitted after them): decisions
        # apply only here, after this step's rows entered the scheduler's state, as the
        # verifier's always do (a rollback may cut tokens a planned row would read)
        done, self._lane_done = self._lane_done, []
        for result in (*done, *results):
            self._apply_lane(result)
        t2 = clock()
        c["lane_wait_us"] += int((t2 - t1) * 1e6)
        outputs = []
        touched, self._touched = self._touched, {}
        seqs = [self._seqs[rid] for rid in touched if rid in self._seqs]
        for seq in sorted(seqs, key=lambda s: s.arrival):
            rid = seq.request_id
            start = touched[rid]
            if seq.num_settled > start and not seq.finished:
                self._check_stop(seq, start)
            new = max(0, seq.num_settled - start)
            if new and seq.stats.first_token_time is None:
                seq.stats.first_token_time = time.monotonic()
            if seq.finished or (new and seq.params.output_kind == "cumulative"):
                outputs.append(self._output(seq, new))
                if seq.finished:
                    del self._seqs[rid]
            elif seq.num_settled < seq.num_committed:  # its placeholder: out next step
                self._touched.setdefault(rid, seq.num_settled)
        c["output_us"] += int((clock() - t2) * 1e6)
        return outputs

    def _touch(self, seq: Sequence) -> None:
        self._touched.setdefault(seq.request_id, seq.num_settled)

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
        batch = self.runner.launch_batch(segs, specs,
                                         batch_invariant=self.config.mode == "batch_invariant",
                                         align_decode=align, feed=feed,
                                         penalties=self._penalty_rows(items),
                                         prompt_rows=self._prompt_rows(items))
        return self._record_launch(items, batch)

    def _penalty_rows(self, items: list[FastItem]) -> list[PenaltyRow | None]:
        return _penalty_rows(items) if self._with["penalties"] else []

    def _prompt_rows(self, items: list[FastItem]) -> list[PromptRows | None]:
        return _prompt_rows(items) if self._with["prompt_logprobs"] else []

    def _riders_fit(self, out: SchedulerOutput) -> bool:
        """This step's fast rows can ride in its lane pass: there is one, every fast row is
        a decode row, and they fit in the pass's rows."""
        if not (out.lane and out.fast) or any(i.end - i.start != 1 for i in out.fast):
            return False
        return out.lane_rows_used + len(out.fast) <= self.config.scheduler.lane_rows

    def _launch_riders(self, out: SchedulerOutput) -> _Launch:
        """Queue the step's lane pass with its decode rows riding in the padding (the
        previous launch is settled: every input token is known). A sequence with an item in
        the pass sits this step out (the pass's decision moves it on), as does one whose
        input token ended it."""
        in_lane = {id(it.seq) for it in out.lane}
        items = [i for i in out.fast if id(i.seq) not in in_lane and not i.seq.finished
                 and i.seq.token_ids[i.start] != PLACEHOLDER and not self._after_stop(i)]
        riders = [RowSegment((i.seq.token_ids[i.start],), i.start, tuple(i.seq.block_table))
                  for i in items]
        lane_pass = self._lane_pass(out.lane)
        lane, batch = self.runner.launch_lane(
            lane_pass, riders, [i.seq.spec if i.sample else None for i in items],
            self._penalty_rows(items))
        self.counters["rider_passes"] += 1
        self.counters["rider_rows"] += len(items)
        launch = self._record_launch(items, batch)
        launch.lane = lane
        return launch

    def _record_launch(self, items: list[FastItem], batch: LaunchedBatch) -> _Launch:
        """Count a queued fast batch and draw its fault injection."""
        c = self.counters
        c["fast_passes"] += 1
        c["fast_rows"] += sum(i.end - i.start for i in items)
        launch = _Launch(items, batch, {id(items[n].seq): j for j, n in enumerate(batch.want)})
        c["fast_tokens"] += len(batch.want)
        # fault injection, drawn per sampled row in batch order; the next step is fed the
        # perturbed tokens, as it would read them on the host
        p = self.config.fastpath_perturbation
        if p > 0 and self._perturbs_fast_path:
            vocab = self.model.config.vocab_size
            for j in range(len(batch.want)):
                if self._perturb_rng.random() < p:
                    launch.offsets[j] = 1 + self._perturb_rng.randrange(vocab - 1)
            c["perturbed_tokens"] += len(launch.offsets)
        launch.fed = batch.tokens
        if launch.offsets and batch.tokens is not None:
            at = upload(list(launch.offsets), batch.tokens.device)
            add = upload(list(launch.offsets.values()), batch.tokens.device)
            fed = batch.tokens.clone()
            fed[at] = (fed[at] + add) % self.model.config.vocab_size
            launch.fed = fed
        return launch

    def _place(self, launch: _Launch) -> None:
        """The launch's rows enter the scheduler's state, sampled tokens as placeholders
        (what a synchronous step would apply with their values). A row whose input token
        is a stop token (known only now) is dropped: it should not have run."""
        for item in launch.items:
            seq = item.seq
            if self._after_stop(item):
                launch.dropped.add(id(seq))
                self.counters["dropped_rows"] += 1
                continue
            self._touch(seq)
            self.scheduler.on_fast_result(item, PLACEHOLDER if item.sample else None)

    def _after_stop(self, item: FastItem) -> bool:
        """A decode row fed a sampled stop token that ends its sequence (for a lane
        sequence: its window), so the row should not have run."""
        seq = item.seq
        if item.end - item.start != 1 or item.start < seq.num_prompt:
            return False
        if seq.token_ids[item.start] not in self.scheduler.stop_ids(seq):
            return False
        return seq.uses_lane or item.start - seq.num_prompt >= seq.params.min_tokens

    def _settle(self, launch: _Launch) -> None:
        """Read the launch's tokens and put them where its placeholders still stand (a
        lane decision, preemption or stop may have removed them since)."""
        if launch is self._launch:
            self._launch = None
        results = launch.batch.result()
        for n, lps in launch.batch.prompt_result().items():
            item = launch.items[n]
            if not item.seq.finished:
                item.seq.add_prompt_logprobs(item.start, lps)
        vocab = self.model.config.vocab_size
        for item, res in zip(launch.items, results, strict=True):
            if res is None:
                continue
            seq = item.seq
            if id(seq) in launch.dropped or seq.finished:
                continue
            pos = item.end
            if pos >= seq.num_tokens or seq.token_ids[pos] != PLACEHOLDER:
                continue
            j = launch.rows[id(seq)]
            token = (res[0] + launch.offsets.get(j, 0)) % vocab
            seq.token_ids[pos] = token
            if not seq.uses_lane:
                self._touched.setdefault(seq.request_id, pos)
                if res[1]:
                    seq.logprobs.append(res[1])
        lane, launch.lane = launch.lane, None
        if lane is not None:  # decided now, applied where the step applies lane results
            self._lane_done.append(lane.finish())

    def _submit_lane(self, items: list[LaneItem]) -> None:
        self.verifier.submit(self._lane_pass(items))

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
        items = self._inflight.pop(result.pass_id)
        self.counters["lane_seconds_us"] += int(result.elapsed_s * 1e6)
        for d in result.decisions:
            it = items[d.request_id]
            seq = it.seq
            self._touch(seq)
            if seq.finish_reason == "abort":
                if self.scheduler.lane_item_done(seq):  # its blocks are the lane's no more
                    self._finish(seq, "abort")
                continue
            launch = self._launch
            if (launch is not None and it.kind == "window" and it.end < seq.num_tokens
                    and seq.token_ids[it.end] == PLACEHOLDER):
                self._settle(launch)  # whether the run past the window goes on depends on it
            if d.prompt_logprobs:
                seq.add_prompt_logprobs(d.start, d.prompt_logprobs)
            rejected = self.scheduler.on_lane_result(it, list(d.tokens))
            seq.logprobs.extend(lp for lp in d.logprobs if lp is not None)
            if rejected:
                self.counters["rollbacks"] += 1
                self.counters["tokens_rolled_back"] += rejected

    def _check_stop(self, seq: Sequence, first_new: int) -> None:
        p = seq.params
        stop_ids = self.scheduler.stop_ids(seq)
        limit = self.config.scheduler.max_model_len
        for idx in range(first_new, seq.num_settled):
            out_index = idx - seq.num_prompt
            reason = None
            if seq.token_ids[idx] in stop_ids and out_index >= p.min_tokens:
                reason = "stop"
            elif out_index + 1 >= p.max_tokens or idx + 1 >= limit:
                reason = "length"
            if reason:
                del seq.token_ids[idx + 1:]
                seq.num_committed = idx + 1
                del seq.logprobs[out_index + 1:]
                self._finish(seq, reason)
                return
        if p.stop and self._stop_string_cut(seq) is not None:
            self._finish(seq, "stop")

    def _stop_string_cut(self, seq: Sequence) -> int | None:
        text = self._raw_text(seq)
        hits = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
        return min(hits) if hits else None

    def _raw_text(self, seq: Sequence) -> str:
        """The committed output as text. While the request runs, text is decoded
        incrementally (a few tokens a step, not the whole output) and a trailing incomplete
        UTF-8 sequence is held back until its last byte arrives; once it has finished, the
        text is one decode of the whole output."""
        ids = seq.committed_output
        skip = seq.params.skip_special_tokens
        if seq.finished:
            return self.tokenizer.decode(ids, skip_special_tokens=skip)
        text, prefix, read = seq.detok or ("", 0, 0)
        if read > len(ids):  # output shortened (a stop token cut it): start over
            text, prefix, read = "", 0, 0
        if read == len(ids):
            return text
        # decode from the previous read offset so leading spaces/merges come out as in context
        before = self.tokenizer.decode(ids[prefix:read], skip_special_tokens=skip)
        after = self.tokenizer.decode(ids[prefix:], skip_special_tokens=skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            text += after[len(before):]
            seq.detok = (text, read, len(ids))
        return text

    def _finish(self, seq: Sequence, reason: str) -> None:
        settled = seq.num_settled
        if settled < seq.num_committed:  # a placeholder after the end: never read
            del seq.token_ids[settled:]
            seq.num_committed = settled
        seq.finish_reason = reason
        seq.stats.finish_time = time.monotonic()
        self.scheduler.remove(seq)
        self._with["penalties"] -= seq.spec.penalized
        self._with["prompt_logprobs"] -= seq.params.prompt_logprobs is not None
        self.counters["finished_requests"] += 1
        self.counters["committed_tokens"] += seq.num_output_committed

    def _output(self, seq: Sequence, num_new: int) -> RequestOutput:
        text = self._raw_text(seq)
        if seq.params.stop:
            cut = self._stop_string_cut(seq)
            if cut is not None:
                text = text[:cut]
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,  # never mutated
            token_ids=list(seq.committed_output), text=text, finished=seq.finished,
            finish_reason=seq.finish_reason if seq.finished else None,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            is_deterministic=seq.deterministic, num_new_tokens=num_new, stats=seq.stats,
            prompt_logprobs=(list(seq.prompt_logprobs)
                             if seq.params.prompt_logprobs is not None else None))

    # ---- introspection --------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        c = self.counters
        out: dict[str, float] = {k: c[k] for k in (
            "steps", "fast_passes", "fast_rows", "fast_tokens", "verify_passes", "windows",
            "rollbacks", "tokens_rolled_back", "lane_rows", "lane_padding_rows",
            "lane_computed_rows", "lane_bound_waits", "lane_prefill_rows", "committed_tokens",
            "preemptions", "perturbed_tokens", "finished_requests",
            # asynchronous scheduling: rows fed the previous step's token on the device, and
            # rows planned after what turned out to be a stop token (run, then dropped)
            "fed_rows", "dropped_rows",
            # steps whose decode rows rode in the lane pass planned with them, and those rows
            "rider_passes", "rider_rows")}
        out["recomputed_tokens"] = c["tokens_rolled_back"] + c["preempted_tokens"]
        out["prefix_cache_hit_tokens"] = self.scheduler.prefix_hit_tokens
        out["prefill_held_steps"] = self.scheduler.prefill_held_steps
        out["parked_admissions"] = self.scheduler.parked_admissions
        out["lane_ahead_admissions"] = self.scheduler.lane_ahead_admissions
        out["partial_windows"] = self.scheduler.partial_windows
        out["seq_capped_steps"] = self.scheduler.seq_capped_steps
        out["lane_padding_fraction"] = c["lane_padding_rows"] / c["lane_rows"] if c["lane_rows"] else 0.0
        out["lane_seconds"] = c["lane_seconds_us"] / 1e6
        # where the engine's wall time goes (seconds): scheduling, fast-path steps (decode
        # only, or with prefill rows), submitting lane passes and waiting for or applying
        # their results, building outputs
        for k in ("schedule", "decode_step", "mixed_step", "lane_wait", "output"):
            out[f"{k}_seconds"] = c[f"{k}_us"] / 1e6
        # running lane sequences per step by state (Scheduler._count_lane_states)
        states = self.scheduler.lane_state_steps
        for k in LANE_STATES:
            out[f"lane_seqs_{k}"] = states[k] / max(1, states["steps"])
        # products of eager steps whose decode rows need the lane's bits: one call over all
        # rows (the probe found that size runs the lane chunk's algorithm) or split in two
        out["head_products_one_call"] = self.runner.head_products["one"]
        out["head_products_split"] = self.runner.head_products["split"]
        sets = [g for g in (self.runner.decode_graphs, self.runner.plain_graphs) if g is not None]
        for graphs in sets:  # GPU time of the decode steps' graph replays
            graphs.settle_timing()
        out["decode_graph_gpu_s"] = sum(g.gpu_seconds for g in sets)
        out["decode_graph_replays"] = sum(g.timed_replays for g in sets)
        # of them, replays of the plain fast path's graphs (no deterministic decode row)
        plain = self.runner.plain_graphs
        out["plain_graph_replays"] = plain.timed_replays if plain is not None else 0
        steps = self.runner.step_graphs  # steps with prompt chunks replayed as graphs
        out["step_graph_replays"] = steps.replays if steps is not None else 0
        out["decode_steps"] = c["decode_steps"]
        out["mixed_steps"] = c["mixed_steps"]
        out["running_requests"] = len(self.scheduler.running)
        out["waiting_requests"] = len(self.scheduler.waiting)
        out["kv_blocks_free"] = self.blocks.num_free
        return out

    def determinism_profile(self) -> dict[str, object]:
        """What two deterministic responses must share to be comparable bit for bit."""
        dev = self.config.device
        if dev.startswith("cuda"):
            kind = torch.cuda.get_device_name(torch.device(dev))
        else:
            kind = f"cpu-{platform.machine()}-{torch.get_num_threads()}threads"
        prof: dict[str, object] = {
            "model": self.model_info.name,
            "weights_sha256": self.model_info.weights_hash,
            "dtype": self.config.dtype,
            "mode": self.config.mode,
            "kernels": f"{self.runner.kernel_set}/torch-{torch.__version__}",
            "device": kind,
            "tp_size": 1,
            **self.numerics.profile(self.config.mode),
        }
        if dev.startswith("cuda"):
            prof["cuda_graphs"] = self.config.cuda_graphs  # the lane's GEMMs replayed or eager
        blob = json.dumps(prof, sort_keys=True).encode()
        prof["fingerprint"] = hashlib.sha256(blob).hexdigest()[:16]
        return prof

    def close(self) -> None:
        """Stop the verifier (its worker thread holds the runner and the KV pool)."""
        self.verifier.close()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


def _penalty_rows(items: list[FastItem]) -> list[PenaltyRow | None]:
    """Per fast item, for a sampled row with penalties: the generated tokens before its last
    input token (all read back by now), and whether that input is a generated one (it may
    still be a placeholder, fed on the device). Empty when no row has penalties."""
    if not any(i.sample and i.seq.spec.penalized for i in items):
        return []
    out: list[PenaltyRow | None] = []
    for i in items:
        if not (i.sample and i.seq.spec.penalized):
            out.append(None)
            continue
        prompt, last = i.seq.num_prompt, i.end - 1
        history = tuple(i.seq.token_ids[prompt:last])
        assert PLACEHOLDER not in history, "a penalized row's history not yet read back"
        out.append((history, last >= prompt))
    return out


def _prompt_rows(items: list[FastItem]) -> list[PromptRows | None]:
    """Per fast item whose prompt logprobs are asked for and whose rows predict prompt
    tokens: (top alternatives, those tokens). Empty when no item has any."""
    out: list[PromptRows | None] = []
    for i in items:
        targets = i.seq.prompt_targets(i.start, i.end)
        k = i.seq.params.prompt_logprobs
        out.append((k, targets) if targets and k is not None else None)
    return out if any(out) else []
