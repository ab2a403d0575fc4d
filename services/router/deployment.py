"""The ``Router`` Ray Serve deployment: HTTP ingress (FastAPI) and gRPC ``Completions``."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
from fastapi import FastAPI
from ray import serve

from services.cluster_auth import ClusterAuth
from services.router import detserve_pb2 as pb
from services.router.dispatch import DecoderFailure
from services.router.errors import APIError
from services.router.grpc_api import (
    Undecodable,
    chunk_message,
    complete_message,
    error_message,
    job_from_proto,
    status_code,
)
from services.router.http_app import build_http_app
from services.router.limits import ServingLimits
from services.router.links import LinkHub
from services.router.model_context import ModelContext
from services.router.service import RouterService, decoder_failed
from services.serve_config import ROUTER

log = logging.getLogger(__name__)


class GrpcRefused(Exception):
    """Raised after the status code was set on the gRPC context."""


@serve.deployment(name=ROUTER, max_ongoing_requests=4096)
@serve.ingress()
class Router:
    async def __init__(self, args: Mapping[str, Any], decoder: Any,  # type: ignore[misc]
                       limits: ServingLimits | None = None, verifier: Any = None) -> None:
        ctx = ModelContext.from_args(args)
        links = LinkHub(str(args["redis_url"]), ClusterAuth.from_env())
        self.service = RouterService(ctx, limits or ServingLimits.from_args(args), decoder,
                                     links)
        self.service.health.start()
        links.start()
        self._verifier = verifier  # bound so that Serve deploys the verifier pool

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_http_app(self.service)

    async def Generate(self, request: pb.GenerateRequest | Undecodable,  # noqa: N802
                       grpc_context: Any = None) -> AsyncIterator[pb.GenerateResponse]:
        accepted = time.monotonic()
        rid = "" if isinstance(request, Undecodable) else request.request_id
        try:
            metadata = grpc_context.invocation_metadata() if grpc_context is not None else ()
            job = job_from_proto(request, self.service.ctx, self.service.limits,
                                 metadata).accepted_at(accepted)
            rid = rid or job.id
            stream = await self.service.open(job)
        except APIError as e:
            if grpc_context is not None:
                grpc_context.set_code(status_code(e))
                grpc_context.set_details(e.message)
            raise GrpcRefused(e.message) from e
        text, tokens, reason, determinism = "", 0, "stop", None
        echo = job.echo[0] if job.echo else None  # (one choice: no n over gRPC)
        try:
            async for event in stream:
                text += (echo or "") + event.text
                tokens += len(event.token_ids)
                reason = event.finish_reason or reason
                determinism = event.determinism or determinism
                yield chunk_message(rid, event, echo)
                echo = None
            yield complete_message(rid, job, text, tokens, reason, determinism)
        except (APIError, DecoderFailure) as e:
            yield error_message(rid, e if isinstance(e, APIError) else decoder_failed(e))
        finally:
            await stream.close()

    async def Health(self, request: pb.HealthRequest | Undecodable,  # noqa: N802
                     grpc_context: Any = None) -> pb.HealthResponse:
        if isinstance(request, Undecodable):
            message = f"the request is not a valid HealthRequest: {request.reason}"
            if grpc_context is not None:
                grpc_context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                grpc_context.set_details(message)
            raise GrpcRefused(message)
        health = self.service.health
        refusal = await health.status()
        return pb.HealthResponse(ready=refusal is None, decoders_ready=health.decoders_ready,
                                 status="ok" if refusal is None else refusal.message)

    def __del__(self) -> None:
        self.service.health.stop()
        self.service.dispatcher.links.close()

