"""OpenAI response bodies and SSE chunks for completions and chat completions.

Each choice also carries ``token_ids`` (vLLM's extension); deterministic responses carry
``determinism`` (the decoders' profile) and its fingerprint as ``system_fingerprint``:
two responses are comparable bit for bit exactly when their fingerprints are equal.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from detserve.outputs import TokenLogprob
from services.router.dispatch import ChoiceEvent
from services.router.model_context import ModelContext
from services.router.prepare import Job

DONE = b"data: [DONE]\n\n"


@dataclass
class ChoiceResult:
    """A choice's whole output, accumulated from its events."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    determinism: Mapping[str, object] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    def add(self, event: ChoiceEvent) -> None:
        if self.prompt_logprobs is None:
            self.prompt_logprobs = event.prompt_logprobs
        self.text += event.text
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs or ())
        self.finish_reason = event.finish_reason or self.finish_reason
        self.completion_tokens = len(self.token_ids)
        self.determinism = event.determinism or self.determinism


class Formatter:
    """Builds the JSON of one job's responses."""

    def __init__(self, job: Job, ctx: ModelContext) -> None:
        self.job = job
        self.ctx = ctx
        self.created = int(time.time())
        self.chat = job.kind == "chat"
        self._object = "chat.completion" if self.chat else "text_completion"
        self._role_sent: set[int] = set()
        self._echoed: set[int] = set()  # streamed choices whose prompt went out

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.job.id, "object": obj, "created": self.created,
                "model": self.job.model, "system_fingerprint": None, "choices": choices}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = self.job.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}

    # ---- whole responses ------------------------------------------------------------
    def response(self, results: list[ChoiceResult]) -> dict[str, Any]:
        choices = [self._choice(i, r) for i, r in enumerate(results)]
        body = self._envelope(self._object, choices)
        body["usage"] = self.usage(sum(r.completion_tokens for r in results))
        _add_determinism(body, next((r.determinism for r in results if r.determinism), None))
        return body

    def _choice(self, index: int, r: ChoiceResult) -> dict[str, Any]:
        echo = bool(self.job.echo)
        out: dict[str, Any] = {"index": index, "finish_reason": r.finish_reason,
                               "token_ids": r.token_ids,
                               "logprobs": self._logprobs(r.token_ids, r.logprobs,
                                                          self._prompt(index, r.prompt_logprobs)
                                                          if echo else None)}
        if self.chat:
            out["message"] = {"role": "assistant", "content": r.text}
        else:
            out["text"] = (self.job.echo[index] if echo else "") + r.text
        return out

    def _prompt(self, index: int, lps: tuple[TokenLogprob | None, ...] | None
                ) -> list[tuple[int, TokenLogprob | None]]:
        """Choice ``index``'s prompt tokens, each with its logprob (None: the first, or
        none asked for)."""
        ids = self.job.choices[index].prompt_token_ids
        return list(zip(ids, lps if lps is not None else [None] * len(ids), strict=True))

    # ---- streaming ------------------------------------------------------------------
    def chunk(self, event: ChoiceEvent) -> bytes:
        echo = bool(self.job.echo) and event.index not in self._echoed  # once a choice
        if echo:
            self._echoed.add(event.index)
        prompt = self._prompt(event.index, event.prompt_logprobs) if echo else None
        choice: dict[str, Any] = {"index": event.index, "finish_reason": event.finish_reason,
                                  "token_ids": list(event.token_ids),
                                  "logprobs": self._logprobs(event.token_ids, event.logprobs,
                                                             prompt)}
        if self.chat:
            delta: dict[str, Any] = {"content": event.text}
            if event.index not in self._role_sent:
                self._role_sent.add(event.index)
                delta["role"] = "assistant"
            choice["delta"] = delta
        else:
            choice["text"] = (self.job.echo[event.index] if echo else "") + event.text
        body = self._envelope(self._object + (".chunk" if self.chat else ""), [choice])
        if self.job.include_usage:
            body["usage"] = None
        _add_determinism(body, event.determinism)
        return sse(body)

    def usage_chunk(self, completion_tokens: int) -> bytes:
        body = self._envelope(self._object + (".chunk" if self.chat else ""), [])
        body["usage"] = self.usage(completion_tokens)
        return sse(body)

    # ---- logprobs -------------------------------------------------------------------
    def _logprobs(self, ids: Any, lps: Any,
                  prompt: list[tuple[int, TokenLogprob | None]] | None = None
                  ) -> dict[str, Any] | None:
        """OpenAI's logprobs object of these tokens; ``prompt`` (echo): the prompt's tokens
        and their logprobs first, the first one's None."""
        if self.job.top_logprobs is None or lps is None:
            return None
        if self.chat:
            return {"content": [self._chat_logprob(lp) for lp in lps]}
        entries: list[tuple[int, TokenLogprob | None]] = [
            *(prompt or []), *((lp.token_id, lp) for lp in lps)]
        tokens = [self.ctx.token_text(t) for t, _ in entries]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        tops = [None if lp is None else {self.ctx.token_text(t): v for t, v in lp.top.items()}
                for _, lp in entries]
        return {"tokens": tokens,
                "token_logprobs": [None if lp is None else lp.logprob for _, lp in entries],
                "top_logprobs": tops if self.job.top_logprobs else None, "text_offset": offsets}

    def _chat_logprob(self, lp: TokenLogprob) -> dict[str, Any]:
        entry = _token_entry(self.ctx.token_text(lp.token_id), lp.logprob)
        entry["top_logprobs"] = [_token_entry(self.ctx.token_text(t), v)
                                 for t, v in lp.top.items()]
        return entry


def _token_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _add_determinism(body: dict[str, Any], profile: Mapping[str, object] | None) -> None:
    if profile:
        body["determinism"] = dict(profile)
        body["system_fingerprint"] = profile.get("fingerprint")


def sse(body: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
