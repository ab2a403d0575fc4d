"""Per-request bookkeeping (no torch).

Token positions: ``token_ids`` holds prompt + committed outputs + fast-path candidates.
``num_committed`` counts prompt and committed tokens; candidates are the rest.
``num_computed`` positions have K/V in the cache. For lane (deterministic) sequences
``num_lane_kv`` positions hold K/V written by the lane; between lane passes
``num_lane_kv == num_committed - 1``: the last committed token is the next input. While a
window is in the lane (positions < ``lane_end``) the fast path may append tokens past it:
a speculative start of the next window. The first of those rows feeds the window's last
candidate at ``lane_end - 1``, a slot the lane pass writes too; it runs only in the step
that sends the window, ahead of the pass, so the lane's K/V is the one left there.

With asynchronous scheduling the engine plans step n+1 before step n's tokens are read
back: each of step n's sampled tokens sits in ``token_ids`` as ``PLACEHOLDER`` (counted
like any token; step n+1 takes its value on the device) until the engine reads it. Only
the newest token of a sequence can be a placeholder; ``num_settled`` leaves it out of
what is released.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from detserve.outputs import RequestStats, TokenLogprob
from detserve.params import SamplingParams, SamplingSpec

PLACEHOLDER = -1  # a sampled token whose value is still on the device


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    uses_lane: bool           # deterministic through the lane (llm42 det requests, lane_only)
    deterministic: bool       # what the client gets: bit-exact reproducible output
    arrival: int              # admission order, for FCFS and preemption priority
    token_ids: list[int] = field(default_factory=list)
    num_committed: int = 0
    num_computed: int = 0
    num_lane_kv: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    lane_items: int = 0                # lane items (window, prompt chunks) in flight
    lane_sent: int = 0                 # prompt chunks in the lane cover positions < lane_sent
    lane_end: int = 0                  # a window in the lane covers positions < lane_end
    lane_step: int = 0                 # the step that sent that window
    ready_step: int | None = None      # step at which its lane work became ready
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # prompt_logprobs asked for: one per prompt position computed so far (None: the first)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])
    candidate_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    spec: SamplingSpec = field(default_factory=SamplingSpec)
    block_digests: list[bytes] = field(default_factory=list)  # prefix-cache keys, registered
    stop_set: frozenset[int] | None = None   # stop token ids (the scheduler's cache)
    sat_out: bool = False                    # sat out the last step that had prefill rows

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
            self.num_committed = len(self.prompt_token_ids)

    def prompt_targets(self, start: int, end: int) -> tuple[int, ...]:
        """With ``prompt_logprobs``: the prompt tokens that rows ``start .. end - 1`` (in
        order, from the first) predict; empty when none, or not asked for."""
        if self.params.prompt_logprobs is None:
            return ()
        return tuple(self.prompt_token_ids[start + 1:min(end, self.num_prompt - 1) + 1])

    def add_prompt_logprobs(self, start: int, logprobs: Iterable[TokenLogprob]) -> None:
        """The logprobs of the prompt tokens at ``start + 1 ...`` (from ``prompt_targets``);
        those of positions already known (computed again after a preemption) are dropped."""
        for pos, lp in enumerate(logprobs, start + 1):
            if pos == len(self.prompt_logprobs):
                self.prompt_logprobs.append(lp)
            assert pos <= len(self.prompt_logprobs), "prompt logprobs out of order"

    @property
    def in_lane(self) -> bool:
        """Lane work of this sequence is in flight: no preemption, no freeing until back."""
        return self.lane_items > 0

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_committed(self) -> int:
        return self.num_committed - self.num_prompt

    @property
    def num_candidates(self) -> int:
        return self.num_tokens - self.num_committed

    @property
    def num_settled(self) -> int:
        """Committed tokens whose value is known (a placeholder can only be the last)."""
        n = self.num_committed
        return n - 1 if n > self.num_prompt and self.token_ids[n - 1] == PLACEHOLDER else n

    @property
    def committed_output(self) -> list[int]:
        return self.token_ids[self.num_prompt:self.num_settled]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def needs_lane_prefill(self) -> bool:
        return self.uses_lane and self.num_lane_kv < self.num_committed - 1

    def commit(self, token: int, logprob: TokenLogprob | None) -> None:
        """Append a token that is final (fast path of a non-lane sequence)."""
        assert self.num_candidates == 0
        self.token_ids.append(token)
        self.num_committed += 1
        if logprob is not None:
            self.logprobs.append(logprob)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop KV and candidates; committed tokens stay committed."""
        del self.token_ids[self.num_committed:]
        del self.candidate_logprobs[:]
        self.num_computed = 0
        self.num_lane_kv = 0
        self.block_table = []
        self.block_digests = []
        self.lane_items = 0
        self.lane_sent = 0
        self.lane_end = 0
        self.lane_step = 0
        self.ready_step = None
