"""Continuous-batching scheduler with a deterministic lane (pure bookkeeping, no torch).

Every step yields at most one *fast batch* (ordinary dynamic batching: decode rows first,
then chunked prefill under a token budget) and at most one *lane pass* (exactly
``verify_window * verify_group`` rows, padded: verify windows of lane sequences plus their
prompt chunks). There is no decode or prefill phase: a sequence just has positions whose
K/V is computed and positions still to compute; a verify window is "these positions of
this sequence, recomputed in the lane".
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from detserve.block_manager import BlockManager
from detserve.config import SchedulerConfig
from detserve.numerics import lane_run_rows
from detserve.sequence import Sequence, Status

# chunks of one prompt in the lane at once when they pipeline: two hide the round trip
# between chunks; more would queue a long prompt's whole prefill ahead of the windows and
# prompts of every other sequence (passes run in submission order)
LANE_PREFILL_DEPTH = 2


@dataclass(frozen=True)
class FastItem:
    """Compute positions [start, end) of ``seq`` on the fast path; sample at end if asked."""

    seq: Sequence
    start: int
    end: int
    sample: bool


@dataclass(frozen=True)
class LaneItem:
    """Positions [start, end) of ``seq`` recomputed in the lane.

    kind "prefill": committed tokens without lane K/V (a prompt chunk, or recompute after
    preemption); the last row samples only when ``end == num_committed``.
    kind "window": last committed token + the fast-path candidates; every row samples.
    """

    seq: Sequence
    kind: str
    start: int
    end: int
    candidates: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.end - self.start

    @property
    def sample_rows(self) -> range:
        if self.kind == "window":
            return range(self.rows)
        return range(self.rows - 1, self.rows) if self.end == self.seq.num_committed else range(0)


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
                 lane_sizes: Iterable[int] = ()) -> None:
        """``lane_sizes``: the row counts a lane pass runs at, ascending (the runner's
        ``LaneNumerics.lane_sizes``; default: the whole pass); a pass's spare rows are the
        ones past its used rows up to the smallest size that holds them."""
        self.cfg = cfg
        self.blocks = blocks
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.step_count = 0
        self.prefix_caching = prefix_caching
        self.prefix_hit_tokens = 0
        # where the running lane sequences sat, summed over the steps that planned fast
        # rows ("steps"; see _count_lane_states)
        self.lane_state_steps: Counter[str] = Counter()
        self.prefill_held_steps = 0  # steps that held new prompts back (_hold_prompts)
        self._prompt_held_since: dict[int, int] = {}  # id(seq) -> first step it could run
        # admissions past max_num_seqs (slots of parked lane sequences; _parked_slots), and
        # fast steps that left rows out because they already carried max_num_seqs sequences
        self.parked_admissions = 0
        self.seq_capped_steps = 0
        # deterministic requests admitted ahead of the queue into a lane pass's spare rows
        self.lane_ahead_admissions = 0
        # windows sent with fewer candidates than a full one, into a pass's spare rows
        self.partial_windows = 0
        self.lane_sizes = tuple(lane_sizes) or (cfg.lane_rows,)

    # ---- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
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
        return bool(self.waiting or self.running)

    def stop_ids(self, seq: Sequence) -> frozenset[int]:
        if seq.stop_set is None:  # asked for every sequence every step: built once
            ids = frozenset(seq.params.stop_token_ids)
            seq.stop_set = ids if seq.params.ignore_eos else ids | self.eos_token_ids
        return seq.stop_set

    # ---- the step ---------------------------------------------------------------------
    def schedule(self, fast: bool = True, riders: bool = False) -> SchedulerOutput:
        """Plan one step: lane items, then (unless ``fast`` is False: the engine lets the
        lane have the GPU this step) the fast path's rows. ``riders``: the engine may run
        this step's decode rows in the padding of the lane pass planned with it, so a pass
        planned now leaves room for them (``_rider_room``)."""
        self.step_count += 1
        out = SchedulerOutput(step=self.step_count)
        self._admit()
        if self.cfg.uses_lane:
            out.lane = self._plan_lane(out, riders and fast)
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
            if not self._take(self.waiting[0], reserve=0):
                break
            self.parked_admissions += len(self.running) > self.cfg.max_num_seqs

    def _take(self, seq: Sequence, reserve: int) -> bool:
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

    def candidate_cap(self, seq: Sequence) -> int:
        """How many fast-path candidates this lane sequence's next window may hold."""
        remaining = seq.params.max_tokens - seq.num_output_committed
        room = self.cfg.max_model_len - seq.num_committed
        return max(0, min(self.cfg.max_candidates, remaining - 1, room - 1))

    def window_ready(self, seq: Sequence) -> bool:
        k = seq.num_candidates
        if k >= self.candidate_cap(seq):
            return True
        return k > 0 and seq.token_ids[-1] in self.stop_ids(seq)

    def window_end(self, seq: Sequence) -> int:
        """Where the window ``seq`` would send now ends (its candidates past that, decoded
        while it waited for the pass, stay on as the next window's)."""
        return seq.num_committed + min(seq.num_candidates, self.candidate_cap(seq))

    def _past_cap(self, seq: Sequence, end: int) -> int:
        """How many tokens ``seq`` may decode past a window ending at ``end``: the lane's
        next token plus the next window's candidates, as if the window commits whole (0
        once the window or what follows it ends in a stop token)."""
        if seq.token_ids[-1] in self.stop_ids(seq):
            return 0
        k = end - seq.num_committed  # candidates in the window
        remaining = seq.params.max_tokens - seq.num_output_committed - k - 1
        room = self.cfg.max_model_len - end - 1
        return 1 + max(0, min(self.cfg.max_candidates, remaining - 1, room - 1))

    def _decodes_past_window(self, seq: Sequence) -> bool:
        """A sequence with a full window not yet sent may decode one more token past it."""
        if not (self.cfg.decode_past_queued_windows and self.cfg.overlap_windows
                and self.cfg.max_candidates):
            return False
        end = self.window_end(seq)
        return seq.num_tokens - end < self._past_cap(seq, end)

    def _prefill_from(self, seq: Sequence) -> int | None:
        """Where ``seq``'s next prompt chunk for the lane starts, or None: nothing to send
        now (no prompt left to prefill there, a window of it in the lane, aborted, or
        ``LANE_PREFILL_DEPTH`` chunks of it in the lane already)."""
        if not seq.uses_lane or seq.finish_reason is not None:
            return None
        if not seq.in_lane:
            return seq.num_lane_kv if seq.needs_lane_prefill() else None
        if (self.cfg.pipeline_lane_prefill and seq.lane_sent
                and seq.lane_sent < seq.num_committed - 1
                and seq.lane_items < LANE_PREFILL_DEPTH):
            return seq.lane_sent  # behind its chunks still in the lane
        return None

    def lane_prefill_ready(self) -> bool:
        """Some sequence could send a prompt chunk to the lane now (a step that submitted a
        pass need not wait for it before the next step)."""
        return any(self._prefill_from(s) is not None for s in self.running)

    def _rider_room(self) -> int:
        """Lane rows to leave for this step's decode rows to ride in: one a sequence that
        wants one, none when some sequence wants a prompt chunk (the step is not decode-only,
        so nothing rides), at most half the pass."""
        rows = [self._fast_rows(s) for s in self.running]
        if any(r > 1 for r in rows):
            return 0
        return min(sum(rows), self.cfg.lane_rows // 2)

    def _plan_lane(self, out: SchedulerOutput, riders: bool = False) -> list[LaneItem]:
        idle = [s for s in self.running if s.uses_lane and not s.in_lane]
        starts = {id(s): x for s in self.running if (x := self._prefill_from(s)) is not None}
        prefills = [s for s in self.running if id(s) in starts]
        windows = [s for s in idle if not s.needs_lane_prefill() and self.window_ready(s)]
        ready = prefills + windows
        if not ready:
            return []
        for s in ready:
            if s.ready_step is None:
                s.ready_step = self.step_count
        wanted = sum(s.num_committed - starts[id(s)] for s in prefills)
        wanted += sum(self.window_end(s) - s.num_committed + 1 for s in windows)
        still_decoding = len(idle) > sum(not s.in_lane for s in ready)
        oldest = min(s.ready_step for s in ready if s.ready_step is not None)
        rows_left = self.cfg.lane_rows - (self._rider_room() if riders else 0)
        queued = self._ahead_queue(rows_left - wanted)
        wanted += sum(s.num_committed for s in queued)
        if wanted < rows_left and still_decoding and (
                self.step_count - oldest < self.cfg.lane_max_wait_steps
                or (not prefills and all(self._decodes_past_window(s) for s in windows))):
            return []  # wait for more windows to fill the fixed-size pass
        items: list[LaneItem] = []
        windows.sort(key=lambda s: (s.ready_step, s.arrival))
        for s in windows:
            end = self.window_end(s)
            n = end - s.num_committed + 1
            if n > rows_left:
                continue
            if s.status is not Status.RUNNING or not self._grow(s, s.num_tokens, out):
                continue  # preempted, by an earlier window's growth or by its own
            self._send_window(s, end, items)
            rows_left -= n
        for s in sorted(prefills, key=lambda s: s.arrival):
            if rows_left == 0:
                break
            if s.status is not Status.RUNNING:
                continue
            rows_left -= self._send_prefill(s, starts[id(s)], rows_left, items)
        for s in queued:
            if rows_left == 0 or not self._admit_ahead(s):
                break
            rows_left -= self._send_prefill(s, s.num_lane_kv, rows_left, items)
        if self.cfg.lane_partial_windows:
            self._send_partial_windows(idle, rows_left, items)
        for it in items:
            it.seq.ready_step = None
        return items

    def _send_window(self, seq: Sequence, end: int, items: list[LaneItem]) -> None:
        """Plan ``seq``'s window of the candidates before ``end``."""
        items.append(LaneItem(seq, "window", seq.num_committed - 1, end,
                              tuple(seq.token_ids[seq.num_committed:end])))
        seq.lane_items += 1  # in the lane: from now on no later allocation may preempt it
        seq.lane_end = end
        seq.lane_step = self.step_count

    def _mid_window(self, idle: list[Sequence], busy: Iterable[Sequence]) -> list[Sequence]:
        """Lane sequences of ``idle`` not in ``busy`` with candidates in the middle of a
        window (partial windows to verify)."""
        taken = {id(s) for s in busy}
        return [s for s in idle if id(s) not in taken and s.num_candidates > 0
                and s.status is Status.RUNNING and not s.needs_lane_prefill()
                and not self.window_ready(s)]

    def _send_partial_windows(self, idle: list[Sequence], rows_left: int,
                              items: list[LaneItem]) -> None:
        """Fill the pass's spare rows (``lane_partial_windows``), up to the size it runs
        at, with the candidates so far of lane sequences in the middle of a window."""
        used = sum(it.rows for it in items)
        spare = min(rows_left, lane_run_rows(self.lane_sizes, used) - used)
        mid = self._mid_window(idle, [it.seq for it in items])
        for s in sorted(mid, key=lambda s: (-s.num_candidates, s.arrival)):
            if spare < 2:  # (a window row for the last committed token, one per candidate)
                break
            end = s.num_committed + min(s.num_candidates, spare - 1)
            if not self.blocks.grow(s.block_table, end):  # (worth no preemption)
                continue
            self._send_window(s, end, items)
            self.partial_windows += 1
            spare -= end - s.num_committed + 1

    @staticmethod
    def _send_prefill(seq: Sequence, start: int, rows: int, items: list[LaneItem]) -> int:
        """Plan ``seq``'s prompt chunk from ``start`` in at most ``rows`` lane rows."""
        end = min(seq.num_committed, start + rows)
        items.append(LaneItem(seq, "prefill", start, end, ()))
        seq.lane_items += 1
        seq.lane_sent = end
        return end - start

    def _ahead_queue(self, rows: int) -> list[Sequence]:
        """Queued lane sequences (in queue order, among the first
        ``lane_prefill_lookahead``) whose prompts could fill ``rows`` spare rows of the pass
        being planned (``lane_prefill_ahead``)."""
        if rows <= 0 or not (self.cfg.lane_prefill_ahead and self.cfg.max_candidates):
            return []
        room = self.cfg.lane_prefill_ahead - sum(1 for s in self.running
                                                 if s.needs_lane_prefill())
        if room <= 0:
            return []
        out: list[Sequence] = []
        for seq in itertools.islice(self.waiting, self.cfg.lane_prefill_lookahead):
            if len(out) == room or rows <= 0:
                break
            if seq.uses_lane:
                out.append(seq)
                rows -= seq.num_committed
        return out

    def _admit_ahead(self, seq: Sequence) -> bool:
        """Admit queued lane sequence ``seq`` now, ahead of the queue, if the KV pool holds
        its prompt and still keeps a block for every running sequence to grow into."""
        if not self._take(seq, reserve=len(self.running)):
            return False
        self.lane_ahead_admissions += 1
        return True

    def overlap_cap(self, seq: Sequence) -> int:
        """How many tokens a sequence whose window is in the lane may decode past it."""
        if not (self.cfg.overlap_windows and self.cfg.max_candidates and seq.in_lane
                and seq.lane_end):
            return 0  # (lane_only: every token comes from the lane, none from the fast path)
        return self._past_cap(seq, seq.lane_end)

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
            return 1 if ok and past < self.overlap_cap(seq) else 0
        if seq.uses_lane:
            if seq.needs_lane_prefill():
                return 0
            if self.window_ready(seq) and not self._decodes_past_window(seq):
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

    def check_integrity(self) -> None:
        tables = [s.block_table for s in self.running] + [s.block_table for s in self.waiting]
        self.blocks.check_integrity(tables)
        for s in self.running:
            assert s.num_computed <= s.num_tokens
            assert s.num_committed <= s.num_tokens
            assert len(s.block_table) >= self.blocks.blocks_needed(s.num_computed)
            if s.uses_lane and not s.in_lane:
                assert s.num_lane_kv <= s.num_committed
