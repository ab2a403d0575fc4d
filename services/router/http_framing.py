"""Broken HTTP framing answered like every other bad request: an OpenAI error body.

Bytes that are not an HTTP/1.1 request (a bad request line, a non-token method, control
bytes in a header, an invalid Content-Length or chunk size, Content-Length beside
Transfer-Encoding, ...) never reach the FastAPI app: uvicorn's parser refuses them and
uvicorn answers a plain-text 400. ``FramingErrorProtocol`` is uvicorn's own protocol with
that answer replaced by a JSON body (``{"error": {"message", "type", "param", "code"}}``)
that names the parser's reason, and with a bound on the request head that uvicorn's
httptools protocol lacks: a request target beyond ``MAX_URL_BYTES`` gets 414, a head
(request line and headers) beyond ``MAX_HEAD_BYTES`` 431, instead of being buffered without
end.

Ray Serve builds the uvicorn servers itself (``uvicorn.Config(http="auto")``) and offers
no option for their protocol class, so ``install`` points uvicorn's "auto" protocol at this
one in the calling process. Serve calls ``proxy_callback`` (its HTTP proxy callback,
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``, set by ``services.serve_config``) in every
process about to start such a server, before starting it: each HTTP proxy (Kubernetes) and
the router replica's direct ingress (``detserve serve``).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.router.errors import APIError

MAX_URL_BYTES = 16 * 1024     # the request target; the API's paths are short
MAX_HEAD_BYTES = 64 * 1024    # request line and headers together
LINGER_S = 2.0               # how long a refused client may go on sending
PROTOCOL_PATH = f"{__name__}:FramingErrorProtocol"


def framing_error(status: int, message: str) -> APIError:
    code = {414: "url_too_long", 431: "headers_too_large"}.get(status, "malformed_http")
    return APIError(status, message, code=code)


def _head_too_large() -> APIError:
    return framing_error(431, f"the request head exceeds {MAX_HEAD_BYTES} bytes")


def error_response(error: APIError, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The whole HTTP/1.1 response for ``error``; the connection is closed after it."""
    body = json.dumps(error.body()).encode()
    reason = HTTPStatus(error.status).phrase.encode()
    head = [b"HTTP/1.1 %d %s\r\n" % (error.status, reason)]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head += [b"content-type: application/json\r\n",
             b"content-length: %d\r\n" % len(body),
             b"connection: close\r\n\r\n"]
    return b"".join(head) + body


class _NoWebSocket:
    """The API has no WebSocket routes: an upgrade request is served as the plain HTTP
    request it also is (uvicorn's WebSocket refusal would be a plain-text 403)."""

    def _should_upgrade_to_ws(self) -> bool:
        return False

    def _unsupported_upgrade_warning(self) -> None:
        pass  # uvicorn's would blame a missing WebSocket library


class _H11FramingErrors(_NoWebSocket, H11Protocol):
    """h11 (where httptools is not installed): the 400 with a JSON body; h11 bounds the
    head itself (``h11_max_incomplete_event_size``)."""

    def send_400_response(self, msg: str) -> None:
        error = framing_error(400, f"malformed HTTP request: {msg}")
        self.transport.write(error_response(error, self.server_state.default_headers))
        self.transport.close()


def _httptools_protocol() -> type[Any]:
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class ReasonParser(httptools.HttpRequestParser):  # type: ignore[misc]
        """The parser, remembering why it refused the bytes (uvicorn drops the reason)."""

        reason = ""

        def feed_data(self, data: Any) -> None:
            try:
                super().feed_data(data)
            except httptools.HttpParserError as e:
                if not isinstance(e, httptools.HttpParserUpgrade):
                    self.reason = str(e.__cause__ or e)
                raise

    class HttpToolsFramingErrors(_NoWebSocket, HttpToolsProtocol):  # type: ignore[misc]
        """httptools: the 400 with a JSON body and the parser's reason; 414 and 431 for a
        request line or head beyond its bound.

        Invariant: ``_head_bytes`` counts the bytes received since the last request's
        headers were complete (or since the connection opened) while ``_in_head``, and
        ``_parsed_bytes`` the current request's target and headers. A parser callback that
        raises makes ``feed_data`` fail; uvicorn then calls ``send_400_response``, which
        answers ``_error`` when a bound set it."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._reasons = ReasonParser(self)
            self._reasons.set_dangerous_leniencies(lenient_data_after_close=True)
            self.parser = self._reasons
            self._in_head, self._head_bytes, self._parsed_bytes = True, 0, 0
            self._error: APIError | None = None
            self._lingering = False

        def data_received(self, data: bytes) -> None:
            if self._lingering:  # the rest of a refused request: read and dropped
                return
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._in_head and self._head_bytes > MAX_HEAD_BYTES and not self._lingering:
                self._error = _head_too_large()
                self.send_400_response("")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._parsed_bytes = 0

        def on_url(self, url: bytes) -> None:
            self._parsed_bytes += len(url)
            if self._parsed_bytes > MAX_URL_BYTES:
                self._error = framing_error(414, f"the request target exceeds {MAX_URL_BYTES} "
                                                 "bytes")
                raise ValueError(self._error.message)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._parsed_bytes += len(name) + len(value) + 4
            if self._parsed_bytes > MAX_HEAD_BYTES:
                self._error = _head_too_large()
                raise ValueError(self._error.message)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes = False, 0
            if not _is_path(self.url):
                # Serve matches the path against route prefixes before the app sees it,
                # and answers a plain-text 404 for one that is no path ("*")
                self._error = framing_error(400, "the request target must be a path "
                                                 "beginning with '/'")
                raise ValueError(self._error.message)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_head = True
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            error = self._error or framing_error(
                400, f"malformed HTTP request: {self._reasons.reason or msg}")
            self.transport.write(error_response(error, self.server_state.default_headers))
            self._linger()

        def _linger(self) -> None:
            """Close once the client stopped sending (its end of stream closes the transport:
            ``eof_received``), or after ``LINGER_S`` at most. Closing at
            once, with the client's bytes still arriving, makes the kernel reset the
            connection, and the client may lose the answer before reading it."""
            self._lingering = True
            if not self.transport.can_write_eof():
                self.transport.close()
                return
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)

    def _is_path(target: bytes) -> bool:
        """Whether ``target`` (origin or absolute form) names a path from the root."""
        try:
            path = httptools.parse_url(target).path
        except httptools.HttpParserInvalidURLError:
            return True  # uvicorn refuses it: a 400 with the parser's reason
        return path is not None and path.startswith(b"/")

    return HttpToolsFramingErrors


FramingErrorProtocol: type[Any] = (
    _H11FramingErrors if AutoHTTPProtocol is H11Protocol else _httptools_protocol())


def proxy_callback() -> list[Any]:
    """Ray Serve's HTTP proxy callback: ``install``; no middleware added."""
    install()
    return []


def install() -> None:
    """Make uvicorn servers created from now on in this process (``http="auto"``, what
    Ray Serve uses) answer broken framing with ``FramingErrorProtocol``. Idempotent."""
    from uvicorn import config

    config.HTTP_PROTOCOLS["auto"] = PROTOCOL_PATH
