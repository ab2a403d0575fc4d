"""Scheduler and block manager: pure bookkeeping, no model."""

from __future__ import annotations

import pytest

from detserve.block_manager import SCRATCH_BLOCK, BlockManager
from detserve.config import SchedulerConfig
from detserve.params import SamplingParams
from detserve.scheduler import LaneItem, Scheduler
from detserve.sequence import Sequence, Status

EOS = 2


def _seq(i: int, n_prompt: int, det: bool, max_tokens: int = 20) -> Sequence:
    return Sequence(f"s{i}", list(range(3, 3 + n_prompt)),
                    SamplingParams(max_tokens=max_tokens, is_deterministic=det),
                    uses_lane=det, deterministic=det, arrival=i)


def _sched(mode: str = "llm42", blocks: int = 64, **kw: object) -> Scheduler:
    cfg = SchedulerConfig(mode=mode, verify_window=kw.pop("W", 4), verify_group=kw.pop("G", 2),
                          max_model_len=kw.pop("max_model_len", 128), **kw)
    return Scheduler(cfg, BlockManager(blocks, 4), eos_token_ids=[EOS])


def _fake_fast(s: Scheduler, out, token: int = 7) -> None:  # type: ignore[no-untyped-def]
    for item in out.fast:
        s.on_fast_result(item, token if item.sample else None)


def test_block_manager_alloc_free_integrity() -> None:
    bm = BlockManager(8, 4)
    assert bm.num_free == 7
    a = bm.allocate(3)
    assert a is not None and SCRATCH_BLOCK not in a
    assert bm.allocate(5) is None, "over-allocation must return None"
    t: list[int] = []
    assert bm.grow(t, 9) and len(t) == 3
    bm.check_integrity([a, t])
    bm.shrink(t, 4)
    assert len(t) == 1
    bm.check_integrity([a, t])
    with pytest.raises(AssertionError):
        bm.check_integrity([a])  # t's block is referenced but not listed
    bm.free(a)
    with pytest.raises(ValueError):
        bm.free(a)
    with pytest.raises(ValueError):
        bm.free([SCRATCH_BLOCK])


def test_token_budget_and_chunked_prefill() -> None:
    s = _sched(mode="nondeterministic", max_num_batched_tokens=16)
    for i in range(3):
        s.add(_seq(i, 30, det=False))
    out = s.schedule()
    assert sum(i.end - i.start for i in out.fast) == 16
    assert out.fast[0].start == 0 and out.fast[0].end == 16 and not out.fast[0].sample
    _fake_fast(s, out)
    out = s.schedule()
    first = out.fast[0]
    assert first.start == 16 and first.end == 30 and first.sample
    s.check_integrity()


def test_decode_rows_go_before_prefill() -> None:
    s = _sched(mode="nondeterministic", max_num_batched_tokens=8)
    s.add(_seq(0, 5, det=False))
    _fake_fast(s, s.schedule())
    s.add(_seq(1, 40, det=False))
    out = s.schedule()
    assert out.fast[0].seq.request_id == "s0" and out.fast[0].end - out.fast[0].start == 1
    assert out.fast[1].end - out.fast[1].start == 7


def test_lane_pass_has_fixed_rows_and_windows() -> None:
    s = _sched(W=4, G=2, overlap_windows=False)  # lane of 8 rows, 3 candidates per window
    seq = _seq(0, 10, det=True)
    s.add(seq)
    out = s.schedule()
    assert [(i.kind, i.start, i.end) for i in out.lane] == [("prefill", 0, 8)]
    assert not out.fast, "a lane seq never takes the fast path before its prompt is in the lane"
    s.on_lane_result(out.lane[0], [])
    out = s.schedule()
    assert [(i.kind, i.start, i.end) for i in out.lane] == [("prefill", 8, 10)]
    assert list(out.lane[0].sample_rows) == [1]
    s.on_lane_result(out.lane[0], [11])
    assert seq.num_committed == 11 and seq.num_lane_kv == 10
    for _ in range(3):  # three fast candidates fill the window
        out = s.schedule()
        assert not out.lane and len(out.fast) == 1
        _fake_fast(s, out, token=20)
    out = s.schedule()
    assert not out.fast
    (win,) = out.lane
    assert (win.kind, win.start, win.end, win.candidates) == ("window", 10, 14, (20, 20, 20))
    # lane agrees with one candidate, then differs: commit it + the lane's token
    rejected = s.on_lane_result(win, [20, 21])
    assert rejected == 2
    assert seq.token_ids[10:] == [11, 20, 21]
    assert seq.num_committed == 13 and seq.num_computed == seq.num_lane_kv == 12
    assert seq.stats.rollbacks == 1 and seq.stats.tokens_rolled_back == 2
    s.check_integrity()


def _window_in_lane(s: Scheduler, seq: Sequence):  # type: ignore[no-untyped-def]
    """Prefill ``seq`` (10-token prompt) through the lane, fill its first window with
    candidates 20, 20, 20 and schedule it: returns that step's output."""
    s.add(seq)
    out = s.schedule()
    s.on_lane_result(out.lane[0], [])
    out = s.schedule()
    s.on_lane_result(out.lane[0], [11])
    for _ in range(3):
        _fake_fast(s, s.schedule(), token=20)
    return s.schedule()


def test_sequence_decodes_past_its_window_while_the_lane_verifies() -> None:
    """Overlap: the step that sends a window to the lane also decodes past it, up to the
    lane's next token + one more window; those tokens stay when the lane commits the whole
    window and its next token is the one the fast path went on from."""
    s = _sched(W=4, G=2)
    seq = _seq(0, 10, det=True, max_tokens=40)
    out = _window_in_lane(s, seq)
    (win,) = out.lane
    assert (win.start, win.end) == (10, 14)
    assert [(i.start, i.end) for i in out.fast] == [(13, 14)]  # the last candidate's row
    _fake_fast(s, out, token=21)
    assert s.lane.overlap_cap(seq) == 4  # the lane's next token + 3 candidates of the next window
    for _ in range(3):
        out = s.schedule()
        assert not out.lane and len(out.fast) == 1
        _fake_fast(s, out, token=22)
    assert not s.schedule().fast, "no further than one window past the lane"
    assert seq.token_ids[10:] == [11, 20, 20, 20, 21, 22, 22, 22]
    assert s.on_lane_result(win, [20, 20, 20, 21]) == 0
    assert seq.num_committed == 15 and seq.num_lane_kv == 14 and seq.num_computed == 17
    assert seq.num_candidates == 3 and s.lane.window_ready(seq)
    s.check_integrity()


@pytest.mark.parametrize("lane_says", [[20, 20, 20, 9], [20, 9]])
def test_tokens_past_a_window_go_when_the_lane_disagrees(lane_says: list[int]) -> None:
    """The lane's next token differs from where the fast path went on (or a candidate is
    rejected): everything past the commit point is thrown away and counted."""
    s = _sched(W=4, G=2)
    seq = _seq(0, 10, det=True, max_tokens=40)
    out = _window_in_lane(s, seq)
    (win,) = out.lane
    _fake_fast(s, out, token=21)
    _fake_fast(s, s.schedule(), token=22)
    dropped = s.on_lane_result(win, lane_says)
    accepted = len(lane_says) - 1
    assert dropped == 3 - accepted + 2
    assert seq.token_ids[11:] == lane_says
    assert seq.num_committed == 11 + len(lane_says)
    assert seq.num_computed == seq.num_lane_kv == seq.num_committed - 1
    assert seq.stats.tokens_rolled_back == dropped
    s.check_integrity()


def test_no_decoding_past_a_window_that_ends_in_a_stop_token() -> None:
    s = _sched(W=4, G=2)
    seq = _seq(0, 10, det=True, max_tokens=40)
    s.add(seq)
    out = s.schedule()
    s.on_lane_result(out.lane[0], [])
    out = s.schedule()
    s.on_lane_result(out.lane[0], [11])
    _fake_fast(s, s.schedule(), token=EOS)
    out = s.schedule()
    assert out.lane and out.lane[0].candidates == (EOS,)
    assert not out.fast and s.lane.overlap_cap(seq) == 0


def test_lane_bound_when_most_sequences_wait_on_the_lane() -> None:
    s = _sched(W=4, G=2, lane_bound_fraction=0.5)
    det = [_seq(i, 6, det=True) for i in range(3)]
    other = _seq(3, 6, det=False)
    for q in (*det, other):
        s.add(q)
    out = s.schedule()  # the three prompts go to the lane: 3 of 4 sequences wait on it
    assert len(out.lane) == 2 and s.lane_bound()  # (the third prompt did not fit this pass)
    for it in out.lane:
        s.on_lane_result(it, [9] if it.end == it.seq.num_committed else [])
    assert not s.lane_bound()
    never = _sched(W=4, G=2, lane_bound_fraction=1.0)
    for i in range(2):
        never.add(_seq(i, 6, det=True))
    never.schedule()
    assert not never.lane_bound()


@pytest.mark.parametrize("headroom", [0.5, 0.0])
def test_parked_lane_sequences_lend_their_batch_slots(headroom: float) -> None:
    """While deterministic sequences sit parked on the lane (here: their prompts), admission
    runs as many more sequences as they are (at most headroom x max_num_seqs), and a fast
    step still carries at most max_num_seqs sequences. With 0 every running sequence holds
    a slot, as before."""
    s = _sched(W=4, G=4, max_num_seqs=4, parked_seq_headroom=headroom)
    det = [_seq(0, 6, det=True), _seq(1, 6, det=True)]
    others = [_seq(i, 6, det=False) for i in range(2, 8)]
    for q in (*det, *others):
        s.add(q)
    out = s.schedule()  # admits 4: both prompts to the lane, two others prefill
    pass_ = out.lane
    assert [(i.seq.request_id, i.start, i.end) for i in pass_] == [("s0", 0, 6), ("s1", 0, 6)]
    assert [i.seq.request_id for i in out.fast] == ["s2", "s3"]
    _fake_fast(s, out)
    out = s.schedule()  # the two parked prompts lend their slots (cap: 0.5 x 4 = 2)
    ran = [q.request_id for q in s.running]
    assert ran == (["s0", "s1", "s2", "s3", "s4", "s5"] if headroom else ["s0", "s1", "s2", "s3"])
    assert s.parked_admissions == (2 if headroom else 0)
    assert len(out.fast) == (4 if headroom else 2)
    _fake_fast(s, out)
    for it in pass_:  # the lane answers: each prompt gets its first token
        s.on_lane_result(it, [9])
    out = s.schedule()  # nothing parked: no admission; 6 (or 4) sequences want a row
    assert len(s.running) == (6 if headroom else 4)
    assert len(out.fast) == 4, "a fast step carries at most max_num_seqs sequences"
    assert s.seq_capped_steps == (1 if headroom else 0)
    left_out = {q.request_id for q in s.running} - {i.seq.request_id for i in out.fast}
    assert left_out == ({"s4", "s5"} if headroom else set()), "the newest wait a step"
    _fake_fast(s, out)
    s.check_integrity()


@pytest.mark.parametrize(("ahead", "lookahead", "blocks", "admitted"),
                         [(8, 32, 64, ["s3", "s4"]), (0, 32, 64, []), (1, 32, 64, []),
                          (8, 32, 8, []), (8, 2, 64, ["s3"])],
                         ids=["on", "off", "cap", "kv-reserve", "lookahead"])
def test_spare_lane_rows_take_queued_deterministic_prompts(
        ahead: int, lookahead: int, blocks: int, admitted: list[str]) -> None:
    """A lane pass that goes out with rows to spare fills them with the prompts of
    deterministic requests queued behind others, admitting them ahead of the queue (the
    last one's prompt in part; its next chunk goes as an admitted sequence's). Not with
    lane_prefill_ahead 0, not while that many lane sequences already wait for their lane
    prefill (cap 1: s0), not when the KV pool would keep less than a block for every
    running sequence, and only among the first ``lane_prefill_lookahead`` queued (2: s2,
    s3)."""
    s = _sched(W=4, G=4, max_num_seqs=2, parked_seq_headroom=0.0, lane_prefill_ahead=ahead,
               lane_prefill_lookahead=lookahead, blocks=blocks)
    queue = [_seq(0, 6, det=True), _seq(1, 6, det=False), _seq(2, 6, det=False),
             _seq(3, 5, det=True), _seq(4, 8, det=True)]
    for q in queue:
        s.add(q)
    out = s.schedule()
    chunks = {"s3": ("s3", 0, 5), "s4": ("s4", 0, 5)}
    assert [(i.seq.request_id, i.start, i.end) for i in out.lane] == \
        [("s0", 0, 6)] + [chunks[r] for r in admitted]
    assert [q.request_id for q in s.running] == ["s0", "s1", *admitted]
    assert [q.request_id for q in s.waiting] == [r for r in ("s2", "s3", "s4")
                                                 if r not in admitted]
    assert s.lane.lane_ahead_admissions == len(admitted)
    assert all(not q.block_table for q in s.waiting), "a refused admission keeps no blocks"
    assert [i.seq.request_id for i in out.fast] == ["s1"]
    _fake_fast(s, out)
    for it in out.lane:
        s.on_lane_result(it, [9] if it.end == it.seq.num_committed else [])
    s.check_integrity()
    sent = []
    for _ in range(s.cfg.lane_max_wait_steps + 2):  # (a lone chunk waits for the pass to fill)
        out = s.schedule()
        assert len(out.fast) <= 2, "a fast step carries at most max_num_seqs sequences"
        sent += [(i.seq.request_id, i.start, i.end) for i in out.lane]
        _fake_fast(s, out)
        s.check_integrity()
        if sent:
            break
    if "s4" in admitted:  # s4's rest goes as an admitted sequence's chunk
        assert ("s4", 5, 8) in sent


def test_schedule_without_fast_rows_still_plans_the_lane() -> None:
    """schedule(fast=False) (the engine gives the step to the lane) plans lane items and no
    fast rows; the sequences it left out get their rows in the next ordinary step."""
    s = _sched(W=4, G=2)
    det, other = _seq(0, 6, det=True), _seq(1, 6, det=False)
    for q in (det, other):
        s.add(q)
    out = s.schedule(fast=False)
    assert [i.seq for i in out.lane] == [det] and not out.fast
    assert other.num_computed == 0, "a step without fast rows must not advance the others"
    out = s.schedule()
    assert [i.seq for i in out.fast] == [other] and out.fast[0].end == 6


def test_no_fast_row_writes_a_slot_the_lane_pass_in_flight_writes() -> None:
    """A window's last candidate sits at lane_end - 1, a slot its lane pass writes. Its
    decode row may run in the step that sends the window (queued ahead of the pass), never
    in a later one, where it could land after the lane's write: sent by a step without
    fast rows, the sequence waits for the lane's decision instead."""
    for fast in (True, False):
        s = _sched(W=4, G=1)
        seq = _seq(0, 3, det=True)
        s.add(seq)
        s.on_lane_result(s.schedule().lane[0], [9])
        for _ in range(3):
            _fake_fast(s, s.schedule())
        out = s.schedule(fast=fast)
        (win,) = out.lane
        assert win.end == seq.lane_end == seq.num_tokens
        rows = [i for i in out.fast if i.seq is seq]
        assert [(i.start, i.end) for i in rows] == ([(win.end - 1, win.end)] if fast else [])
        _fake_fast(s, out)
        later = s.schedule()
        if fast:  # decoding past the window, beyond the lane's slots
            assert [i.start for i in later.fast] == [win.end]
        else:
            assert not later.fast and not later.lane
            s.on_lane_result(win, [*win.candidates, 11])
            assert [i.start for i in s.schedule().fast] == [win.end]


def test_lane_state_counts() -> None:
    """Each step with fast rows tallies the running lane sequences by where they sit:
    prompt in the lane (prefill), decoding (fast), a full window not yet sent (window: the
    pass waits for more), in the lane and decoded as far past it as allowed (capped)."""
    # (full windows wait without decoding past them here: the old rule, and the states are
    # easier to tell apart)
    s = _sched(W=4, G=3, lane_max_wait_steps=100, decode_past_queued_windows=False)
    a, b = _seq(0, 3, det=True), _seq(1, 3, det=True)
    short = _seq(2, 3, det=True, max_tokens=3)  # one candidate fills its window
    for q in (_seq(3, 3, det=False), a, b, short):
        s.add(q)
    expected = [
        {"prefill": 3},  # the three prompts go to the lane together
        {"fast": 3},
        {"fast": 2, "window": 1},  # short's window waits for a's and b's (G=3)
        {"fast": 2, "window": 1},
        {"fast": 3},  # the three windows leave; each decodes one past its window
        {"fast": 2, "capped": 1},  # short may not decode further (max_tokens) until the
        {"fast": 2, "capped": 1},  # lane's decision comes back (withheld here)
    ]
    for k, want in enumerate(expected):
        before = s.lane_state_steps.copy()
        out = s.schedule()
        assert s.lane_state_steps - before == {"steps": 1, **want}, k
        _fake_fast(s, out)
        if k < 4:
            for it in out.lane:
                s.on_lane_result(it, [9])
    before = s.lane_state_steps.copy()
    s.schedule(fast=False)
    assert s.lane_state_steps == before, "a step without fast rows counts nothing"
    nothing = _sched(mode="nondeterministic")
    nothing.add(_seq(0, 3, det=False))
    nothing.schedule()
    assert not nothing.lane_state_steps, "no lane, nothing counted"


def test_lane_waits_to_fill_group_then_times_out() -> None:
    s = _sched(W=4, G=2, lane_max_wait_steps=3)
    a, b = _seq(0, 3, det=True), _seq(1, 3, det=True, max_tokens=40)
    for q in (a, b):
        s.add(q)
    out = s.schedule()
    assert {i.seq.request_id for i in out.lane} == {"s0", "s1"}
    for it in out.lane:
        s.on_lane_result(it, [9])
    # make a's window ready while b still decodes: the lane waits (b could join)
    for _ in range(3):
        out = s.schedule()
        _fake_fast(s, out)
    a_ready = s.lane.window_ready(a)
    assert a_ready and not out.lane


def test_lane_only_sends_every_token_through_the_lane() -> None:
    s = _sched(mode="lane_only", W=4, G=2)
    seq = _seq(0, 3, det=True)
    s.add(seq)
    out = s.schedule()
    s.on_lane_result(out.lane[0], [9])
    out = s.schedule()
    assert not out.fast
    (w,) = out.lane
    assert w.kind == "window" and w.rows == 1 and w.candidates == ()


def test_candidates_capped_by_max_tokens_and_eos() -> None:
    s = _sched(W=8, G=1)
    seq = _seq(0, 3, det=True, max_tokens=3)
    s.add(seq)
    s.on_lane_result(s.schedule().lane[0], [9])  # 1 output committed, 2 remain
    assert s.lane.candidate_cap(seq) == 1, "W-1=7 capped so that candidates + lane token <= 2"
    s2 = _sched(W=8, G=1)
    seq2 = _seq(1, 3, det=True)
    s2.add(seq2)
    s2.on_lane_result(s2.schedule().lane[0], [9])
    out = s2.schedule()
    assert len(out.fast) == 1 and not s2.lane.window_ready(seq2)
    s2.on_fast_result(out.fast[0], EOS)
    assert s2.lane.window_ready(seq2), "an EOS candidate closes the window early"
    (win,) = s2.schedule().lane
    assert win.candidates == (EOS,)


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    s = _sched(mode="nondeterministic", blocks=9, max_num_batched_tokens=64)  # 8 usable
    seqs = [_seq(i, 7, det=False, max_tokens=30) for i in range(3)]
    for q in seqs:
        s.add(q)
    preempted = 0
    for _ in range(40):
        out = s.schedule()
        preempted += len(out.preempted)
        _fake_fast(s, out)
        s.check_integrity()
    assert preempted > 0
    victim = next(q for q in seqs if q.stats.preemptions)
    assert victim.num_committed > victim.num_prompt, "committed tokens survive preemption"


def test_remove_releases_blocks() -> None:
    s = _sched()
    q = _seq(0, 9, det=False)
    s.add(q)
    s.schedule()
    s.remove(q)
    assert q.status is Status.FINISHED and s.blocks.num_free == 63
    s.check_integrity()


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="unknown mode"):
        SchedulerConfig(mode="fast")
    with pytest.raises(ValueError):
        SchedulerConfig(verify_window=0)
    with pytest.raises(TypeError, match="lane_partial_fill"):  # deleted (measured no faster)
        SchedulerConfig(lane_partial_fill=True)  # type: ignore[call-arg]
    assert SchedulerConfig().lane_rows == 512


@pytest.mark.parametrize("joins", [True, False])
def test_lane_decode_rows_in_steps_with_prefill(joins: bool) -> None:
    """With ``lane_decode_in_mixed_steps=False`` a lane sequence's decode row sits out every
    other step that carries prefill rows (never starved), and joins decode-only steps."""
    s = _sched(W=8, G=2, max_num_batched_tokens=6, lane_decode_in_mixed_steps=joins)
    det = _seq(0, 5, det=True, max_tokens=60)
    s.add(det)
    while det.needs_lane_prefill() or det.num_committed == det.num_prompt:
        out = s.schedule()  # the prompt goes through the lane
        _fake_fast(s, out)
        for it in out.lane:
            s.on_lane_result(it, [9] if it.sample_rows else [])
    assert s.schedule().fast  # decode-only: the lane sequence decodes
    s.add(_seq(1, 40, det=False))  # 40 prompt tokens: several steps with prefill rows
    joined = []
    for _ in range(4):
        out = s.schedule()
        assert any(i.end - i.start > 1 for i in out.fast), "a step with prefill rows"
        joined.append(any(i.seq is det for i in out.fast))
        _fake_fast(s, out)
    assert joined == ([True] * 4 if joins else [False, True, False, True])
    s.check_integrity()


@pytest.mark.parametrize("pipeline", [True, False])
def test_long_prompt_chunks_pipeline_into_the_lane(pipeline: bool) -> None:
    """A prompt longer than a lane pass (8 rows here) goes to the lane in chunks. Pipelined,
    each step sends the next chunk while the earlier ones are still in the lane (no round
    trip per chunk); results come back in order and the last chunk samples the first token.
    Without pipelining a chunk goes out only once the previous one came back."""
    from detserve.lane_planner import LANE_PREFILL_DEPTH

    assert LANE_PREFILL_DEPTH == 2
    s = _sched(W=4, G=2, pipeline_lane_prefill=pipeline)
    seq = _seq(0, 21, det=True)
    s.add(seq)
    sent = []
    for _ in range(2):
        out = s.schedule()
        sent += out.lane
        assert not out.fast, "no fast rows while the prompt is in the lane"
        if not pipeline:
            break
    assert [(i.start, i.end) for i in sent] == ([(0, 8), (8, 16)] if pipeline else [(0, 8)])
    assert seq.in_lane and seq.lane_items == len(sent)
    assert not s.lane_prefill_ready() and s.schedule().lane == [], "at most two in flight"
    first = sent.pop(0)
    s.on_lane_result(first, [])
    assert seq.num_lane_kv == 8 and seq.in_lane == pipeline
    if pipeline:  # room again: the last chunk goes out behind the second
        assert s.lane_prefill_ready()
        sent += s.schedule().lane
        assert [(i.start, i.end) for i in sent] == [(8, 16), (16, 21)]
        for n, item in enumerate(sent):
            last = item.end == seq.num_committed
            assert list(item.sample_rows) == ([item.rows - 1] if last else [])
            s.on_lane_result(item, [9] if last else [])
            assert seq.num_lane_kv == item.end and seq.in_lane == (n == 0)
        assert seq.num_committed == 22 and seq.token_ids[-1] == 9 and seq.lane_sent == 0
        s.check_integrity()
        out = s.schedule()  # out of the lane: decodes on the fast path now
        assert [(i.start, i.end) for i in out.fast] == [(21, 22)] and not out.lane
    else:
        assert [(i.start, i.end) for i in s.schedule().lane] == [(8, 16)]


def test_an_aborted_prompt_sends_no_more_chunks() -> None:
    s = _sched(W=4, G=2)
    seq = _seq(0, 21, det=True)
    s.add(seq)
    first = s.schedule().lane[0]
    seq.finish_reason = "abort"  # what LLMEngine.abort_request does to a sequence in the lane
    assert not s.lane_prefill_ready() and s.schedule().lane == []
    assert s.lane_item_done(seq) and not seq.in_lane  # its blocks may be freed now
    assert first.end == 8


def test_lane_results_out_of_order_are_refused() -> None:
    s = _sched(W=4, G=2)
    seq = _seq(0, 21, det=True)
    s.add(seq)
    first, second = s.schedule().lane[0], s.schedule().lane[0]
    with pytest.raises(AssertionError, match="out of order"):
        s.on_lane_result(second, [])
    assert first.start == 0


def _run_lane(s: Scheduler, steps: int, hold: dict[str, int] | None = None) -> list:  # type: ignore[type-arg]
    """Step ``s`` with fast token 7 everywhere and every lane item answered at once (prompt
    chunks: token 9; windows: all candidates accepted, next token 7), except prompt chunks
    of the sequences in ``hold``, answered that many steps late. Returns each step's output."""
    held: list[tuple[int, LaneItem]] = []
    outs = []
    for t in range(steps):
        out = s.schedule()
        _fake_fast(s, out)
        outs.append(out)
        for it in out.lane:
            late = (hold or {}).get(it.seq.request_id, 0) if it.kind == "prefill" else 0
            held.append((t + late, it))
        for due, it in [h for h in held if h[0] <= t]:
            held.remove((due, it))
            rejected = s.on_lane_result(it, [9] if it.kind == "prefill" else [*it.candidates, 7])
            assert rejected == 0
    return outs


def test_queued_window_decodes_past_itself_and_waits_for_a_fuller_pass() -> None:
    """a's full window waits for b's (still decoding) past ``lane_max_wait_steps`` because
    a keeps decoding past it; the two leave together, a's at its window's size, and the
    tokens a decoded past it stay when the lane commits the whole window. With the old rule
    (``decode_past_queued_windows=False``) a stalls, and its window leaves alone."""
    for on in (True, False):
        # (no partial windows: b's candidates would join the pass that a's window leaves in)
        s = _sched(W=4, G=2, lane_max_wait_steps=1, decode_past_queued_windows=on,
                   lane_partial_windows=False)
        a, b = _seq(0, 3, det=True, max_tokens=40), _seq(1, 3, det=True, max_tokens=40)
        s.add(a)
        s.add(b)
        outs = _run_lane(s, 8, hold={"s1": 2})  # b starts decoding two steps after a
        sent = [(t, [(i.seq.request_id, i.start, i.end) for i in o.lane])
                for t, o in enumerate(outs) if o.lane and t > 0]
        a_rows = [t for t, o in enumerate(outs) if any(i.seq is a for i in o.fast)]
        if on:
            # a's window (positions 3..6) was full after step 3; it decoded on each step
            assert sent[0] == (6, [("s0", 3, 7), ("s1", 3, 7)]), sent
            assert a_rows == list(range(1, 8)), "a never stalled"
            assert a.num_committed == 8 and a.num_tokens == 11, "a's tokens past the window kept"
        else:
            assert sent[0] == (5, [("s0", 3, 7)]), sent
            assert a_rows == [1, 2, 3, 5, 6, 7], "a stalled while its window waited"


def test_queued_window_leaves_once_its_sequence_may_decode_no_further() -> None:
    """a (max_tokens 3: a window of one candidate, one token past it) waits for b only
    while it can decode past its window: then its window leaves alone, b still decoding."""
    s = _sched(W=4, G=2, lane_max_wait_steps=1, lane_partial_windows=False)  # (b's alone)
    a, b = _seq(0, 3, det=True, max_tokens=3), _seq(1, 3, det=True, max_tokens=40)
    s.add(a)
    s.add(b)
    outs = _run_lane(s, 4)
    assert not outs[2].lane and [(i.start, i.end) for i in outs[2].fast if i.seq is a] == [(4, 5)]
    assert [(i.seq.request_id, i.start, i.end) for i in outs[3].lane] == [("s0", 3, 5)]
    assert not any(i.seq is a for i in outs[3].fast), "a was at its limit past the window"
    assert a.num_committed == a.num_tokens == 6, "the token past the window committed too"


def test_new_prompts_wait_for_company_while_others_decode() -> None:
    """With ``prefill_batch_tokens`` a prompt that arrives while others decode waits
    (decode-only steps) until enough prompt tokens are pending or it has waited
    ``prefill_max_wait_steps`` steps; never when no decode row would run, and a prompt
    already started is never held."""
    s = _sched(mode="nondeterministic", prefill_batch_tokens=8, prefill_max_wait_steps=2,
               max_num_batched_tokens=6)
    a = _seq(0, 3, det=False)
    s.add(a)
    out = s.schedule()
    assert [(i.seq, i.start, i.end) for i in out.fast] == [(a, 0, 3)], "no decode row: no wait"
    _fake_fast(s, out)
    b = _seq(1, 5, det=False)
    s.add(b)
    for _ in range(2):  # b (5 tokens < 8) waits two steps
        out = s.schedule()
        assert [i.seq for i in out.fast] == [a]
        _fake_fast(s, out)
    out = s.schedule()  # waited long enough; the budget (6) takes a's row and 5 of b
    assert [(i.seq, i.end - i.start) for i in out.fast] == [(a, 1), (b, 5)]
    _fake_fast(s, out)
    assert s.prefill_held_steps == 2
    c, d = _seq(2, 4, det=False), _seq(3, 4, det=False)
    s.add(c)
    out = s.schedule()
    assert {i.seq.request_id for i in out.fast} == {"s0", "s1"}, "c waits"
    _fake_fast(s, out)
    s.add(d)  # c + d: 8 tokens pending, enough to go now
    out = s.schedule()
    assert [(i.seq.request_id, i.end - i.start) for i in out.fast] == [
        ("s0", 1), ("s1", 1), ("s2", 4)]
    _fake_fast(s, out)
    # d's prompt did not fit the budget; alone now, it waits, counted from that step
    held = s.prefill_held_steps
    out = s.schedule()
    assert s.prefill_held_steps == held + 1 and "s3" not in {i.seq.request_id for i in out.fast}
    _fake_fast(s, out)
    out = s.schedule()
    assert "s3" in {i.seq.request_id for i in out.fast}, "d waited two steps in all"


def test_prompt_wait_is_off_by_default_outside_the_engine_and_on_cpu() -> None:
    s = _sched(mode="nondeterministic")
    assert s.cfg.prefill_batch_tokens is None
    a, b = _seq(0, 3, det=False), _seq(1, 3, det=False)
    s.add(a)
    _fake_fast(s, s.schedule())
    s.add(b)
    assert {i.seq.request_id for i in s.schedule().fast} == {"s0", "s1"}
    with pytest.raises(ValueError, match="prefill_batch_tokens"):
        SchedulerConfig(prefill_batch_tokens=-1)


def test_stop_conditions_are_applied_with_the_step_results() -> None:
    """The scheduler closes a step (``take_updates``) by applying the stop conditions to
    the tokens it settled: a stop token (the output cut after it), ``max_tokens``, a stop
    string (the caller's text check); only the sequences with outputs are listed. Control:
    a sequence hitting none of them runs on and gets no output while its token is unread."""
    cfg = SchedulerConfig(mode="nondeterministic", max_model_len=128)
    s = Scheduler(cfg, BlockManager(64, 4), eos_token_ids=[EOS],
                  stop_string_end=lambda seq: next(
                      (i for i, t in enumerate(seq.token_ids) if i >= seq.num_prompt and t == 11),
                      None))
    seqs = [Sequence(f"s{i}", [3, 4, 5], SamplingParams(max_tokens=mt, stop=stop),
                     uses_lane=False, deterministic=False, arrival=i)
            for i, (mt, stop) in enumerate([(2, ()), (9, ()), (9, ("!",)), (9, ())])]
    for seq in seqs:
        s.add(seq)
    tokens = {"s0": [7, 7], "s1": [EOS, 7], "s2": [8, 11], "s3": [8, 8]}
    for step in range(2):
        out = s.schedule()
        for item in out.fast:
            assert s.place(item)
        if step == 0:  # s3's token stays on the device: no output for it yet
            assert [(q.request_id, n) for q, n in s.take_updates()] == []
        for item in out.fast:
            s.on_token_read(item, tokens[item.seq.request_id][step], None)
        updates = s.take_updates()
        s.check_integrity()
    finished = {q.request_id: (q.finish_reason, q.committed_output) for q in seqs if q.finished}
    assert finished == {"s0": ("length", [7, 7]), "s1": ("stop", [EOS]), "s2": ("stop", [8, 11])}
    assert [q.request_id for q, _ in updates] == ["s0", "s2", "s3"]
    assert not seqs[3].finished and seqs[3].committed_output == [8, 8]
