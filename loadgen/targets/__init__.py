"""Targets: where the load goes. ``make_target`` picks one from a URL-like string:

  http(s)://host:port   any OpenAI-compatible server (loadgen.targets.openai_http)
  grpc://host:port      our gRPC Completions service (loadgen.targets.grpc_client)
  engine                the in-process engine, built from ``engine_args`` (offline mode)
"""

from __future__ import annotations

from typing import Any

from loadgen.targets.base import ReplayOptions, RequestResult, StreamingTarget, Target
from loadgen.tokenizer import Tokenizer

__all__ = ["ReplayOptions", "RequestResult", "StreamingTarget", "Target", "make_target"]


def make_target(url: str, *, label: str | None = None, model: str | None = None,
                api: str = "completions", extra_fields: bool = True,
                send_token_ids: bool = False, tokenizer: Tokenizer | None = None,
                engine_args: dict[str, Any] | None = None) -> Target:
    if url.startswith(("http://", "https://")):
        from loadgen.targets.openai_http import OpenAIHTTPTarget

        return OpenAIHTTPTarget(url, model=model, api=api, extra_fields=extra_fields,
                                send_token_ids=send_token_ids, tokenizer=tokenizer,
                                label=label)
    if url.startswith("grpc://"):
        from loadgen.targets.grpc_client import GrpcTarget

        return GrpcTarget(url, label=label, send_token_ids=send_token_ids)
    if url == "engine":
        from loadgen.targets.engine import EngineTarget

        args = dict(engine_args or {})
        if model is not None:
            args.setdefault("model", model)
        return EngineTarget.from_args(label=label, **args)
    raise ValueError(f"unknown target {url!r}: use http(s)://..., grpc://... or 'engine'")
