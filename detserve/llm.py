"""Offline API in the style of vLLM's ``LLM``."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TypedDict, cast

from detserve.config import EngineConfig
from detserve.engine import LLMEngine
from detserve.outputs import RequestOutput
from detserve.params import SamplingParams


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


# a prompt: its text (tokenized with the model's tokenizer, special tokens added) or its
# token ids as they are, as vLLM takes them
PromptType = str | TextPrompt | TokensPrompt


class LLM:
    """Run batches of requests through one engine.

    ``dtype="auto"`` and ``max_model_len=None`` are taken from the model (see
    ``EngineConfig.create``); other keywords are engine options (``EngineConfig``,
    ``SchedulerConfig``), e.g. ``tensor_parallel_size=2`` (worker processes: call
    ``close()`` when done; docs/tensor-parallel.md).

    >>> llm = LLM("smollm2", mode="llm42")
    >>> out = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}],
    ...                    SamplingParams(max_tokens=8, is_deterministic=True))
    """

    def __init__(self, model: str, mode: str = "llm42", *, device: str = "cpu",
                 dtype: str = "auto", max_model_len: int | None = None,
                 **engine_kw: object) -> None:
        config = EngineConfig.create(model, mode, device=device, dtype=dtype,
                                     max_model_len=max_model_len,
                                     **engine_kw)  # type: ignore[arg-type]
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt (strings and token-id dicts may be mixed); outputs in
        prompt order. Bad input raises ValueError and leaves no request queued."""
        items = [_prompt_item(p, i) for i, p in enumerate(
            [prompts] if isinstance(prompts, str | Mapping) else prompts)]
        n = len(items)
        if params is None:
            params = SamplingParams()
        plist = [params] * n if isinstance(params, SamplingParams) else list(params)
        if len(plist) != n:
            raise ValueError(f"need one SamplingParams per prompt ({n}), got {len(plist)}")
        # only finished outputs are returned: skip building the ones in between
        plist = [replace(p, output_kind="final_only") if isinstance(p, SamplingParams) else p
                 for p in plist]
        rids = [f"llm-{next(self._ids)}" for _ in range(n)]
        done: dict[str, RequestOutput] = {}
        try:
            for rid, (text, ids), p in zip(rids, items, plist, strict=True):
                self.engine.add_request(rid, text, p, prompt_token_ids=ids)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
        except BaseException:
            for rid in rids:
                if rid not in done:
                    self.engine.abort_request(rid)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        return [done[r] for r in rids]

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None
             ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        convs = cast(list[list[dict]], [messages] if messages and isinstance(messages[0], dict)
                     else messages)
        prompts: list[PromptType] = [
            {"prompt_token_ids": self.tokenizer.encode(
                self.tokenizer.apply_chat_template(c, add_generation_prompt=True),
                add_special_tokens=False)}
            for c in convs]
        return self.generate(prompts, params)

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def close(self) -> None:
        """Stop the engine's verifier and its tensor-parallel workers, if any."""
        self.engine.close()

    def determinism_profile(self) -> dict[str, object]:
        return self.engine.determinism_profile()


def _prompt_item(prompt: object, index: int) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids) for one prompt; ValueError naming the item."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"prompt {index}: prompts must be non-empty strings")
        return prompt, None
    if isinstance(prompt, Mapping):
        keys = set(prompt)
        if keys == {"prompt"}:
            if not isinstance(prompt["prompt"], str):
                raise ValueError(f"prompt {index}: 'prompt' must be a string")
            return _prompt_item(prompt["prompt"], index)
        if keys == {"prompt_token_ids"}:
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, str | bytes | Mapping) or not isinstance(ids, Sequence) \
                    or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ValueError(f"prompt {index}: prompt_token_ids must be a list of "
                                 f"integer token ids, got {ids!r:.80}")
            return None, list(ids)
        raise ValueError(f"prompt {index}: a dict prompt is {{'prompt_token_ids': [...]}} "
                         f"or {{'prompt': '...'}}; got keys {sorted(map(str, keys))}")
    raise ValueError(f"prompt {index}: expected a string or a dict with 'prompt_token_ids', "
                     f"got {type(prompt).__name__}")
