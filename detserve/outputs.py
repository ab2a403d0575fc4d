"""What the engine returns for a request (vLLM-style)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Log-probability of the chosen token and the top-k alternatives at one position."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class RequestStats:
    verify_passes: int = 0        # lane passes that carried this request's rows
    windows: int = 0              # verify windows submitted
    rollbacks: int = 0            # windows with at least one rejected candidate
    tokens_rolled_back: int = 0   # candidates rejected (recomputed later)
    fast_tokens: int = 0          # tokens produced on the fast path (candidates or final)
    lane_rows: int = 0            # lane rows this request used (prefill + windows)
    preemptions: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass(frozen=True)
class Delta:
    """What an output adds to the ones before it on one stream: text that can no longer
    change, the new token ids, their logprobs (None: not asked for)."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None

    def then(self, later: Delta) -> Delta:
        """This delta followed by ``later`` (one chunk for outputs held back together)."""
        lps = (None if self.logprobs is None and later.logprobs is None
               else (*(self.logprobs or ()), *(later.logprobs or ())))
        return Delta(self.text + later.text, self.token_ids + later.token_ids, lps)


@dataclass
class RequestOutput:
    """Committed state of one request. Only committed tokens ever appear here."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None          # "stop" | "length" | "abort" | "error" | None
    logprobs: list[TokenLogprob] | None
    is_deterministic: bool
    num_new_tokens: int = 0            # committed in the step that produced this output
    stats: RequestStats = field(default_factory=RequestStats)
    # ``prompt_logprobs`` asked for: one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # what this output adds to the request's previous one (``output_processor``)
    delta: Delta = field(default_factory=Delta, compare=False)

    @property
    def new_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_new_tokens:]
