"""The gRPC target against a toy ``Completions`` servicer built from the real stubs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fake_engine import FakeEngine

from detserve.params import SamplingParams
from loadgen.targets import ReplayOptions, make_target
from loadgen.targets.grpc_client import load_stubs
from loadgen.trace import TraceRequest

grpc = pytest.importorskip("grpc")
try:
    pb2, pb2_grpc = load_stubs()
except RuntimeError as e:
    pytest.skip(str(e), allow_module_level=True)


class ToyCompletions(pb2_grpc.CompletionsServicer):  # type: ignore[misc,name-defined]
    """Runs each request on its own toy engine; streams chunks, then complete."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        self.requests.append(request)
        if not request.prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        if request.prompt == "fail":
            yield pb2.GenerateResponse(request_id=request.request_id,
                                       error=pb2.Error(message="boom", type="server_error"))
            return
        engine = FakeEngine(window=2)
        params = SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature,
                                is_deterministic=request.is_deterministic,
                                logprobs=request.logprobs if request.HasField("logprobs")
                                else None)
        engine.add_request(request.request_id, request.prompt, params)
        sent = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                new = out.token_ids[len(out.token_ids) - out.num_new_tokens:]
                lps = [pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob)
                       for lp in (out.logprobs or [])[len(out.token_ids) - out.num_new_tokens:]]
                yield pb2.GenerateResponse(request_id=request.request_id, chunk=pb2.Chunk(
                    text=out.text[sent:], token_ids=new, logprobs=lps))
                sent = len(out.text)
                if out.finished:
                    det = pb2.Determinism(fingerprint="toy", mode="llm42") \
                        if request.is_deterministic else None
                    yield pb2.GenerateResponse(request_id=request.request_id,
                                               complete=pb2.Complete(
                        finish_reason="length", text=out.text, determinism=det,
                        usage=pb2.Usage(completion_tokens=len(out.token_ids))))
            await asyncio.sleep(0.001)


def test_grpc_target_streams_and_reports() -> None:
    servicer = ToyCompletions()
    reqs = [TraceRequest("a", "hello there", 11, 5, is_deterministic=True, logprobs=1),
            TraceRequest("b", "general kenobi", 14, 4, arrival_s=0.01),
            TraceRequest("c", "", 0, 3), TraceRequest("d", "fail", 4, 3)]

    async def go() -> list[Any]:
        server = grpc.aio.server()
        pb2_grpc.add_CompletionsServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        target = make_target(f"grpc://127.0.0.1:{port}")
        try:
            return await target.replay(reqs, ReplayOptions(request_timeout_s=30))
        finally:
            await target.aclose()
            await server.stop(None)

    a, b, c, d = asyncio.run(go())
    assert a.success and a.output_len == 5 and len(a.text) == 5
    assert a.chunk_tokens == [2, 2, 1] and a.token_ids is not None and len(a.token_ids) == 5
    assert a.logprobs is not None and len(a.logprobs) == 5
    assert a.determinism == {"fingerprint": "toy", "mode": "llm42"}
    assert a.finish_reason == "length" and 0 < a.ttft_s <= a.e2el_s
    assert b.success and b.output_len == 4 and b.determinism is None and b.logprobs is None
    assert not c.success and "INVALID_ARGUMENT" in c.error
    assert not d.success and d.error == "server_error: boom"
    sent = {r.request_id: r for r in servicer.requests}
    assert sent["a"].is_deterministic and sent["a"].temperature == 0.0
    assert sent["a"].HasField("temperature") and sent["b"].max_tokens == 4
