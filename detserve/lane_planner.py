"""Lane planning: verify windows and prompt chunks packed into fixed-size passes (no torch).

A lane pass has exactly ``lane_rows`` rows (``verify_window * verify_group``), padded. The
planner says when a sequence's window is ready and how far the fast path may decode past
one in the lane, and decides each step whether a pass goes out and what it carries: full windows first
(oldest ready first), then prompt chunks of lane sequences (a long prompt's chunks
pipelined, at most ``LANE_PREFILL_DEPTH`` in the lane), then prompts of deterministic
requests still queued (admitted ahead), then partial windows in the rows the pass would
otherwise pad. It changes only the lane-side fields of the sequences it sends
(``lane_items``, ``lane_sent``, ``lane_end``, ``lane_step``, ``ready_step``); admission and
preemption stay with the scheduler, reached through ``PlannerHost``.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from detserve.block_manager import BlockManager
from detserve.config import SchedulerConfig
from detserve.sequence import Sequence, Status

# chunks of one prompt in the lane at once when they pipeline: two hide the round trip
# between chunks; more would queue a long prompt's whole prefill ahead of the windows and
# prompts of every other sequence (passes run in submission order)
LANE_PREFILL_DEPTH = 2


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


class PlannerHost(Protocol):
    """What the planner reads from the scheduler (and the admission it asks of it)."""

    cfg: SchedulerConfig
    blocks: BlockManager
    running: list[Sequence]
    waiting: deque[Sequence]
    step_count: int

    def stop_ids(self, seq: Sequence) -> frozenset[int]: ...
    def take(self, seq: Sequence, reserve: int) -> bool: ...


class LanePlanner:
    def __init__(self, host: PlannerHost,
                 lane_run_rows: Callable[[int], int] | None = None) -> None:
        """``lane_run_rows(used)``: the rows a pass of ``used`` rows runs at (the runner's
        lane sizes); its spare rows are the ones past ``used`` up to that."""
        self.host = host
        self.cfg = host.cfg
        self.lane_run_rows: Callable[[int], int] = (
            lane_run_rows or (lambda used: host.cfg.lane_rows))
        # deterministic requests admitted ahead of the queue into a lane pass's spare rows
        self.lane_ahead_admissions = 0
        # windows sent with fewer candidates than a full one, into a pass's spare rows
        self.partial_windows = 0

    # ---- windows ----------------------------------------------------------------------
    def candidate_cap(self, seq: Sequence) -> int:
        """How many fast-path candidates this lane sequence's next window may hold."""
        remaining = seq.params.max_tokens - seq.num_output_committed
        room = self.cfg.max_model_len - seq.num_committed
        return max(0, min(self.cfg.max_candidates, remaining - 1, room - 1))

    def window_ready(self, seq: Sequence) -> bool:
        k = seq.num_candidates
        if k >= self.candidate_cap(seq):
            return True
        return k > 0 and seq.token_ids[-1] in self.host.stop_ids(seq)

    def window_end(self, seq: Sequence) -> int:
        """Where the window ``seq`` would send now ends (its candidates past that, decoded
        while it waited for the pass, stay on as the next window's)."""
        return seq.num_committed + min(seq.num_candidates, self.candidate_cap(seq))

    def _past_cap(self, seq: Sequence, end: int) -> int:
        """How many tokens ``seq`` may decode past a window ending at ``end``: the lane's
        next token plus the next window's candidates, as if the window commits whole (0
        once the window or what follows it ends in a stop token)."""
        if seq.token_ids[-1] in self.host.stop_ids(seq):
            return 0
        k = end - seq.num_committed  # candidates in the window
        remaining = seq.params.max_tokens - seq.num_output_committed - k - 1
        room = self.cfg.max_model_len - end - 1
        return 1 + max(0, min(self.cfg.max_candidates, remaining - 1, room - 1))

    def decodes_past_window(self, seq: Sequence) -> bool:
        """A sequence with a full window not yet sent may decode one more token past it."""
        if not (self.cfg.decode_past_queued_windows and self.cfg.overlap_windows
                and self.cfg.max_candidates):
            return False
        end = self.window_end(seq)
        return seq.num_tokens - end < self._past_cap(seq, end)

    def overlap_cap(self, seq: Sequence) -> int:
        """How many tokens a sequence whose window is in the lane may decode past it."""
        if not (self.cfg.overlap_windows and self.cfg.max_candidates and seq.in_lane
                and seq.lane_end):
            return 0  # (lane_only: every token comes from the lane, none from the fast path)
        return self._past_cap(seq, seq.lane_end)

    # ---- passes -----------------------------------------------------------------------
    def prefill_from(self, seq: Sequence) -> int | None:
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

    def prefill_ready(self) -> bool:
        """Some sequence could send a prompt chunk to the lane now."""
        return any(self.prefill_from(s) is not None for s in self.host.running)

    def plan(self, grow: Callable[[Sequence, int], bool]) -> list[LaneItem]:
        """This step's lane pass (empty: none goes out). ``grow(seq, n)`` makes ``seq``'s
        blocks cover ``n`` positions, preempting others if needed (False: ``seq`` itself
        was preempted)."""
        host, cfg = self.host, self.cfg
        idle = [s for s in host.running if s.uses_lane and not s.in_lane]
        starts = {id(s): x for s in host.running if (x := self.prefill_from(s)) is not None}
        prefills = [s for s in host.running if id(s) in starts]
        windows = [s for s in idle if not s.needs_lane_prefill() and self.window_ready(s)]
        ready = prefills + windows
        if not ready:
            return []
        for s in ready:
            if s.ready_step is None:
                s.ready_step = host.step_count
        wanted = sum(s.num_committed - starts[id(s)] for s in prefills)
        wanted += sum(self.window_end(s) - s.num_committed + 1 for s in windows)
        still_decoding = len(idle) > sum(not s.in_lane for s in ready)
        oldest = min(s.ready_step for s in ready if s.ready_step is not None)
        rows_left = cfg.lane_rows
        queued = self._ahead_queue(rows_left - wanted)
        wanted += sum(s.num_committed for s in queued)
        if wanted < rows_left and still_decoding and (
                host.step_count - oldest < (cfg.lane_max_wait_steps or 0)
                or (not prefills and all(self.decodes_past_window(s) for s in windows))):
            return []  # wait for more windows to fill the fixed-size pass
        items: list[LaneItem] = []
        windows.sort(key=lambda s: (s.ready_step, s.arrival))
        for s in windows:
            end = self.window_end(s)
            n = end - s.num_committed + 1
            if n > rows_left:
                continue
            if s.status is not Status.RUNNING or not grow(s, s.num_tokens):
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
        if cfg.lane_partial_windows:
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
        seq.lane_step = self.host.step_count

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
        spare = min(rows_left, self.lane_run_rows(used) - used)
        mid = self._mid_window(idle, [it.seq for it in items])
        for s in sorted(mid, key=lambda s: (-s.num_candidates, s.arrival)):
            if spare < 2:  # (a window row for the last committed token, one per candidate)
                break
            end = s.num_committed + min(s.num_candidates, spare - 1)
            if not self.host.blocks.grow(s.block_table, end):  # (worth no preemption)
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
        room = self.cfg.lane_prefill_ahead - sum(1 for s in self.host.running
                                                 if s.needs_lane_prefill())
        if room <= 0:
            return []
        out: list[Sequence] = []
        for seq in itertools.islice(self.host.waiting, self.cfg.lane_prefill_lookahead):
            if len(out) == room or rows <= 0:
                break
            if seq.uses_lane:
                out.append(seq)
                rows -= seq.num_committed
        return out

    def _admit_ahead(self, seq: Sequence) -> bool:
        """Admit queued lane sequence ``seq`` now, ahead of the queue, if the KV pool holds
        its prompt and still keeps a block for every running sequence to grow into."""
        if not self.host.take(seq, reserve=len(self.host.running)):
            return False
        self.lane_ahead_admissions += 1
        return True
