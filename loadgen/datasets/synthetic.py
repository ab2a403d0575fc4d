"""Synthetic traces: random prompts of set lengths, and prompts sharing prefixes.

As in vLLM's random dataset, prompts are random token ids (special tokens excluded)
decoded to text; the ids are re-encoded once and cut to the wanted length, and kept in the
trace (``prompt_token_ids``) so targets that take ids see exactly that many tokens. Random
requests set ``ignore_eos`` so the output length is exactly ``output_len``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadgen.tokenizer import ByteTokenizer, Tokenizer
from loadgen.trace import TraceRequest


@dataclass(frozen=True)
class LengthRange:
    """``length`` +/- ``range_ratio`` x length, uniform (vLLM's --random-range-ratio)."""

    length: int
    range_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.length < 1 or not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"bad length range {self}")

    def sample(self, rng: random.Random) -> int:
        lo = max(1, int(self.length * (1 - self.range_ratio)))
        hi = max(lo, int(self.length * (1 + self.range_ratio)))
        return rng.randint(lo, hi)


def random_token_ids(tokenizer: Tokenizer, n: int, rng: random.Random) -> list[int]:
    """``n`` token ids whose decoded text re-encodes to (at least) the same length."""
    if n <= 0:
        return []
    lo, hi = _sampleable_range(tokenizer)
    special = tokenizer.special_ids()
    ids: list[int] = []
    while len(ids) < n:
        draw = [rng.randrange(lo, hi) for _ in range(n - len(ids) + 8)]
        ids = tokenizer.encode(tokenizer.decode(ids + [t for t in draw if t not in special]))
    return ids[:n]


def _sampleable_range(tokenizer: Tokenizer) -> tuple[int, int]:
    if isinstance(tokenizer, ByteTokenizer):
        return 32, 127          # printable ASCII: raw bytes would not survive decoding
    return 0, tokenizer.vocab_size


def sample_random(
    tokenizer: Tokenizer,
    num_requests: int,
    *,
    input_len: LengthRange,
    output_len: LengthRange,
    prefix_len: int = 0,
    seed: int = 0,
) -> tuple[list[TraceRequest], dict[str, object]]:
    """Random prompts; the first ``prefix_len`` tokens are shared by all requests."""
    rng = random.Random(seed)
    prefix = random_token_ids(tokenizer, prefix_len, rng)
    out = []
    for i in range(num_requests):
        ids = prefix + random_token_ids(tokenizer, input_len.sample(rng), rng)
        out.append(_request(f"random-{i}", tokenizer, ids, output_len.sample(rng)))
    return out, {"prefix_len": len(prefix)}


def sample_shared_prefix(
    tokenizer: Tokenizer,
    *,
    num_prefixes: int,
    requests_per_prefix: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int = 0,
) -> tuple[list[TraceRequest], dict[str, object]]:
    """``num_prefixes`` groups of requests; members of a group share a ``prefix_len``
    prefix and differ in a random ``suffix_len`` suffix. Order is shuffled."""
    rng = random.Random(seed)
    out = []
    for p in range(num_prefixes):
        prefix = random_token_ids(tokenizer, prefix_len, rng)
        for j in range(requests_per_prefix):
            ids = prefix + random_token_ids(tokenizer, suffix_len, rng)
            req = _request(f"prefix{p}-{j}", tokenizer, ids, output_len)
            out.append(req.with_(tags={"prefix": p, "prefix_len": prefix_len}))
    rng.shuffle(out)
    return out, {"num_prefixes": num_prefixes}


def _request(rid: str, tokenizer: Tokenizer, ids: list[int], output_len: int) -> TraceRequest:
    return TraceRequest(id=rid, prompt=tokenizer.decode(ids), prompt_len=len(ids),
                        output_len=output_len, ignore_eos=True, prompt_token_ids=tuple(ids))
