"""Typed messages between the router and a decoder replica. On the link they travel as
protobuf (``services.decoder.link_codec``); Ray handle calls carry only ``ReplicaPin`` and
``ReplicaStats``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from detserve.outputs import TokenLogprob
from detserve.params import SamplingParams
from services.affinity import affinity_keys


@dataclass(frozen=True)
class DecodeRequest:
    """One sequence to generate. The router has tokenized and validated it already;
    the engine validates again (vocab range, context length) and answers with an error
    chunk when it disagrees."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    # when the router's handler got the client's request and when the router sent it to a
    # decoder (machine-wide monotonic seconds; 0: unknown): with the decoder's own times
    # they split a served request's time to first token
    accepted: float = 0.0
    dispatched: float = 0.0
    # replicas a deterministic replay should not go to: they failed this request (a replica
    # whose engine failed answers at once, so the least-loaded choice would pick it again)
    avoid: tuple[str, ...] = ()

    @property
    def is_deterministic(self) -> bool:
        return self.params.is_deterministic

    @property
    def cost_tokens(self) -> int:
        """Upper bound on the tokens this request adds to a decoder: prompt + output."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    @cached_property
    def affinity(self) -> tuple[int, ...]:
        """What the router routes this request by (``services.affinity.affinity_keys``), hashed
        once per request object: ranking the replicas and recording the route both read it."""
        return tuple(affinity_keys(self.prompt_token_ids, self.is_deterministic))


@dataclass(frozen=True)
class DecodeChunk:
    """Committed progress of one request since the previous chunk.

    ``text`` is the text added by this chunk: text is held back while it could still
    change (an incomplete UTF-8 character, a possible stop-string prefix), so the
    concatenation of all ``text`` fields is exactly the final text. ``error`` ends the
    stream: ``error_type`` is "invalid_request" (the engine refused the request),
    "verifier_unavailable" (a deterministic request whose verification cannot continue)
    or "server_error" (the engine failed or is shutting down).
    """

    request_id: str
    replica: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    determinism: Mapping[str, object] | None = None
    error: str | None = None
    error_type: str | None = None
    engine_stats: Mapping[str, float] = field(default_factory=dict)
    # the request's first chunk, when it asked for them: one per prompt token (None first)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    @property
    def is_error(self) -> bool:
        return self.error is not None


def coalesce(chunks: Sequence[DecodeChunk]) -> list[DecodeChunk]:
    """Merge consecutive chunks of one request into one (what a slow reader would have
    seen had the engine stepped less often): text, token ids and logprobs concatenated,
    the rest from the latest. An error chunk is kept apart so the progress before it is
    delivered first."""
    out: list[DecodeChunk] = []
    for chunk in chunks:
        prev = out[-1] if out else None
        if prev is None or prev.finished or chunk.is_error:
            out.append(chunk)
            continue
        logprobs = (None if prev.logprobs is None and chunk.logprobs is None
                    else (prev.logprobs or ()) + (chunk.logprobs or ()))
        out[-1] = replace(chunk, text=prev.text + chunk.text,
                          token_ids=prev.token_ids + chunk.token_ids, logprobs=logprobs,
                          engine_stats=chunk.engine_stats or prev.engine_stats,
                          prompt_logprobs=prev.prompt_logprobs or chunk.prompt_logprobs)
    return out


@dataclass(frozen=True)
class ReplicaPin:
    """First argument of a call that must reach decoder replica ``replica`` (the request
    router sends it there or nowhere), e.g. ``stats(ReplicaPin(r))``."""

    replica: str


def coalesce_by_request(chunks: Sequence[DecodeChunk]) -> list[DecodeChunk]:
    """``coalesce`` for a link's backlog, which interleaves requests: each request's
    chunks merged in their order, requests in the order they first appear."""
    by_request: dict[str, list[DecodeChunk]] = {}
    for chunk in chunks:
        by_request.setdefault(chunk.request_id, []).append(chunk)
    return [c for group in by_request.values() for c in coalesce(group)]


@dataclass(frozen=True)
class ReplicaStats:
    """What a decoder reports about itself: engine counters plus its own load."""

    replica: str
    engine: Mapping[str, float]
    outstanding_tokens: int
    num_streams: int
    healthy: bool
    verifier: str = ""        # how lane passes are verified: "RemoteVerifier", "InProcessVerifier"
    link_requests: int = 0    # requests received over its link (services.decoder.link)
    # deterministic requests would be verified now: a verifier stream is open or one can
    # be found (always, for an in-process verifier)
    verifier_ready: bool = True
