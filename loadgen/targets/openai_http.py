"""Any OpenAI-compatible HTTP server (ours, vLLM, SGLang...), streamed over SSE.

Each request is sent with ``stream: true`` and ``stream_options: {include_usage: true}``;
TTFT and ITL are measured per SSE chunk, the output length comes from the final usage
chunk (or from the per-chunk logprobs/token ids, or from the tokenizer). Our extra body
fields ``is_deterministic``, ``seed`` and vLLM's ``ignore_eos`` are sent unless
``extra_fields=False``; the ``determinism`` object of our responses is kept per request.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from loadgen.server_stats import parse_prometheus
from loadgen.targets.base import RequestResult, ResultRecorder, StreamingTarget
from loadgen.tokenizer import Tokenizer
from loadgen.trace import TraceRequest

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class OpenAIHTTPTarget(StreamingTarget):
    def __init__(self, base_url: str, *, model: str | None = None, api: str = "completions",
                 api_key: str | None = None, extra_fields: bool = True,
                 send_token_ids: bool = False, tokenizer: Tokenizer | None = None,
                 extra_body: dict[str, Any] | None = None, label: str | None = None) -> None:
        if api not in ENDPOINTS:
            raise ValueError(f"api must be one of {sorted(ENDPOINTS)}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api = api
        self.extra_fields = extra_fields
        self.send_token_ids = send_token_ids and api == "completions"
        self.tokenizer = tokenizer
        self.extra_body = dict(extra_body or {})
        self.label = label or self.base_url
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: Any = None
        self._model_lock: asyncio.Lock | None = None

    def connect(self) -> None:
        """Build the HTTP client now rather than at the first request (building it loads a
        TLS context: tens of milliseconds that would land in that request's latency)."""
        self._http()

    def _http(self) -> Any:
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=30.0), headers=self._headers,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        return self._client

    async def resolve_model(self) -> str:
        """The ``model`` field to send: the one given, or the server's first model."""
        if self.model is None:
            self._model_lock = self._model_lock or asyncio.Lock()
            async with self._model_lock:
                if self.model is None:
                    resp = await self._http().get(self.base_url + "/v1/models")
                    resp.raise_for_status()
                    self.model = str(resp.json()["data"][0]["id"])
        return self.model

    def payload(self, req: TraceRequest, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model, "max_tokens": req.output_len, "temperature": req.temperature,
            "stream": True, "stream_options": {"include_usage": True},
        }
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": req.prompt}]
            if req.logprobs is not None:
                body["logprobs"] = True
                body["top_logprobs"] = req.logprobs
        else:
            use_ids = self.send_token_ids and req.prompt_token_ids is not None
            body["prompt"] = list(req.prompt_token_ids or ()) if use_ids else req.prompt
            if req.logprobs is not None:
                body["logprobs"] = req.logprobs
        if req.seed is not None:
            body["seed"] = req.seed
        if self.extra_fields:
            body["is_deterministic"] = req.is_deterministic
            if req.ignore_eos:
                body["ignore_eos"] = True
        body.update(self.extra_body)
        return body

    async def generate(self, req: TraceRequest, run_start: float) -> RequestResult:
        rec = ResultRecorder(req, run_start)
        try:
            model = await self.resolve_model()
            url = self.base_url + ENDPOINTS[self.api]
            async with self._http().stream("POST", url, json=self.payload(req, model)) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode("utf-8", "replace")
                    return rec.fail(f"HTTP {resp.status_code}: {body[:500]}")
                state = _StreamState()
                async for line in resp.aiter_lines():
                    error = self._on_line(line, rec, state)
                    if error:
                        return rec.fail(error)
                    if state.done:
                        break
            out_len = state.usage_tokens
            if out_len is None and not state.counted and self.tokenizer is not None:
                out_len = len(self.tokenizer.encode(rec.text_so_far))
            return rec.finish(output_len=out_len, finish_reason=state.finish_reason,
                              determinism=state.determinism)
        except Exception as e:  # any transport or protocol error fails this request only
            return rec.fail(f"{type(e).__name__}: {e}")

    def _on_line(self, line: str, rec: ResultRecorder, st: _StreamState) -> str | None:
        if not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            st.done = True
            return None
        obj = json.loads(data)
        if "error" in obj:
            return str(obj["error"])
        usage = obj.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            st.usage_tokens = int(usage["completion_tokens"])
        st.determinism = obj.get("determinism") or st.determinism
        for choice in obj.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            text, logprobs = _delta(choice, self.api)
            token_ids = choice.get("token_ids")
            if logprobs is not None or token_ids is not None:
                st.counted = True
            rec.chunk(text, token_ids=token_ids, logprobs=logprobs)
            st.finish_reason = choice.get("finish_reason") or st.finish_reason
            st.determinism = choice.get("determinism") or st.determinism
        return None

    async def server_stats(self) -> dict[str, float]:
        try:
            resp = await self._http().get(self.base_url + "/metrics")
        except Exception:
            return {}
        if resp.status_code != 200:
            return {}
        return parse_prometheus(resp.text)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class _StreamState:
    def __init__(self) -> None:
        self.done = False
        self.counted = False
        self.usage_tokens: int | None = None
        self.finish_reason: str | None = None
        self.determinism: dict[str, Any] | None = None


def _delta(choice: dict[str, Any], api: str) -> tuple[str, list[float] | None]:
    """Text and per-token logprobs of one streamed choice."""
    lp = choice.get("logprobs")
    if api == "chat":
        text = (choice.get("delta") or {}).get("content") or ""
        content = lp.get("content") if isinstance(lp, dict) else None
        return text, [float(t["logprob"]) for t in content] if content else None
    text = choice.get("text") or ""
    values = lp.get("token_logprobs") if isinstance(lp, dict) else None
    return text, [float(x) for x in values] if values else None
