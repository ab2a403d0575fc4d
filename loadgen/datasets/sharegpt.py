"""ShareGPT conversations as a benchmark trace, sampled the way vLLM's benchmark does.

Input format (ShareGPT V3): a JSON array of ``{"id", "conversations": [{"from", "value"}]}``.
The prompt is the first human turn, the output length is the token length of the next
assistant turn. Pairs are shuffled with the seed, then kept while they pass the filter
(vLLM's defaults: both lengths >= 4, prompt <= 1024, prompt + output <= 2048).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loadgen.datasets.json_records import ReadReport, iter_json_array
from loadgen.tokenizer import Tokenizer
from loadgen.trace import TraceRequest

HUMAN_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "chatgpt", "assistant", "bard", "bing"})
_BATCH = 256


@dataclass(frozen=True)
class LengthFilter:
    min_len: int = 4
    max_prompt_len: int = 1024
    max_total_len: int = 2048

    def accepts(self, prompt_len: int, output_len: int) -> bool:
        return (prompt_len >= self.min_len and output_len >= self.min_len
                and prompt_len <= self.max_prompt_len
                and prompt_len + output_len <= self.max_total_len)


@dataclass(frozen=True)
class ChatPair:
    id: str
    prompt: str
    completion: str


def read_sharegpt(path: str | Path, report: ReadReport | None = None) -> Iterator[ChatPair]:
    """First (human, following assistant) pair of every complete conversation.

    ``report`` counts the JSON records read and says whether the file was cut off."""
    for i, rec in enumerate(iter_json_array(path, report)):
        pair = first_pair(rec, default_id=f"sharegpt-{i}")
        if pair is not None:
            yield pair


def first_pair(rec: object, default_id: str) -> ChatPair | None:
    if not isinstance(rec, dict):
        return None
    turns = rec.get("conversations")
    if not isinstance(turns, list):
        return None
    prompt: str | None = None
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            continue
        role = str(turn.get("from", "")).lower()
        if prompt is None and role in HUMAN_ROLES:
            prompt = turn["value"]
        elif prompt is not None and role in ASSISTANT_ROLES:
            return ChatPair(str(rec.get("id", default_id)), prompt, turn["value"])
    return None


def sample_sharegpt(
    path: str | Path,
    tokenizer: Tokenizer,
    num_requests: int,
    *,
    seed: int = 0,
    length_filter: LengthFilter | None = None,
    fixed_output_len: int | None = None,
) -> tuple[list[TraceRequest], dict[str, object]]:
    """Up to ``num_requests`` filtered requests, plus an info dict (records read, whether
    the file was truncated, how many pairs were tried and rejected)."""
    flt = length_filter or LengthFilter()
    report = ReadReport()
    pairs = list(read_sharegpt(path, report))
    random.Random(seed).shuffle(pairs)
    out: list[TraceRequest] = []
    tried = 0
    for start in range(0, len(pairs), _BATCH):
        if len(out) >= num_requests:
            break
        batch = pairs[start:start + _BATCH]
        prompt_ids = tokenizer.encode_batch([p.prompt for p in batch])
        if fixed_output_len is None:
            out_lens = [len(ids) for ids in tokenizer.encode_batch([p.completion for p in batch])]
        else:
            out_lens = [fixed_output_len] * len(batch)
        for pair, ids, out_len in zip(batch, prompt_ids, out_lens, strict=True):
            if len(out) >= num_requests:
                break
            tried += 1
            if not flt.accepts(len(ids), out_len):
                continue
            out.append(TraceRequest(id=f"sharegpt-{len(out)}", prompt=pair.prompt,
                                    prompt_len=len(ids), output_len=out_len,
                                    tags={"source_id": pair.id}))
    info: dict[str, object] = {
        "records": report.records, "truncated": report.truncated,
        "read_report": report.describe(path), "pairs": len(pairs),
        "tried": tried, "rejected": tried - len(out),
    }
    return out, info
