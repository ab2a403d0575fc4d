"""Messages between the engine and a verifier, and the DVR decision rule.

A lane pass is a list of segments (prompt chunks and verify windows) that a verifier runs
as one fixed-shape pass of ``rows`` rows; it answers one decision per segment. These types
are plain frozen dataclasses so any transport (in-process, gRPC) can carry them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from detserve.outputs import TokenLogprob
from detserve.sampler import SamplingSpec


@dataclass(frozen=True)
class LaneSegment:
    request_id: str
    kind: str                         # "prefill" | "window"
    start: int                        # absolute position of the first row
    input_ids: tuple[int, ...]        # tokens at positions start .. start+n-1
    block_table: tuple[int, ...]
    candidates: tuple[int, ...]       # window: fast-path tokens for positions start+1 ..
    sample_rows: tuple[int, ...]      # row offsets whose next token the lane samples
    spec: SamplingSpec
    # penalized specs only: the generated tokens before ``start`` (a sampled row's
    # penalties count them and the generated ones among this segment's inputs up to it)
    history: tuple[int, ...] = ()
    # prompt logprobs asked for (top alternatives): the prompt tokens this segment's first
    # rows predict; the lane answers their logprobs with its own bits
    prompt_logprobs: int | None = None
    prompt_targets: tuple[int, ...] = ()

    def output_history(self, row: int) -> list[int]:
        """The generated tokens before the position row ``row`` samples."""
        first = max(0, self.spec.prompt_len - self.start)  # the first generated input
        return [*self.history, *self.input_ids[first:row + 1]]

    def __post_init__(self) -> None:
        if self.kind not in ("prefill", "window"):
            raise ValueError(f"bad segment kind {self.kind!r}")
        if not self.input_ids:
            raise ValueError("empty segment")
        if self.kind == "window" and len(self.candidates) != len(self.input_ids) - 1:
            raise ValueError("a window holds the last committed token plus its candidates")


@dataclass(frozen=True)
class LanePass:
    pass_id: int
    rows: int
    segments: tuple[LaneSegment, ...]

    @property
    def used_rows(self) -> int:
        return sum(len(s.input_ids) for s in self.segments)

    @property
    def padding_rows(self) -> int:
        return self.rows - self.used_rows


@dataclass(frozen=True)
class LaneDecision:
    """Commit ``tokens`` (accepted candidates, then the lane's next token); for a prompt
    chunk that does not reach the end of the committed tokens, ``tokens`` is empty."""

    request_id: str
    kind: str
    start: int
    accepted: int
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob | None, ...]
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # of the segment's ``prompt_targets``


@dataclass(frozen=True)
class LaneResult:
    pass_id: int
    decisions: tuple[LaneDecision, ...]
    padding_rows: int
    elapsed_s: float


def decide(candidates: Sequence[int], lane_tokens: Sequence[int]) -> int:
    """Number of leading candidates equal to the lane's tokens for the same positions."""
    n = 0
    for c, t in zip(candidates, lane_tokens, strict=False):
        if c != t:
            break
        n += 1
    return n
