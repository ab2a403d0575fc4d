"""The gRPC ``Completions`` service: proto <-> router jobs.

Ray Serve's gRPC proxy registers the service through ``add_CompletionsServicer_to_server``
(listed in ``services.serve_config.GRPC_SERVICER_FUNCTIONS``) and calls the Router
deployment's ``Generate`` / ``Health`` methods, which use the functions here. A request is
converted to the equivalent OpenAI body and validated by the same code as HTTP, so both
APIs accept and refuse exactly the same things. The HTTP header that asks for determinism
travels as request metadata of the same name, lower-cased (``DETERMINISM_METADATA``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from pydantic import ValidationError

from detserve.outputs import TokenLogprob
from services.router import detserve_pb2 as pb
from services.router.dispatch import ChoiceEvent
from services.router.errors import APIError, from_validation_error, invalid
from services.router.limits import ServingLimits
from services.router.model_context import ModelContext
from services.router.prepare import (
    DETERMINISM_HEADER,
    Job,
    parse_determinism_header,
    prepare_chat,
    prepare_completion,
)
from services.router.schemas import ChatCompletionRequest, CompletionRequest

__all__ = ["Undecodable", "add_CompletionsServicer_to_server", "job_from_proto",
           "status_code"]

DETERMINISM_METADATA = DETERMINISM_HEADER.lower()  # gRPC metadata keys are lower case

# Ray Serve's gRPC proxy pickles the request message to the Router replica, by its class's
# module name. The stubs are generated from proto/ (proto/gen.py), which registers their
# messages under the top-level name "detserve_pb2"; make that name importable here (the
# proxy and the Router both import this module) so the pickle resolves to these classes.
sys.modules.setdefault(pb.DESCRIPTOR.name.removesuffix(".proto") + "_pb2", pb)

_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "seed", "min_tokens",
             "presence_penalty", "frequency_penalty")
_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
           413: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
           503: grpc.StatusCode.UNAVAILABLE}


@dataclass(frozen=True)
class Undecodable:
    """A request whose bytes are not its message (invalid UTF-8 in a string field, a
    truncated or mistyped field): the servicer refuses it with INVALID_ARGUMENT. A
    deserializer that raised instead would make gRPC answer UNKNOWN."""

    reason: str


def _lenient(message: type[Message]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Message | Undecodable:
        try:
            return message.FromString(data)
        except DecodeError as e:
            return Undecodable(str(e))
    return parse


def add_CompletionsServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802
    """The generated registration, with deserializers that hand undecodable requests to
    the servicer as ``Undecodable`` (Ray Serve keeps each handler's deserializer)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Health": grpc.unary_unary_rpc_method_handler(
            servicer.Health, request_deserializer=_lenient(pb.HealthRequest),
            response_serializer=pb.HealthResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("detserve.Completions", handlers),))
    server.add_registered_method_handlers("detserve.Completions", handlers)


def status_code(error: APIError) -> grpc.StatusCode:
    return _STATUS.get(error.status, grpc.StatusCode.INTERNAL)


def job_from_proto(req: pb.GenerateRequest | Undecodable, ctx: ModelContext,
                   limits: ServingLimits,
                   metadata: Iterable[tuple[str, str | bytes]] = ()) -> Job:
    """Validate like the HTTP API; raises APIError. ``metadata``: the call's invocation
    metadata (``DETERMINISM_METADATA`` is read from it)."""
    if isinstance(req, Undecodable):
        raise invalid(f"the request is not a valid GenerateRequest: {req.reason}",
                      code="invalid_protobuf")
    if len(req.request_id) > limits.max_request_id_chars or not req.request_id.isprintable():
        raise invalid(f"request_id must be printable and <= {limits.max_request_id_chars} "
                      "chars", param="request_id")
    if req.ByteSize() > limits.max_body_bytes:
        raise APIError(413, f"request exceeds {limits.max_body_bytes} bytes",
                       code="request_too_large")
    body = _openai_body(req, ctx)
    header = parse_determinism_header(_metadata_value(metadata, DETERMINISM_METADATA))
    try:
        if "messages" in body:
            return prepare_chat(ChatCompletionRequest.model_validate(body), ctx, limits, header)
        return prepare_completion(CompletionRequest.model_validate(body), ctx, limits, header)
    except ValidationError as e:
        raise from_validation_error(e) from e


def _openai_body(req: pb.GenerateRequest, ctx: ModelContext) -> dict[str, Any]:
    given = [name for name in ("prompt", "prompt_token_ids", "messages") if _is_set(req, name)]
    if len(given) != 1:
        raise invalid("set exactly one of prompt, prompt_token_ids, messages", param="prompt")
    body: dict[str, Any] = {"model": req.model or ctx.model_id, "stream": True,
                            "ignore_eos": req.ignore_eos}
    if req.HasField("is_deterministic"):  # unset: the metadata, name or default decide
        body["is_deterministic"] = req.is_deterministic
    if given[0] == "messages":
        body["messages"] = [{"role": m.role, "content": m.content} for m in req.messages]
    else:
        body["prompt"] = req.prompt if given[0] == "prompt" else list(req.prompt_token_ids)
    for name in _OPTIONAL:
        if req.HasField(name):
            body[name] = getattr(req, name)
    if req.HasField("logprobs"):
        if given[0] == "messages":
            body.update(logprobs=True, top_logprobs=req.logprobs)
        else:
            body["logprobs"] = req.logprobs
    if req.stop:
        body["stop"] = list(req.stop)
    if req.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in req.logit_bias.items()}
    if req.echo:
        if given[0] == "messages":
            raise invalid("echo takes a prompt or prompt_token_ids, not messages", param="echo")
        body["echo"] = True
    return body


def _metadata_value(metadata: Iterable[tuple[str, str | bytes]], key: str) -> str | None:
    """The last value of ``key`` in gRPC metadata (binary values decoded as UTF-8)."""
    found = None
    for name, value in metadata:
        if name.lower() == key:
            found = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return found


def _is_set(req: pb.GenerateRequest, name: str) -> bool:
    value = getattr(req, name)
    return bool(value) if isinstance(value, str) else len(value) > 0


def chunk_message(request_id: str, event: ChoiceEvent, echo: str | None = None
                  ) -> pb.GenerateResponse:
    """``echo`` (a choice's first chunk, when asked): the prompt text to send first, with
    the prompt's logprobs when the event carries them."""
    chunk = pb.Chunk(text=(echo or "") + event.text, token_ids=list(event.token_ids),
                     logprobs=[_logprob(lp) for lp in event.logprobs or ()])
    if echo is not None and event.prompt_logprobs:
        chunk.prompt_logprobs.extend(_logprob(lp) for lp in event.prompt_logprobs if lp)
    return pb.GenerateResponse(request_id=request_id, chunk=chunk)


def complete_message(request_id: str, job: Job, text: str, completion_tokens: int,
                     finish_reason: str, determinism: Mapping[str, object] | None
                     ) -> pb.GenerateResponse:
    prompt = job.prompt_tokens
    usage = pb.Usage(prompt_tokens=prompt, completion_tokens=completion_tokens,
                     total_tokens=prompt + completion_tokens)
    done = pb.Complete(finish_reason=finish_reason, usage=usage, text=text,
                       is_deterministic=job.is_deterministic)
    if determinism:
        fields = pb.Determinism.DESCRIPTOR.fields_by_name
        done.determinism.CopyFrom(pb.Determinism(
            **{k: v for k, v in determinism.items() if k in fields}))  # type: ignore[arg-type]
    return pb.GenerateResponse(request_id=request_id, complete=done)


def error_message(request_id: str, error: APIError) -> pb.GenerateResponse:
    err = pb.Error(message=error.message, type=error.type, code=error.code or "")
    return pb.GenerateResponse(request_id=request_id, error=err)


def _logprob(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top.items()])
