"""A benchmark trace: the requests of one run, savable as JSONL so a run replays exactly.

File format (one JSON object per line):
  line 1: {"type": "header", "format": "detserve-trace", "version": 1, "meta": {...}}
  then:   {"type": "request", "id": ..., "prompt": ..., "prompt_len": ..., ...}
The header's ``meta`` records how the trace was built (dataset, tokenizer, seeds, traffic),
so a trace file is self-describing. Arrival times are part of each request: replaying a
saved trace sends the same prompts, flags and seeds at the same offsets.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

TRACE_FORMAT = "detserve-trace"
TRACE_VERSION = 1


@dataclass(frozen=True)
class TraceRequest:
    """One request to send. ``output_len`` becomes max_tokens; ``prompt_len`` is counted
    with the trace's tokenizer. ``prompt_token_ids``, when present, lets targets that take
    token ids (the in-process engine) reproduce the exact prompt."""

    id: str
    prompt: str
    prompt_len: int
    output_len: int
    arrival_s: float = 0.0
    is_deterministic: bool = False
    seed: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    tags: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.output_len < 1:
            raise ValueError(f"request {self.id}: output_len must be >= 1")
        if self.prompt_len < 0 or self.arrival_s < 0:
            raise ValueError(f"request {self.id}: negative prompt_len or arrival")
        if self.prompt_token_ids is not None:
            object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))

    def with_(self, **changes: Any) -> TraceRequest:
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if self.prompt_token_ids is not None:
            d["prompt_token_ids"] = list(self.prompt_token_ids)
        return {"type": "request", **{k: v for k, v in d.items() if v not in (None, {})}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TraceRequest:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        if kwargs.get("prompt_token_ids") is not None:
            kwargs["prompt_token_ids"] = tuple(kwargs["prompt_token_ids"])
        return cls(**kwargs)


@dataclass(frozen=True)
class Trace:
    requests: tuple[TraceRequest, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", tuple(self.requests))
        ids = [r.id for r in self.requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids in a trace must be unique")

    def __len__(self) -> int:
        return len(self.requests)

    def with_requests(self, requests: Iterable[TraceRequest], **meta: Any) -> Trace:
        return Trace(tuple(requests), {**self.meta, **meta})

    def summary(self) -> dict[str, Any]:
        from loadgen.stats import mean, median, std

        ins = [r.prompt_len for r in self.requests]
        outs = [r.output_len for r in self.requests]
        return {
            "num_requests": len(self.requests),
            "input": {"mean": mean(ins), "median": median(ins), "std": std(ins)},
            "output": {"mean": mean(outs), "median": median(outs), "std": std(outs)},
            "deterministic": sum(r.is_deterministic for r in self.requests),
            "duration_s": max((r.arrival_s for r in self.requests), default=0.0),
        }


def save_trace(trace: Trace, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"type": "header", "format": TRACE_FORMAT, "version": TRACE_VERSION,
              "meta": trace.meta}
    with path.open("w", encoding="utf-8") as f:
        f.write(json.dumps(header, ensure_ascii=False) + "\n")
        for r in trace.requests:
            f.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")
    return path


def load_trace(path: str | Path) -> Trace:
    meta: dict[str, Any] = {}
    requests: list[TraceRequest] = []
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            kind = d.get("type", "request")
            if kind == "header":
                if d.get("format") != TRACE_FORMAT or d.get("version") != TRACE_VERSION:
                    raise ValueError(f"{path}: not a {TRACE_FORMAT} v{TRACE_VERSION} file")
                meta = d.get("meta", {})
            elif kind == "request":
                requests.append(TraceRequest.from_json(d))
            else:
                raise ValueError(f"{path}:{lineno}: unknown line type {kind!r}")
    return Trace(tuple(requests), meta)


def sorted_by_arrival(requests: Sequence[TraceRequest]) -> list[TraceRequest]:
    return sorted(requests, key=lambda r: (r.arrival_s, r.id))
