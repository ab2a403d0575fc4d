"""Continuous-batching scheduler with a deterministic lane (pure bookkeeping, no torch).

Every step yields at most one *fast batch* (ordinary dynamic batching: decode rows first,
then chunked prefill under a token budget) and at most one *lane pass* (exactly
``verify_window * verify_group`` rows, padded: verify windows of lane sequences plus their
prompt chunks; ``lane_planner``). There is no decode or prefill phase: a sequence just has
positions whose K/V is computed and positions still to compute; a verify window is "these
positions of this sequence, recomputed in the lane".

The scheduler is the only writer of ``Sequence`` state once a request is queued: it applies
the fast path's tokens (``place``, ``on_token_read``), the lane's decisions
(``on_lane_decision``), aborts, and the stop conditions (``take_updates``: stop tokens,
``max_tokens``, ``max_model_len``, stop strings through the caller's text check).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace

from detserve.block_manager import BlockManager
from detserve.config import LANE_WAIT_STEPS, SchedulerConfig
from detserve.lane_planner import LaneItem, LanePlanner
from detserve.numerics import lane_run_rows
from detserve.outputs import TokenLogprob
from detserve.sequence import PLACEHOLDER, Sequence, Status

__all__ = ["LANE_STATES", "FastItem", "LaneItem", "Scheduler", "SchedulerOutput"]


@dataclass(frozen=True)
class FastItem:
    """Compute positions [start, end) of ``seq`` on the fast path; sample at end if asked."""

    seq: Sequence
    start: int
    end: int
    sample: bool


@dataclass
class SchedulerOutput:
    step: int
    fast: list[FastItem] = field(default_factory=list)
    lane: list[LaneItem] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def lane_rows_used(self) -> int:
        return sum(i.rows for i in self.lane)

    @property
    def empty(self) -> bool:
        return not self.fast and not self.lane


LANE_STATES = ("fast", "prefill", "window", "capped")


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager,
                 eos_token_ids: Iterable[int] = (), prefix_caching: bool = True,
                 lane_sizes: Iterable[int] = (),
                 stop_string_end: Callable[[Sequence], int | None] | None = None
                 ) -> None:
        """``lane_sizes``: the row counts a lane pass runs at, ascending (the runner's
        ``LaneNumerics.lane_sizes``; default: the whole pass); a pass's spare rows are the
        ones past its used rows up to the smallest size that holds them.
        ``stop_string_end(seq)``: the position of the first token whose committed text
        holds one of its stop strings, or None (the output processor's check; None: stop
        strings are not checked)."""
        if cfg.lane_max_wait_steps is None:  # (made without an engine: the CPU default)
            cfg = replace(cfg, lane_max_wait_steps=LANE_WAIT_STEPS["cpu"])
        self.cfg = cfg
        self.blocks = blocks
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.step_count = 0
        self.prefix_caching = prefix_caching
        self.prefix_hit_tokens = 0
        sizes = tuple(lane_sizes) or (cfg.lane_rows,)
        self.lane = LanePlanner(self, lambda used: lane_run_rows(sizes, used))
        self._stop_string_end = stop_string_end
        # where the running lane sequences sat, summed over the steps that planned fast
        # rows ("steps"; see _count_lane_states)
        self.lane_state_steps: Counter[str] = Counter()
        self.prefill_held_steps = 0  # steps that held new prompts back (_hold_prompts)
        self._prompt_held_since: dict[int, int] = {}  # id(seq) -> first step it could run
        # admissions past max_num_seqs (slots of parked lane sequences; _parked_slots), and
        # fast steps that left rows out because they already carried max_num_seqs sequences
        self.parked_admissions = 0
        self.seq_capped_steps = 0
        self.finished_requests = 0
        self.committed_tokens = 0  # output tokens of the finished requests
        # unfinished sequences with penalties / asking for prompt logprobs: while there are
        # none, the engine spends no host time on them (a loop over a step's rows)
        self.with_penalties = 0
        self.with_prompt_logprobs = 0
        # sequences whose committed tokens or state changed since the last take_updates,
        # with their settled count before the change (only these get an output)
        self._touched: dict[str, tuple[Sequence, int]] = {}

    # ---- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.with_penalties += seq.spec.penalized
        self.with_prompt_logprobs += seq.params.prompt_logprobs is not None
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.blocks.free(seq.block_table)
            seq.block_table = []
        seq.status = Status.FINISHED

    def has_work(self) -> bool:
        """Sequences to run, or changes not yet taken by ``take_updates``."""
        return bool(self.waiting or self.running or self._touched)

    def stop_ids(self, seq: Sequence) -> frozenset[int]:
        if seq.stop_set is None:  # asked for every sequence every step: built once
            ids = frozenset(seq.params.stop_token_ids)
            seq.stop_set = ids if seq.params.ignore_eos else ids | self.eos_token_ids
        return seq.stop_set

    def lane_prefill_ready(self) -> bool:
        """Some sequence could send a prompt chunk to the lane now (a step that submitted a
        pass need not wait for it before the next step)."""
        return self.lane.prefill_ready()

    # ---- the step ---------------------------------------------------------------------
    def schedule(self, fast: bool = True) -> SchedulerOutput:
        """Plan one step: lane items, then (unless ``fast`` is False: the engine lets the
        lane have the GPU this step) the fast path's rows."""
        self.step_count += 1
        out = SchedulerOutput(step=self.step_count)
        self._admit()
        if self.cfg.uses_lane:
            out.lane = self.lane.plan(lambda seq, n: self._grow(seq, n, out))
        if fast:
            out.fast = self._plan_fast(out)
        assert out.lane_rows_used <= self.cfg.lane_rows
        assert sum(i.end - i.start for i in out.fast) <= self.cfg.max_num_batched_tokens
        return out

    def _admit(self) -> None:
        if not self.waiting:
            return
        limit = self.cfg.max_num_seqs + self._parked_slots()
        while self.waiting and len(self.running) < limit:
            if not self.take(self.waiting[0], reserve=0):
                break
            self.parked_admissions += len(self.running) > self.cfg.max_num_seqs

    def take(self, seq: Sequence, reserve: int) -> bool:
        """Move queued ``seq`` to the running sequences if the KV pool holds its whole
        committed prefix (+1 for the next token, so prefill chunks never need to allocate
        later) with ``reserve`` blocks to spare; False (nothing changed) if not."""
        cached = self._match_prefix(seq)
        need = self.blocks.blocks_needed(seq.num_tokens + 1) - len(seq.block_table)
        if need + reserve > self.blocks.num_free:
            if cached:
                self.blocks.free(seq.block_table)
                seq.reset_for_recompute()
            return False
        grown = self.blocks.grow(seq.block_table, seq.num_tokens + 1)
        assert grown, "the free blocks were counted above"
        if cached:
            seq.num_lane_kv = seq.num_computed = cached * self.blocks.block_size
            self.prefix_hit_tokens += seq.num_lane_kv
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

    def _parked_slots(self) -> int:
        """Sequences admission may run beyond ``max_num_seqs``: those parked on the lane
        (no fast row now), at most ``parked_seq_headroom`` of ``max_num_seqs``."""
        cap = int(self.cfg.parked_seq_headroom * self.cfg.max_num_seqs)
        if not (cap and self.cfg.uses_lane and self.cfg.max_candidates):
            return 0  # (lane_only: no fast path whose batch slots could idle)
        return min(cap, self._num_parked())

    def _num_parked(self) -> int:
        """Running lane sequences that can only move once the lane answers."""
        return sum(1 for s in self.running if s.uses_lane and self._fast_rows(s) == 0)

    def _match_prefix(self, seq: Sequence) -> int:
        """Share lane-computed blocks of an earlier request with the same prefix (lane
        sequences only; the last committed token is always recomputed). Returns blocks."""
        if not (self.prefix_caching and seq.uses_lane) or seq.block_table:
            return 0
        if seq.params.prompt_logprobs is not None:  # every prompt row must be computed
            return 0
        full = (seq.num_committed - 1) // self.blocks.block_size
        digests = self.blocks.chain_digests(seq.token_ids, full)
        seq.block_table = self.blocks.match(digests)
        seq.block_digests = digests[:len(seq.block_table)]
        return len(seq.block_table)

    def _register_lane_blocks(self, seq: Sequence) -> None:
        if not self.prefix_caching:
            return
        full = seq.num_lane_kv // self.blocks.block_size
        done = len(seq.block_digests)
        if full <= done:
            return
        seq.block_digests = self.blocks.chain_digests(seq.token_ids, full, seq.block_digests)
        for i in range(done, full):
            self.blocks.register(seq.block_table[i], seq.block_digests[i])

    def lane_bound(self) -> bool:
        """More than ``lane_bound_fraction`` of the running sequences wait on the lane."""
        if not self.cfg.uses_lane or not self.running or self.cfg.lane_bound_fraction >= 1.0:
            return False
        return self._num_parked() > self.cfg.lane_bound_fraction * len(self.running)

    def _fast_rows(self, seq: Sequence) -> int:
        """Rows this sequence wants on the fast path now (0: not eligible)."""
        if seq.in_lane:
            past = seq.num_tokens - seq.lane_end
            ok = seq.lane_end and seq.num_computed == seq.num_tokens - 1
            if past == 0 and seq.lane_step != self.step_count:
                # this row would write K/V at lane_end - 1, which the pass in flight writes
                # too: only ahead of the pass (queued before it) is the lane's write the last
                return 0
            return 1 if ok and past < self.lane.overlap_cap(seq) else 0
        if seq.uses_lane:
            if seq.needs_lane_prefill():
                return 0
            if self.lane.window_ready(seq) and not self.lane.decodes_past_window(seq):
                return 0
            assert seq.num_computed == seq.num_tokens - 1, "lane seq out of sync"
            return 1
        if (seq.num_output_committed >= seq.params.max_tokens
                or seq.num_committed >= self.cfg.max_model_len):
            return 0  # at its length limit (its last token, maybe still a placeholder)
        return seq.num_tokens - seq.num_computed

    def _plan_fast(self, out: SchedulerOutput) -> list[FastItem]:
        budget = self.cfg.max_num_batched_tokens
        wants = [(s, self._fast_rows(s)) for s in self.running]
        if self.cfg.uses_lane:
            self._count_lane_states(wants)
        if not self.cfg.lane_decode_in_mixed_steps and any(r > 1 for _, r in wants):
            wants = [(s, 0 if self._sits_out(s, r) else r) for s, r in wants]
        # decode rows (one token) before prefill chunks, each group in arrival order
        order = [w for w in wants if w[1] == 1] + [w for w in wants if w[1] > 1]
        if self._hold_prompts(order):
            order = [w for w in order if w[1] == 1]
        items: list[FastItem] = []
        for seq, rows in order:
            if budget == 0:
                break
            if len(items) == self.cfg.max_num_seqs:
                self.seq_capped_steps += 1
                break
            if rows == 0 or seq.status is not Status.RUNNING:
                continue
            n = min(rows, budget)
            end = seq.num_computed + n
            if seq.in_lane:  # decoding past its window: never worth a preemption
                if not self.blocks.grow(seq.block_table, end):
                    continue
            elif not self._grow(seq, end, out, scheduled=items):
                continue
            items.append(FastItem(seq, seq.num_computed, end, sample=end == seq.num_tokens))
            budget -= n
        return items

    def _hold_prompts(self, order: list[tuple[Sequence, int]]) -> bool:
        """Whether this step leaves out the prompts not yet started (``prefill_batch_tokens``):
        only when the step would otherwise carry decode rows and no other prefill chunk,
        fewer than ``prefill_batch_tokens`` prompt tokens wait, and the first of them has
        waited less than ``prefill_max_wait_steps`` steps."""
        if not self.cfg.prefill_batch_tokens:  # (off: nothing to track, every step)
            return False
        fresh = [(s, r) for s, r in order if r > 1 and s.num_computed == 0]
        since = {id(s): self._prompt_held_since.get(id(s), self.step_count) for s, _ in fresh}
        self._prompt_held_since = since  # (a prompt's wait counts from its first chance)
        hold = (bool(fresh) and sum(r for _, r in fresh) < self.cfg.prefill_batch_tokens
                and any(r == 1 for _, r in order)
                and not any(r > 1 and s.num_computed > 0 for s, r in order)
                and self.step_count - min(since.values()) < self.cfg.prefill_max_wait_steps)
        self.prefill_held_steps += hold
        return hold

    def _count_lane_states(self, wants: list[tuple[Sequence, int]]) -> None:
        """Tally this step's running lane sequences: ``fast`` (a row on the fast path),
        ``prefill`` (prompt not yet all in the lane's K/V), ``window`` (a full window not
        yet sent to the lane), ``capped`` (in the lane, decoded as far past it as allowed)."""
        c = self.lane_state_steps
        c["steps"] += 1
        for seq, rows in wants:
            if not seq.uses_lane:
                continue
            if rows:
                c["fast"] += 1
            elif seq.needs_lane_prefill():
                c["prefill"] += 1
            elif seq.in_lane:
                c["capped"] += 1
            else:
                c["window"] += 1

    @staticmethod
    def _sits_out(seq: Sequence, rows: int) -> bool:
        """In a step with prefill rows: a lane sequence's decode row stays out of every
        other such step (it is never starved, whatever the prefill traffic)."""
        if not (seq.uses_lane and rows == 1):
            return False
        seq.sat_out = not seq.sat_out
        return seq.sat_out

    def _grow(self, seq: Sequence, num_tokens: int, out: SchedulerOutput,
              scheduled: list[FastItem] | None = None) -> bool:
        """Make ``seq``'s block table cover ``num_tokens`` positions, preempting the newest
        other sequences (never one already scheduled in this step) when blocks run out.
        Returns False if ``seq`` itself had to be preempted."""
        busy: set[int] | None = None  # built only when blocks run out (rare)
        while not self.blocks.grow(seq.block_table, num_tokens):
            if busy is None:
                busy = {id(i.seq) for i in (scheduled or [])} | {id(i.seq) for i in out.lane}
            victims = [s for s in self.running
                       if s is not seq and not s.in_lane and id(s) not in busy]
            victim = max(victims, key=lambda s: s.arrival) if victims else seq
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: free the blocks, requeue at the front."""
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.reset_for_recompute()
        seq.status = Status.WAITING
        seq.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def penalty_rows(self, items: list[FastItem]) -> list[tuple[tuple[int, ...], bool] | None]:
        """Per fast item, for a sampled row with penalties: the generated tokens before its
        last input token (all read back by now), and whether that input is a generated one
        (it may still be a placeholder, fed on the device). Empty when no row has any."""
        if not (self.with_penalties and any(i.sample and i.seq.spec.penalized for i in items)):
            return []
        out: list[tuple[tuple[int, ...], bool] | None] = []
        for i in items:
            if not (i.sample and i.seq.spec.penalized):
                out.append(None)
                continue
            prompt, last = i.seq.num_prompt, i.end - 1
            history = tuple(i.seq.token_ids[prompt:last])
            assert PLACEHOLDER not in history, "a penalized row's history not yet read back"
            out.append((history, last >= prompt))
        return out

    def prompt_rows(self, items: list[FastItem]) -> list[tuple[int, tuple[int, ...]] | None]:
        """Per fast item whose prompt logprobs are asked for and whose rows predict prompt
        tokens: (top alternatives, those tokens). Empty when no item has any."""
        if not self.with_prompt_logprobs:
            return []
        out: list[tuple[int, tuple[int, ...]] | None] = []
        for i in items:
            targets = i.seq.prompt_targets(i.start, i.end)
            k = i.seq.params.prompt_logprobs
            out.append((k, targets) if targets and k is not None else None)
        return out if any(out) else []

    # ---- results --------------------------------------------------------------------
    def on_fast_result(self, item: FastItem, token: int | None) -> None:
        seq = item.seq
        seq.num_computed = item.end
        if token is None:
            return
        seq.stats.fast_tokens += 1
        if seq.uses_lane:
            seq.token_ids.append(token)  # a candidate, not released until verified
        else:
            seq.token_ids.append(token)
            seq.num_committed += 1

    @staticmethod
    def lane_item_done(seq: Sequence) -> bool:
        """One of ``seq``'s lane items came back; True when it was the last in flight (the
        sequence is out of the lane: it may decode, be preempted or be freed)."""
        seq.lane_items -= 1
        assert seq.lane_items >= 0, "more lane results than items sent"
        if seq.lane_items:
            return False
        seq.lane_sent = 0
        return True

    def on_lane_result(self, item: LaneItem, tokens: list[int]) -> int:
        """Apply a lane decision. ``tokens`` are the newly committed tokens (for a window:
        the accepted candidates plus the lane's next token). Returns the fast-path tokens
        thrown away (rejected candidates and what was decoded past them)."""
        seq = item.seq
        self.lane_item_done(seq)
        seq.stats.verify_passes += 1
        seq.stats.lane_rows += item.rows
        if item.kind == "prefill":
            assert item.start == seq.num_lane_kv, "prompt chunks came back out of order"
            seq.num_lane_kv = seq.num_computed = item.end
            if tokens:
                assert len(tokens) == 1 and item.end == seq.num_committed
                seq.token_ids.append(tokens[0])
                seq.num_committed += 1
            self._register_lane_blocks(seq)
            return 0
        c = seq.num_committed
        assert item.start == c - 1 and tokens, "window out of sync with its sequence"
        accepted = len(tokens) - 1
        assert list(item.candidates[:accepted]) == tokens[:accepted]
        rejected = len(item.candidates) - accepted
        seq.lane_end = 0
        past = seq.token_ids[item.end:]  # decoded on the fast path while the window was away
        if not rejected and past and past[0] == tokens[-1]:
            # the whole window commits and the lane's next token is where the fast path
            # went on from: keep those tokens (the next window's candidates)
            seq.num_committed = item.end + 1
            seq.num_lane_kv = item.end
        else:
            rejected += len(past)
            del seq.token_ids[c:]
            seq.token_ids.extend(tokens)
            seq.num_committed = c + accepted + 1
            seq.num_lane_kv = seq.num_computed = c + accepted
        seq.stats.windows += 1
        if rejected:
            seq.stats.rollbacks += 1
            seq.stats.tokens_rolled_back += rejected
        self.blocks.shrink(seq.block_table, seq.num_tokens + 1)
        self._register_lane_blocks(seq)
        return rejected

    def after_stop(self, item: FastItem) -> bool:
        """A decode row fed a sampled stop token that ends its sequence (for a lane
        sequence: its window), so the row should not have run."""
        seq = item.seq
        if item.end - item.start != 1 or item.start < seq.num_prompt:
            return False
        if seq.token_ids[item.start] not in self.stop_ids(seq):
            return False
        return seq.uses_lane or item.start - seq.num_prompt >= seq.params.min_tokens

    def place(self, item: FastItem) -> bool:
        """A queued fast row enters the sequence's state, its sampled token as a placeholder
        (what a synchronous step would apply with its value). False: the row's input token
        is a stop token (known only now), so it should not have run and is dropped."""
        if self.after_stop(item):
            return False
        self._touch(item.seq)
        self.on_fast_result(item, PLACEHOLDER if item.sample else None)
        return True

    def on_token_read(self, item: FastItem, token: int, logprob: TokenLogprob | None) -> None:
        """The value of the token ``item`` sampled, read back from the device: it replaces
        its placeholder where one still stands (a lane decision, preemption or stop may have
        removed it since)."""
        seq = item.seq
        pos = item.end
        if seq.finished or pos >= seq.num_tokens or seq.token_ids[pos] != PLACEHOLDER:
            return
        seq.token_ids[pos] = token
        if not seq.uses_lane:
            self._touched.setdefault(seq.request_id, (seq, pos))
            if logprob is not None:
                seq.logprobs.append(logprob)

    @staticmethod
    def on_prompt_logprobs(seq: Sequence, start: int,
                           logprobs: Seq[TokenLogprob]) -> None:
        """Prompt logprobs of the positions after ``start`` (fast path or lane)."""
        if not seq.finished:
            seq.add_prompt_logprobs(start, logprobs)

    def on_lane_decision(self, item: LaneItem, tokens: list[int],
                         logprobs: Seq[TokenLogprob | None],
                         prompt_logprobs: Seq[TokenLogprob] = ()) -> int:
        """Apply the lane's decision on ``item`` (``on_lane_result``) with its logprobs; an
        aborted sequence is finished once its last lane item is back. Returns the tokens
        rolled back."""
        seq = item.seq
        self._touch(seq)
        if seq.finish_reason == "abort":
            if self.lane_item_done(seq):  # its blocks are the lane's no more
                self.finish(seq, "abort")
            return 0
        if prompt_logprobs:
            seq.add_prompt_logprobs(item.start, prompt_logprobs)
        rejected = self.on_lane_result(item, tokens)
        seq.logprobs.extend(lp for lp in logprobs if lp is not None)
        return rejected

    def abort(self, seq: Sequence) -> bool:
        """Abort ``seq``; False if it has finished already. A sequence with lane work in
        flight is finished when that comes back (``on_lane_decision``)."""
        if seq.finished:
            return False
        seq.finish_reason = "abort"
        if not seq.in_lane:
            self._touch(seq)  # its final output goes out with the next step
            self.finish(seq, "abort")
        return True

    def fail_lane(self) -> list[Sequence]:
        """Verification cannot continue: finish every lane sequence (running or waiting)
        with ``"error"`` (one already aborted keeps ``"abort"``), its unverified candidates
        dropped and its blocks released; the engine has dropped their lane work in flight.
        Other sequences are untouched. Returns the finished sequences."""
        failed = [s for s in (*self.running, *self.waiting) if s.uses_lane]
        for seq in failed:
            self._touch(seq)
            seq.lane_items = seq.lane_sent = seq.lane_end = 0
            del seq.token_ids[seq.num_committed:]  # candidates: never released unverified
            seq.num_computed = min(seq.num_computed, seq.num_tokens)
            self.finish(seq, "abort" if seq.finish_reason == "abort" else "error")
        return failed

    def finish(self, seq: Sequence, reason: str) -> None:
        settled = seq.num_settled
        if settled < seq.num_committed:  # a placeholder after the end: never read
            del seq.token_ids[settled:]
            seq.num_committed = settled
        seq.finish_reason = reason
        seq.stats.finish_time = time.monotonic()
        self.remove(seq)
        self.with_penalties -= seq.spec.penalized
        self.with_prompt_logprobs -= seq.params.prompt_logprobs is not None
        self.finished_requests += 1
        self.committed_tokens += seq.num_output_committed

    def _touch(self, seq: Sequence) -> None:
        self._touched.setdefault(seq.request_id, (seq, seq.num_settled))

    def take_updates(self) -> list[tuple[Sequence, int]]:
        """Close the step: of the sequences whose state changed since the last call (in
        arrival order), those that get an output now (finished, or new tokens for a
        ``cumulative`` one), each with its number of newly settled tokens. The stop
        conditions are applied first, to the tokens settled since (all of the step's at
        once: a stop string is looked for once a step). A sequence whose last token is
        still on the device and that gets no output stays listed for the next call."""
        touched, self._touched = self._touched, {}
        out = []
        for seq, start in sorted(touched.values(), key=lambda e: e[0].arrival):
            if seq.num_settled > start and not seq.finished:
                self._check_stop(seq, start)
            new = max(0, seq.num_settled - start)
            if new and seq.stats.first_token_time is None:
                seq.stats.first_token_time = time.monotonic()
            if seq.finished or (new and seq.params.output_kind == "cumulative"):
                out.append((seq, new))
            elif seq.num_settled < seq.num_committed:
                self._touched.setdefault(seq.request_id, (seq, seq.num_settled))
        return out

    def _check_stop(self, seq: Sequence, first_new: int) -> None:
        """Finish ``seq`` at the first of its tokens settled since ``first_new`` that ends
        it (a stop token past ``min_tokens``, its length, a stop string's last token),
        dropping what follows: where it ends depends on its tokens alone, not on how many
        of them this step settled."""
        p = seq.params
        stop_ids = self.stop_ids(seq)
        limit = self.cfg.max_model_len
        text_end = (self._stop_string_end(seq)
                    if p.stop and self._stop_string_end is not None else None)
        if text_end is not None:  # (a stop string the incremental text saw late)
            first_new = min(first_new, text_end)
        for idx in range(first_new, seq.num_settled):
            out_index = idx - seq.num_prompt
            reason = None
            if seq.token_ids[idx] in stop_ids and out_index >= p.min_tokens:
                reason = "stop"
            elif idx == text_end:
                reason = "stop"
            elif out_index + 1 >= p.max_tokens or idx + 1 >= limit:
                reason = "length"
            if reason:
                del seq.token_ids[idx + 1:]
                seq.num_committed = idx + 1
                del seq.logprobs[out_index + 1:]
                self.finish(seq, reason)
                return

    def check_integrity(self) -> None:
        tables = [s.block_table for s in self.running] + [s.block_table for s in self.waiting]
        self.blocks.check_integrity(tables)
        for s in self.running:
            assert s.num_computed <= s.num_tokens
            assert s.num_committed <= s.num_tokens
            assert len(s.block_table) >= self.blocks.blocks_needed(s.num_computed)
            if s.uses_lane and not s.in_lane:
                assert s.num_lane_kv <= s.num_committed
