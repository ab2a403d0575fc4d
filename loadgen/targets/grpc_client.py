"""Our gRPC API (``proto/detserve.proto``): service ``Completions``, server-streaming
``Generate``. The stream is zero or more ``chunk`` events (newly committed tokens), then one
``complete`` (finish reason, usage, determinism profile) or one ``error``.

The generated stubs (``services.router.detserve_pb2`` and ``..._pb2_grpc``, made by
``python proto/gen.py``) are imported lazily, so the rest of loadgen works without them.
"""

from __future__ import annotations

import importlib
from typing import Any

from loadgen.targets.base import RequestResult, ResultRecorder, StreamingTarget
from loadgen.trace import TraceRequest

STUB_MODULES = ("services.router.detserve_pb2", "services.router.detserve_pb2_grpc")
GENERATE_HINT = "generate them with: python proto/gen.py (needs grpcio-tools)"


def load_stubs() -> tuple[Any, Any]:
    try:
        return tuple(importlib.import_module(m) for m in STUB_MODULES)  # type: ignore[return-value]
    except ImportError as e:
        raise RuntimeError(f"gRPC stubs for detserve.proto are missing ({e}); "
                           + GENERATE_HINT) from e


class GrpcTarget(StreamingTarget):
    def __init__(self, address: str, *, label: str | None = None,
                 send_token_ids: bool = False) -> None:
        self.address = address.removeprefix("grpc://").rstrip("/")
        self.label = label or f"grpc://{self.address}"
        self.send_token_ids = send_token_ids
        self._pb2, self._pb2_grpc = load_stubs()
        self._channel: Any = None
        self._stub: Any = None

    def _client(self) -> Any:
        if self._stub is None:
            import grpc

            self._channel = grpc.aio.insecure_channel(self.address)
            self._stub = self._pb2_grpc.CompletionsStub(self._channel)
        return self._stub

    def request_message(self, req: TraceRequest) -> Any:
        """The GenerateRequest for ``req``. Temperature is always set: the proto's default
        is OpenAI's 1.0, a trace's is greedy."""
        msg = self._pb2.GenerateRequest(
            request_id=req.id, max_tokens=req.output_len, temperature=req.temperature,
            is_deterministic=req.is_deterministic, ignore_eos=req.ignore_eos)
        if self.send_token_ids and req.prompt_token_ids is not None:
            msg.prompt_token_ids.extend(req.prompt_token_ids)
        else:
            msg.prompt = req.prompt
        if req.seed is not None:
            msg.seed = req.seed
        if req.logprobs is not None:
            msg.logprobs = req.logprobs
        return msg

    async def generate(self, req: TraceRequest, run_start: float) -> RequestResult:
        rec = ResultRecorder(req, run_start)
        try:
            async for resp in self._client().Generate(self.request_message(req)):
                event = resp.WhichOneof("event")
                if event == "chunk":
                    c = resp.chunk
                    lps = [float(lp.logprob) for lp in c.logprobs] or None
                    rec.chunk(c.text, token_ids=list(c.token_ids), logprobs=lps)
                elif event == "complete":
                    return self._complete(rec, resp.complete)
                elif event == "error":
                    return rec.fail(f"{resp.error.type or 'error'}: {resp.error.message}")
            return rec.fail("stream ended without a complete event")
        except Exception as e:  # transport errors (UNAVAILABLE, INVALID_ARGUMENT...) fail one request
            return rec.fail(f"{type(e).__name__}: {e}")

    @staticmethod
    def _complete(rec: ResultRecorder, done: Any) -> RequestResult:
        determinism = None
        if done.HasField("determinism"):
            from google.protobuf.json_format import MessageToDict

            determinism = dict(MessageToDict(done.determinism,
                                             preserving_proto_field_name=True))
        usage = done.usage.completion_tokens if done.HasField("usage") else None
        res = rec.finish(output_len=usage, finish_reason=done.finish_reason or None,
                         determinism=determinism)
        if done.text:
            res.text = done.text
        return res

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None
