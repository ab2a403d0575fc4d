"""The in-process engine (``detserve.engine.LLMEngine``), driven step by step.

This is the paper's offline setting when every arrival is 0: all requests are added at
once and the engine runs them to completion. With arrival times it becomes an online
replay without HTTP: requests are added when their time comes (and a concurrency slot
is free) between engine steps. A chunk is what one ``step()`` committed for a request, so
a verified window of several tokens is one chunk, exactly as a client would see it.

The engine is synchronous; the loop runs in a worker thread so the event loop (and the
progress bar) stay responsive.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from loadgen.targets.base import OnDone, ReplayOptions, RequestResult, ResultRecorder, Target
from loadgen.tokenizer import wrap_tokenizer
from loadgen.trace import TraceRequest, sorted_by_arrival

_IDLE_SLEEP_S = 0.02


class EngineTarget(Target):
    def __init__(self, engine: Any, *, label: str = "engine", use_token_ids: bool = True) -> None:
        self.engine = engine
        self.label = label
        self.use_token_ids = use_token_ids
        tok = getattr(engine, "tokenizer", None)
        self.tokenizer = wrap_tokenizer(tok) if tok is not None else None

    @classmethod
    def from_args(cls, label: str | None = None, **engine_args: Any) -> EngineTarget:
        """Build an engine with ``LLMEngine.from_args(**engine_args)`` (model, mode, ...)."""
        try:
            from detserve.engine import LLMEngine
        except ImportError as e:
            raise RuntimeError(f"the in-process target needs detserve.engine: {e}") from e
        engine = LLMEngine.from_args(**engine_args)
        return cls(engine, label=label or str(engine_args.get("mode", "engine")))

    async def replay(self, requests: Sequence[TraceRequest], opts: ReplayOptions,
                     on_done: OnDone | None = None) -> list[RequestResult]:
        loop = asyncio.get_running_loop()

        def done(res: RequestResult) -> None:
            if on_done is not None:
                loop.call_soon_threadsafe(on_done, res)

        by_id = await asyncio.to_thread(self._run, list(requests), opts, done)
        return [by_id[r.id] for r in requests]

    async def server_stats(self) -> dict[str, float]:
        stats = getattr(self.engine, "stats", None)
        if stats is None:
            return {}
        return {k: float(v) for k, v in stats().items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def _params(self, req: TraceRequest) -> Any:
        from detserve.params import SamplingParams

        return SamplingParams(max_tokens=req.output_len, temperature=req.temperature,
                              seed=req.seed, is_deterministic=req.is_deterministic,
                              ignore_eos=req.ignore_eos, logprobs=req.logprobs)

    def _run(self, requests: list[TraceRequest], opts: ReplayOptions,
             on_done: OnDone) -> dict[str, RequestResult]:
        engine = self.engine
        pending = deque(sorted_by_arrival(requests))
        recorders: dict[str, ResultRecorder] = {}
        seen_text: dict[str, int] = {}
        results: dict[str, RequestResult] = {}
        cap = opts.max_concurrency
        start = time.perf_counter()

        def finish(rid: str, res: RequestResult) -> None:
            recorders.pop(rid, None)
            results[rid] = res
            on_done(res)

        while pending or engine.has_unfinished_requests():
            now = time.perf_counter() - start
            while pending and pending[0].arrival_s <= now and (cap is None or len(recorders) < cap):
                req = pending.popleft()
                rec = ResultRecorder(req, start)
                ids = list(req.prompt_token_ids) if (
                    self.use_token_ids and req.prompt_token_ids is not None) else None
                try:
                    engine.add_request(req.id, None if ids else req.prompt, self._params(req),
                                       prompt_token_ids=ids)
                except ValueError as e:
                    finish(req.id, rec.fail(f"rejected: {e}"))
                    continue
                recorders[req.id] = rec
                seen_text[req.id] = 0
            if not engine.has_unfinished_requests():
                if pending:
                    wait = pending[0].arrival_s - (time.perf_counter() - start)
                    time.sleep(min(max(wait, 0.0), _IDLE_SLEEP_S))
                continue
            try:
                outputs = engine.step()
            except Exception as e:
                for rid, rec in list(recorders.items()):
                    finish(rid, rec.fail(f"engine step failed: {type(e).__name__}: {e}"))
                raise
            for out in outputs:
                self._on_output(out, recorders, seen_text, finish)
        for rid, rec in list(recorders.items()):
            finish(rid, rec.fail("engine finished without completing the request"))
        return results

    @staticmethod
    def _on_output(out: Any, recorders: dict[str, ResultRecorder], seen_text: dict[str, int],
                   finish: Any) -> None:
        rec = recorders.get(out.request_id)
        if rec is None:
            return
        n = int(out.num_new_tokens)
        if n > 0:
            delta = out.text[seen_text[out.request_id]:]
            seen_text[out.request_id] = len(out.text)
            lps = [lp.logprob for lp in out.logprobs[-n:]] if out.logprobs else None
            rec.chunk(delta, num_tokens=n, token_ids=out.token_ids[-n:], logprobs=lps)
        if out.finished:
            res = rec.finish(output_len=len(out.token_ids), finish_reason=out.finish_reason)
            res.text = out.text
            res.token_ids = list(out.token_ids)
            if out.logprobs:
                res.logprobs = [float(lp.logprob) for lp in out.logprobs]
            finish(out.request_id, res)
