"""A request as it enters the engine: validated prompt ids, the seed policy, its ``Sequence``.

Bad input raises ValueError with a message meant for the client, before any state changes.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection

from detserve.params import SamplingParams, SamplingSpec
from detserve.sequence import Sequence


def prompt_ids(request_id: str, prompt: str | None, params: SamplingParams,
               prompt_token_ids: list[int] | None, *, encode: Callable[[str], list[int]],
               vocab_size: int, max_model_len: int, live: Collection[str]) -> list[int]:
    """The request's prompt token ids, checked with its other inputs (``live``: the ids of
    the requests the engine holds)."""
    if not isinstance(params, SamplingParams):
        raise ValueError("params must be a SamplingParams")
    if not isinstance(request_id, str) or not request_id:
        raise ValueError("request_id must be a non-empty string")
    if request_id in live:
        raise ValueError(f"duplicate request_id {request_id!r}")
    if prompt_token_ids is None:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt must be a non-empty string")
        prompt_token_ids = encode(prompt)
    ids = list(prompt_token_ids)
    if not ids:
        raise ValueError("prompt is empty")
    vocab = vocab_size
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens; the context holds {max_model_len} "
                         "(prompt plus at least one generated token)")
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise ValueError("stop_token_ids out of vocabulary range")
    if any(t >= vocab for t in params.logit_bias or ()):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
    return ids


class SeedPolicy:
    """The sampling seed of a request that gives none: the engine's seed for a
    deterministic request (so its output is reproducible anywhere with the same profile),
    a fresh draw for others (so two of them do not sample alike)."""

    def __init__(self, engine_seed: int) -> None:
        self.engine_seed = engine_seed
        self._rng = random.Random(engine_seed ^ 0x5EED)

    def seed(self, params: SamplingParams, deterministic: bool) -> int:
        if params.seed is not None:
            return params.seed
        return self.engine_seed if deterministic else self._rng.getrandbits(63)


def new_sequence(request_id: str, ids: list[int], params: SamplingParams, *, mode: str,
                 arrival: int, seeds: SeedPolicy,
                 stop_ids: Callable[[Sequence], frozenset[int]]) -> Sequence:
    """The request's ``Sequence`` in engine ``mode``, with its sampling spec."""
    uses_lane = mode == "lane_only" or (mode == "llm42" and params.is_deterministic)
    deterministic = uses_lane or mode == "batch_invariant"
    seq = Sequence(request_id, ids, params, uses_lane=uses_lane,
                   deterministic=deterministic, arrival=arrival)
    seq.stats.arrival_time = time.monotonic()
    seq.spec = SamplingSpec(
        temperature=float(params.temperature), top_p=float(params.top_p), top_k=params.top_k,
        seed=seeds.seed(params, deterministic), logprobs=params.logprobs,
        min_tokens=params.min_tokens, prompt_len=len(ids),
        stop_ids=tuple(sorted(stop_ids(seq))), logit_bias=params.logit_bias_pairs,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty)
    return seq
