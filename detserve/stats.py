"""Engine statistics: counters bumped as the engine goes, a report built only when read.

The engine keeps one ``Counter`` of event counts (passes, rows, tokens, rollbacks, ...)
and of wall time in microseconds (keys ending in ``_us``); it holds nothing derived.
``report`` joins it with what the scheduler, the runner and the block manager count
themselves into the flat dict ``LLMEngine.stats()`` returns (the keys benchmarks and the
serving metrics read).
"""

from __future__ import annotations

import time
from collections import Counter

from detserve.block_manager import BlockManager
from detserve.executor.runner import ModelRunner
from detserve.scheduler import LANE_STATES, Scheduler

# plain counts, reported under their own names
COUNTS = (
    "steps", "fast_passes", "fast_rows", "fast_tokens", "verify_passes", "windows",
    "rollbacks", "tokens_rolled_back", "lane_rows", "lane_padding_rows",
    "lane_computed_rows", "lane_bound_waits", "lane_prefill_rows", "preemptions",
    "perturbed_tokens",
    # asynchronous scheduling: rows fed the previous step's token on the device, and rows
    # planned after what turned out to be a stop token (run, then dropped)
    "fed_rows", "dropped_rows",
    # lane decisions that had to read the batch in flight first (the device then idles
    # until the host queues the next step)
    "decision_syncs",
    "decode_steps", "mixed_steps",
    # verification lost (``LLMEngine.fail_lane``): times, and deterministic requests failed
    "lane_failures", "lane_failed_requests")
# where the engine's wall time goes: scheduling, fast-path steps (decode only, or with
# prefill rows), submitting lane passes (building and sending them), waiting for or
# applying their results, building outputs (reported as ``<name>_seconds``)
TIMES = ("schedule", "decode_step", "mixed_step", "lane_submit", "lane_wait", "output")


class StepClock:
    """Wall time of a step's phases: each ``lap(phase)`` adds the time since the previous
    lap (or the start) to the counter ``<phase>_us``."""

    def __init__(self, counters: Counter[str]) -> None:
        self._counters = counters
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        t = time.perf_counter()
        self._counters[f"{phase}_us"] += int((t - self._t) * 1e6)
        self._t = t


def report(c: Counter[str], scheduler: Scheduler, runner: ModelRunner,
           blocks: BlockManager) -> dict[str, float]:
    """Everything ``LLMEngine.stats()`` returns, built now from the counters' sources."""
    out: dict[str, float] = {k: c[k] for k in COUNTS}
    out["committed_tokens"] = scheduler.committed_tokens
    out["finished_requests"] = scheduler.finished_requests
    out["recomputed_tokens"] = c["tokens_rolled_back"] + c["preempted_tokens"]
    out["prefix_cache_hit_tokens"] = scheduler.prefix_hit_tokens
    out["prefill_held_steps"] = scheduler.prefill_held_steps
    out["parked_admissions"] = scheduler.parked_admissions
    out["lane_ahead_admissions"] = scheduler.lane.lane_ahead_admissions
    out["partial_windows"] = scheduler.lane.partial_windows
    out["seq_capped_steps"] = scheduler.seq_capped_steps
    out["lane_padding_fraction"] = (c["lane_padding_rows"] / c["lane_rows"]
                                    if c["lane_rows"] else 0.0)
    out["lane_seconds"] = c["lane_seconds_us"] / 1e6
    for k in TIMES:
        out[f"{k}_seconds"] = c[f"{k}_us"] / 1e6
    # running lane sequences per step by state (Scheduler._count_lane_states)
    states = scheduler.lane_state_steps
    for k in LANE_STATES:
        out[f"lane_seqs_{k}"] = states[k] / max(1, states["steps"])
    # products of eager steps whose decode rows need the lane's bits: one call over all
    # rows (the probe found that size runs the lane chunk's algorithm) or split in two
    out["head_products_one_call"] = runner.head_products["one"]
    out["head_products_split"] = runner.head_products["split"]
    sets = [g for g in (runner.decode_graphs, runner.plain_graphs) if g is not None]
    for graphs in sets:  # GPU time of the decode steps' graph replays
        graphs.settle_timing()
    out["decode_graph_gpu_s"] = sum(g.gpu_seconds for g in sets)
    out["decode_graph_replays"] = sum(g.timed_replays for g in sets)
    # of them, replays of the plain fast path's graphs (no deterministic decode row)
    plain = runner.plain_graphs
    out["plain_graph_replays"] = plain.timed_replays if plain is not None else 0
    steps = runner.step_graphs  # steps with prompt chunks replayed as graphs
    out["step_graph_replays"] = steps.replays if steps is not None else 0
    out["running_requests"] = len(scheduler.running)
    out["waiting_requests"] = len(scheduler.waiting)
    out["kv_blocks_free"] = blocks.num_free
    return out
