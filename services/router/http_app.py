"""The OpenAI-compatible HTTP API (FastAPI), built around a ``RouterService``.

Besides OpenAI's routes: vLLM's tokenizer routes (``services.router.tokenizer_api``),
``/health`` (readiness: would a request succeed now?), ``/livez`` (liveness: is this
router's event loop answering?) and ``/metrics``. /v1/models lists the model twice: under its served name and
under its deterministic name, whose requests are all deterministic.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from services.router.dispatch import DecoderFailure
from services.router.errors import (
    APIError,
    excerpt,
    from_validation_error,
    invalid,
    server_error,
)
from services.router.openai_format import DONE, ChoiceResult, Formatter, sse
from services.router.prepare import (
    DETERMINISM_HEADER,
    Job,
    parse_determinism_header,
    prepare_chat,
    prepare_completion,
)
from services.router.schemas import ChatCompletionRequest, CompletionRequest
from services.router.service import OpenStream, RouterService, decoder_failed
from services.router.tokenizer_api import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
    tokenizer_info,
)

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


def build_http_app(service: RouterService) -> FastAPI:
    app = FastAPI(title="detserve", docs_url=None, redoc_url=None)
    _install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        accepted = time.monotonic()
        req = _parse(CompletionRequest, await read_json(request, service.limits.max_body_bytes))
        job = prepare_completion(req, service.ctx, service.limits, _header(request))
        return await _respond(service, job.accepted_at(accepted))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        accepted = time.monotonic()
        body = await read_json(request, service.limits.max_body_bytes)
        req = _parse(ChatCompletionRequest, body)
        job = prepare_chat(req, service.ctx, service.limits, _header(request))
        return await _respond(service, job.accepted_at(accepted))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        ctx, created = service.ctx, int(time.time())
        cards = [{"id": name, "object": "model", "created": created, "owned_by": "detserve",
                  "root": ctx.model_id, "parent": None if name == ctx.model_id else ctx.model_id,
                  "max_model_len": ctx.max_model_len,
                  "deterministic": name == ctx.deterministic_id or ctx.deterministic_by_default}
                 for name in (ctx.model_id, ctx.deterministic_id)]
        return {"object": "list", "data": cards}

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        body = await read_json(request, service.limits.max_body_bytes)
        return tokenize(_parse(TokenizeRequest, body), service.ctx)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        body = await read_json(request, service.limits.max_body_bytes)
        return detokenize(_parse(DetokenizeRequest, body), service.ctx)

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> dict[str, Any]:
        return tokenizer_info(service.ctx)

    @app.get("/health")
    async def health() -> Response:
        refusal = await service.health.status()
        body: dict[str, Any] = {"status": "ok" if refusal is None else "unavailable",
                                "decoders_ready": service.health.decoders_ready}
        if refusal is not None:  # what a request would meet, as an OpenAI error body
            body.update(refusal.body())
        return JSONResponse(body, status_code=200 if refusal is None else 503)

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        # Liveness, for a probe that restarts what fails it: answered by the event loop
        # alone, whatever Redis, the decoders or the verifiers do (a restart mends none of
        # them; /health says whether to send traffic). A stalled loop cannot answer, and
        # the probe's timeout turns that into a failure.
        return {"status": "alive"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object: 415 for a Content-Type other than JSON, 413 above
    ``limit`` bytes, 400 for anything ``parse_json_object`` refuses."""
    _check_content_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    return parse_json_object(bytes(body))


def parse_json_object(data: bytes) -> dict[str, Any]:
    """``data`` as a JSON object (RFC 8259: UTF-8 text, finite numbers), else a 400: invalid
    UTF-8, NaN / Infinity or a number beyond the float range, an integer too long to
    convert, nesting deeper than the parser's recursion, a lone UTF-16 surrogate escape
    (``"\\ud800"``: not Unicode text, no tokenizer takes it), a value that is no object."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"the request body is not valid UTF-8 (byte {e.start})",
                      code="invalid_json") from e
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError as e:
        raise invalid("the request body is nested too deeply", code="invalid_json") from e
    except ValueError as e:  # JSONDecodeError, and the refusals of the two hooks above
        raise invalid(f"malformed JSON body: {e}", code="invalid_json") from e
    if not isinstance(value, dict):
        raise invalid("the request body must be a JSON object")
    where = _lone_surrogate(value)
    if where is not None:
        raise invalid(f"{where or 'body'}: a string holds a lone UTF-16 surrogate, which is "
                      "not valid Unicode", param=where or None)
    return value


def _header(request: Request) -> bool | None:
    return parse_determinism_header(request.headers.get(DETERMINISM_HEADER))


def _check_content_type(value: str | None) -> None:
    """JSON media types (``application/json``, ``application/*+json``) or none at all."""
    if value is None:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/")
                                             and media.endswith("+json")):
        raise APIError(415, f"Content-Type must be application/json, got {excerpt(value)!r}",
                       code="unsupported_media_type")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is beyond the float range")
    return value


def _lone_surrogate(value: Any) -> str | None:
    """The dotted path of the first string (key or value) in ``value`` that holds a lone
    surrogate, or None. Iterative: the parser bounds the depth, not this walk."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _is_unicode(item):
                return ".".join(path)
        elif isinstance(item, dict):
            for key, sub in item.items():
                if not _is_unicode(key):
                    return ".".join(path)
                stack.append((sub, (*path, key)))
        elif isinstance(item, list):
            stack.extend((sub, (*path, str(i))) for i, sub in enumerate(item))
    return None


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parse(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from e


async def _respond(service: RouterService, job: Job) -> Response:
    stream = await service.open(job)
    fmt = Formatter(job, service.ctx)
    if job.stream:
        return StreamingResponse(_sse(stream, fmt, job), media_type="text/event-stream")
    results = [ChoiceResult() for _ in job.choices]
    try:
        async for event in stream:
            results[event.index].add(event)
    except DecoderFailure as e:
        raise decoder_failed(e) from e
    finally:
        await stream.close()
    return JSONResponse(fmt.response(results))


async def _sse(stream: OpenStream, fmt: Formatter, job: Job) -> AsyncIterator[bytes]:
    tokens = 0
    try:
        async for event in stream:
            tokens += len(event.token_ids)
            yield fmt.chunk(event)
        if job.include_usage:
            yield fmt.usage_chunk(tokens)
    except (APIError, DecoderFailure) as e:
        err = e if isinstance(e, APIError) else decoder_failed(e)
        log.warning("stream %s failed: %s", job.id, err.message)
        yield sse(err.body())
    except Exception:  # a fault of ours after the 200: the stream still ends with an error
        log.exception("stream %s failed", job.id)
        yield sse(server_error("internal error while streaming").body())
    finally:
        await stream.close()
    yield DONE


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        err = APIError(e.status_code, str(e.detail), code=f"http_{e.status_code}")
        return JSONResponse(err.body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(invalid(str(e)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, e: Exception) -> JSONResponse:
        # the server's own fault (bad input is an APIError before this): a 500 with an
        # OpenAI error body instead of a plain-text one
        log.error("%s %s failed: %r", request.method, request.url.path, e)
        return JSONResponse(server_error("internal server error").body(), status_code=500)
