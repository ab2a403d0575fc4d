"""Incremental detokenization: streamed text is always a prefix of the full decode, and a
finished request's text is exactly one decode of its whole output."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from detserve.config import EngineConfig
from detserve.engine import LLMEngine
from detserve.model.loader import load_model
from detserve.output_processor import OutputProcessor
from detserve.params import SamplingParams
from detserve.sequence import Sequence, Status


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    loaded = load_model("smollm2")
    return LLMEngine(EngineConfig.create("smollm2", "nondeterministic", max_model_len=256),
                     loaded=loaded)


def _seq() -> Sequence:
    return Sequence("x", [1, 2], SamplingParams(max_tokens=10), False, False, 0)


def test_real_text_streams_exactly(engine: LLMEngine) -> None:
    text = "Héllo wörld — naïve café 🙂🚀 日本語のテキスト, and\n  indented code: x = {'a': 1}."
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    seq = _seq()
    text_of = OutputProcessor(engine.tokenizer).text
    shown = []
    for t in ids:
        seq.token_ids.append(t)
        seq.num_committed += 1
        inc = text_of(seq)
        full = engine.tokenizer.decode(seq.committed_output, skip_special_tokens=True)
        assert full.startswith(inc)
        if not full.endswith("\ufffd"):
            assert inc == full  # nothing held back once the bytes are complete
        shown.append(inc)
    assert shown[-1] == text
    assert all(b.startswith(a) for a, b in pairwise(shown))  # deltas never rewrite


def test_random_tokens_prefix_consistent_and_final_exact(engine: LLMEngine) -> None:
    rng = random.Random(0)
    vocab = engine.model.config.vocab_size
    for _ in range(50):
        seq = _seq()
        text_of = OutputProcessor(engine.tokenizer).text  # (its state is per request id)
        for _ in range(40):
            seq.token_ids.append(rng.randrange(vocab) if rng.random() < 0.5 else rng.randrange(300))
            seq.num_committed = min(len(seq.token_ids), seq.num_committed + rng.choice([0, 1, 2]))
            full = engine.tokenizer.decode(seq.committed_output, skip_special_tokens=True)
            assert full.startswith(text_of(seq))
        del seq.token_ids[seq.num_committed - 3:]  # a stop cut shortens the output
        seq.num_committed = len(seq.token_ids)
        assert engine.tokenizer.decode(seq.committed_output, skip_special_tokens=True
                                       ).startswith(text_of(seq))
        seq.finish_reason, seq.status = "stop", Status.FINISHED
        assert text_of(seq) == engine.tokenizer.decode(seq.committed_output,
                                                                skip_special_tokens=True)
