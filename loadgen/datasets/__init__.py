"""Datasets that become traces. ``build_requests(spec, tokenizer)`` is the one entry point."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from loadgen.datasets.arxiv import (
    ARXIV_INPUT,
    ARXIV_OUTPUT,
    LengthDist,
    read_sotu,
    sample_arxiv,
    sample_arxiv_like,
)
from loadgen.datasets.sharegpt import LengthFilter, sample_sharegpt
from loadgen.datasets.synthetic import LengthRange, sample_random, sample_shared_prefix
from loadgen.tokenizer import Tokenizer
from loadgen.trace import TraceRequest

DATASETS = ("sharegpt", "arxiv", "arxiv-like", "random", "shared-prefix")


@dataclass(frozen=True)
class DatasetSpec:
    """Which requests to make. Fields not used by a dataset are ignored by it.

    ``path`` may be None for sharegpt and arxiv-like: the real data is then fetched into
    the cache (see loadgen.fetch). ``max_input_len`` caps arxiv/arxiv-like prompts so
    a small model's context fits; None keeps the paper's distribution."""

    name: str = "random"
    num_requests: int = 100
    seed: int = 0
    path: str | None = None
    # sharegpt
    min_len: int = 4
    max_prompt_len: int = 1024
    max_total_len: int = 2048
    fixed_output_len: int | None = None
    # random / shared-prefix
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_prefixes: int = 4
    suffix_len: int = 64
    # arxiv / arxiv-like
    max_input_len: int | None = None
    max_output_len: int | None = None

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset {self.name!r}; choose from {DATASETS}")
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def build_requests(spec: DatasetSpec, tokenizer: Tokenizer) -> tuple[list[TraceRequest], dict]:
    """The requests (arrival 0, not deterministic) and an info dict for the trace header."""
    n, seed = spec.num_requests, spec.seed
    if spec.name == "sharegpt":
        flt = LengthFilter(spec.min_len, spec.max_prompt_len, spec.max_total_len)
        return sample_sharegpt(_path(spec, "sharegpt"), tokenizer, n, seed=seed,
                               length_filter=flt, fixed_output_len=spec.fixed_output_len)
    if spec.name == "arxiv":
        if spec.path is None:
            raise ValueError("the arxiv dataset needs --dataset-path (JSON lines)")
        return sample_arxiv(spec.path, tokenizer, n, seed=seed,
                            max_input_len=spec.max_input_len)
    if spec.name == "arxiv-like":
        docs = read_sotu(_path(spec, "sotu"))
        in_dist = ARXIV_INPUT
        out_dist = ARXIV_OUTPUT
        if spec.max_input_len is not None:
            in_dist = _capped(in_dist, spec.max_input_len)
        if spec.max_output_len is not None:
            out_dist = _capped(out_dist, spec.max_output_len)
        return sample_arxiv_like(docs, tokenizer, n, seed=seed,
                                 input_dist=in_dist, output_dist=out_dist)
    if spec.name == "random":
        return sample_random(tokenizer, n, seed=seed, prefix_len=spec.prefix_len,
                             input_len=LengthRange(spec.input_len, spec.range_ratio),
                             output_len=LengthRange(spec.output_len, spec.range_ratio))
    per_prefix = max(1, n // spec.num_prefixes)
    return sample_shared_prefix(tokenizer, num_prefixes=spec.num_prefixes,
                                requests_per_prefix=per_prefix, prefix_len=spec.prefix_len,
                                suffix_len=spec.suffix_len, output_len=spec.output_len,
                                seed=seed)


def _capped(dist: LengthDist, hi: int) -> LengthDist:
    return replace(dist, lo=min(dist.lo, hi), hi=hi)


def _path(spec: DatasetSpec, package: str) -> Path:
    if spec.path is not None:
        return Path(spec.path)
    from loadgen.fetch import fetch

    return fetch(package)
