"""Offline API in the style of vLLM's ``LLM``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import cast

from detserve.config import EngineConfig
from detserve.engine import LLMEngine
from detserve.outputs import RequestOutput
from detserve.params import SamplingParams


class LLM:
    """Run batches of requests through one engine.

    >>> llm = LLM(model="smollm2", mode="llm42")
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, is_deterministic=True))
    """

    def __init__(self, model: str, mode: str = "llm42", device: str = "cpu",
                 dtype: str = "float32", verify_window: int = 64, verify_group: int = 8,
                 fastpath_perturbation: float = 0.0, seed: int = 0, **engine_kw: object) -> None:
        config = EngineConfig.create(model, mode, device=device, dtype=dtype,
                                     verify_window=verify_window, verify_group=verify_group,
                                     fastpath_perturbation=fastpath_perturbation, seed=seed,
                                     **engine_kw)  # type: ignore[arg-type]
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[str] | None = None,
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 arrival_steps: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order.

        ``arrival_steps[i]`` delays request i until the engine has run that many steps of
        this call, so tests can vary batch composition. Bad input raises ValueError before
        any request is queued.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is None and prompt_token_ids is None:
            raise ValueError("give prompts or prompt_token_ids")
        items: list[tuple[str | None, list[int] | None]] = (
            [(p, None) for p in prompts] if prompts is not None
            else [(None, list(ids)) for ids in prompt_token_ids or []])
        n = len(items)
        if params is None:
            params = SamplingParams()
        plist = [params] * n if isinstance(params, SamplingParams) else list(params)
        if len(plist) != n:
            raise ValueError("need one SamplingParams per prompt")
        # only finished outputs are returned: skip building the ones in between
        plist = [replace(p, output_kind="final_only") if isinstance(p, SamplingParams) else p
                 for p in plist]
        arrivals = list(arrival_steps) if arrival_steps is not None else [0] * n
        if len(arrivals) != n or any(a < 0 for a in arrivals):
            raise ValueError("arrival_steps needs one non-negative step per prompt")
        for prompt, _ in items:
            if prompt is not None and (not isinstance(prompt, str) or not prompt):
                raise ValueError("prompts must be non-empty strings")
        rids = [f"llm-{next(self._ids)}" for _ in range(n)]
        pending = sorted(range(n), key=lambda i: arrivals[i])
        done: dict[str, RequestOutput] = {}
        step = 0
        try:
            while pending or self.engine.has_unfinished_requests():
                while pending and arrivals[pending[0]] <= step:
                    i = pending.pop(0)
                    self.engine.add_request(rids[i], items[i][0], plist[i],
                                            prompt_token_ids=items[i][1])
                if not self.engine.has_unfinished_requests():
                    step = arrivals[pending[0]]
                    continue
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                step += 1
        except BaseException:
            for rid in rids:
                if rid not in done:
                    self.engine.abort_request(rid)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        return [done[r] for r in rids]

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             **kw: object) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        convs = cast(list[list[dict]], [messages] if messages and isinstance(messages[0], dict)
                     else messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True)
                   for c in convs]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(None, params, prompt_token_ids=ids, **kw)  # type: ignore[arg-type]

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def determinism_profile(self) -> dict[str, object]:
        return self.engine.determinism_profile()
