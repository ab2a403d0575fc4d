"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

MAX_MESSAGE_CHARS = 500  # an error message or param longer than this is cut


class APIError(Exception):
    """An error answered to the client; ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        message, param = _clean(message), None if param is None else _clean(param)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(err: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the offending field."""
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if not _is_type_tag(p)]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    return invalid(f"{param}: {message}" if param else message, param=param)


def overloaded(retry_after_s: int) -> APIError:
    return APIError(429, "the server is overloaded; retry later", type="rate_limit_error",
                    code="rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)})


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="no_decoder_ready")


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def excerpt(text: str, limit: int = 80) -> str:
    """A client's value (a model name, a role) shortened to quote in an error message."""
    return text if len(text) <= limit else text[:limit] + "..."


def _clean(text: str) -> str:
    """``text`` short and valid Unicode: a gRPC status travels in a trailer (8 KiB by
    default, non-ASCII bytes percent-encoded), and what a client sent may hold lone
    surrogates, which no UTF-8 body or status can carry."""
    return excerpt(text, MAX_MESSAGE_CHARS).encode("utf-8", "replace").decode("utf-8")


def _is_type_tag(part: object) -> bool:
    # pydantic puts the union member tried into loc ("str", "list[int]", "function-after")
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list")
                                      or "[" in part or part.startswith("function-"))
