"""Helpers shared by engine tests: a tiny random model and a way to run request mixes."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from model_helpers import make_random_llama

from detserve.engine import LLMEngine
from detserve.llm import TokensPrompt
from detserve.outputs import RequestOutput
from detserve.params import SamplingParams
from detserve.sequence import PLACEHOLDER


def tiny_model(**kw: object) -> str:
    kw.setdefault("max_position_embeddings", 1024)
    kw.setdefault("num_layers", 3)
    return str(make_random_llama(**kw))  # type: ignore[arg-type]


@dataclass
class Req:
    prompt: list[int]
    params: SamplingParams
    arrival: int = 0


def run_engine(model: str, reqs: list[Req], mode: str = "llm42", *, window: int = 8,
               group: int = 4, perturbation: float = 0.0, seed: int = 0,
               **kw: object) -> tuple[list[RequestOutput], dict[str, float], LLMEngine]:
    """Run the requests with their arrival steps; check integrity every step."""
    kw.setdefault("max_model_len", 512)
    engine = LLMEngine.from_args(model, mode, verify_window=window, verify_group=group,
                                 fastpath_perturbation=perturbation, seed=seed, **kw)
    outs = drive(engine, reqs)
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1, "blocks leaked"
    return outs, engine.stats(), engine


def drive(engine: LLMEngine, reqs: list[Req],
          on_output: Callable[[int, RequestOutput], None] | None = None) -> list[RequestOutput]:
    """Add request i as ``r{i}`` at its arrival step, step to the end checking integrity
    every step, and return the final outputs in request order."""
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    done: dict[int, RequestOutput] = {}
    step = 0
    while order or engine.has_unfinished_requests():
        while order and reqs[order[0]].arrival <= step:
            i = order.pop(0)
            engine.add_request(f"r{i}", None, reqs[i].params, prompt_token_ids=reqs[i].prompt)
        for out in engine.step():
            assert out.num_new_tokens >= 0
            assert PLACEHOLDER not in out.token_ids, "a token released before it was read"
            i = int(out.request_id[1:])
            if on_output is not None:
                on_output(i, out)
            if out.finished:
                done[i] = out
        engine.check_integrity()
        step += 1
        assert step < 10_000, "engine made no progress"
    return [done[i] for i in range(len(reqs))]


def random_prompts(n: int, lengths: list[int], vocab: int = 512, seed: int = 0,
                   prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = [rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])]
        out.append((prefix or []) + body)
    return out


def as_tokens(prompts: list[list[int]]) -> list[TokensPrompt]:
    """Token-id prompts as ``LLM.generate`` takes them."""
    return [{"prompt_token_ids": p} for p in prompts]


def signature(out: RequestOutput) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Token ids and the bit patterns of their logprobs (floats compared exactly)."""
    lps = tuple(lp.logprob for lp in out.logprobs or [])
    return tuple(out.token_ids), lps
