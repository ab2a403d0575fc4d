"""A toy engine with the ``LLMEngine`` contract, for loadgen's own plumbing tests.

It is not a model: token i of a request is a letter hashed from (prompt, i). With
``nondeterministic=True`` tokens from position ``flip_at`` on also depend on the batch
size of the step that made them, imitating shape-dependent reductions; with
``logprob_noise=True`` only the reported logprobs depend on the batch size. Deterministic
requests commit ``window`` tokens at a time, like verified windows. Nothing here stands in
for the real engine in determinism claims: those tests run ``detserve.engine``.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from detserve.outputs import RequestOutput, TokenLogprob
from loadgen.tokenizer import ByteTokenizer


@dataclass
class _Req:
    rid: str
    prompt_ids: list[int]
    params: Any
    out: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    pending: int = 0          # tokens made but not yet committed (deterministic windows)


class FakeEngine:
    def __init__(self, *, nondeterministic: bool = False, logprob_noise: bool = False,
                 flip_at: int = 2, window: int = 4, max_batch: int = 64,
                 step_time_s: float = 0.0) -> None:
        self.tokenizer = ByteTokenizer()
        self.nondeterministic = nondeterministic
        self.logprob_noise = logprob_noise
        self.flip_at = flip_at
        self.window = window
        self.max_batch = max_batch
        self.step_time_s = step_time_s
        self._reqs: dict[str, _Req] = {}
        self._stats = {"committed_tokens": 0, "fast_tokens": 0, "windows": 0,
                       "verify_passes": 0, "rollbacks": 0, "recomputed_tokens": 0,
                       "tokens_rolled_back": 0, "lane_padding_rows": 0}

    def add_request(self, request_id: str, prompt: str | None, params: Any,
                    prompt_token_ids: list[int] | None = None) -> None:
        if request_id in self._reqs:
            raise ValueError(f"duplicate request id {request_id}")
        ids = list(prompt_token_ids) if prompt_token_ids is not None else (
            self.tokenizer.encode(prompt) if prompt else [])
        if not ids:
            raise ValueError("empty prompt")
        self._reqs[request_id] = _Req(request_id, ids, params)

    def has_unfinished_requests(self) -> bool:
        return bool(self._reqs)

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    def step(self) -> list[RequestOutput]:
        if self.step_time_s:
            time.sleep(self.step_time_s)
        batch = list(self._reqs.values())[: self.max_batch]
        outs = []
        for r in batch:
            tok, lp = self._next(r, len(batch))
            r.out.append(tok)
            r.logprobs.append(TokenLogprob(tok, lp))
            self._stats["fast_tokens"] += 1
            done = len(r.out) >= r.params.max_tokens
            det = r.params.is_deterministic
            r.pending += 1
            if det and not done and r.pending < self.window:
                continue
            if det:
                self._stats["windows"] += 1
                self._stats["verify_passes"] += 1
            n, r.pending = r.pending, 0
            self._stats["committed_tokens"] += n
            outs.append(self._output(r, n, done))
            if done:
                del self._reqs[r.rid]
        return outs

    def _next(self, r: _Req, batch_size: int) -> tuple[int, float]:
        pos = len(r.out)
        h = zlib.crc32(bytes(b % 256 for b in r.prompt_ids) + pos.to_bytes(4, "little"))
        if self.nondeterministic and pos >= self.flip_at:
            h = zlib.crc32(h.to_bytes(4, "little") + batch_size.to_bytes(4, "little"))
        lp = -1.0 - (h % 1000) / 1000.0
        if self.logprob_noise:
            lp -= batch_size * 1e-6
        return 97 + h % 26, lp

    def _output(self, r: _Req, n: int, done: bool) -> RequestOutput:
        return RequestOutput(
            request_id=r.rid, prompt_token_ids=list(r.prompt_ids), token_ids=list(r.out),
            text=self.tokenizer.decode(r.out), finished=done,
            finish_reason="length" if done else None,
            logprobs=list(r.logprobs) if r.params.logprobs is not None else None,
            is_deterministic=r.params.is_deterministic, num_new_tokens=n)
