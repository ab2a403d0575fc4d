"""Broken HTTP framing against uvicorn with ``FramingErrorProtocol`` (no Ray: a small ASGI
app behind it). Every answer is a 4xx with an OpenAI error body, or none where HTTP allows
(a stream cut short); 414 and 431 for a request target or head past the bounds; a valid
request on a connection of its own is still served. The served-cluster version of this
test is in test_serving_fuzz.py."""

from __future__ import annotations

import asyncio
import importlib
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn
from hostile_framing import (
    HAND_PICKED,
    JSON_BODY,
    Stream,
    as_expected,
    classify,
    exchange,
    framing_stream,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.redis_server import free_port
from services.router import http_framing

pytestmark = pytest.mark.timeout(300)
BATCH, EXAMPLES = 16, 25   # 400 generated streams
COUNTS: Counter[str] = Counter()
async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body, answers 200 with a JSON object."""
    assert scope["type"] == "http"
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})


@contextmanager
def uvicorn_server(protocol: type[Any]) -> Iterator[tuple[str, int]]:
    port = free_port()
    config = uvicorn.Config(echo_app, host="127.0.0.1", port=port, lifespan="off",
                            http=protocol, log_level="critical")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve()), daemon=True)
    thread.start()
    while not srv.started:
        assert thread.is_alive(), "uvicorn did not start"
        threading.Event().wait(0.05)
    yield "127.0.0.1", port
    srv.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int]]:
    with uvicorn_server(http_framing.FramingErrorProtocol) as address:
        yield address


def _run(server: tuple[str, int], streams: list[Stream], timeout_s: float = 10.0) -> list[str]:
    async def all_of() -> list[str]:
        answers = await asyncio.gather(*(exchange(*server, s, timeout_s) for s in streams))
        return [classify(s, a) for s, a in zip(streams, answers, strict=True)]
    return asyncio.run(all_of())


@pytest.mark.parametrize("stream", HAND_PICKED, ids=[s.label for s in HAND_PICKED])
def test_hand_picked_broken_framing(server: tuple[str, int], stream: Stream) -> None:
    [answer] = _run(server, [stream])
    assert as_expected(stream, answer), (stream.label, answer)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(streams=st.lists(framing_stream(), min_size=BATCH, max_size=BATCH))
def test_generated_broken_framing(server: tuple[str, int], streams: list[Stream]) -> None:
    # a short wait: a stream the server rightly waits on is counted "no answer" (allowed);
    # the server here serves nothing else, so every refusal comes at once
    COUNTS.update(_run(server, streams, timeout_s=3.0))


def test_counts_and_still_serving(server: tuple[str, int],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print(f"\nbroken framing (uvicorn alone): {sum(COUNTS.values())} streams "
              f"({', '.join(f'{k}: {n}' for k, n in sorted(COUNTS.items()))})")
    assert sum(COUNTS.values()) >= BATCH * EXAMPLES
    assert COUNTS["400"] > sum(COUNTS.values()) // 2, COUNTS
    valid = Stream((b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n"
                    b"Connection: close\r\n\r\n%s" % (len(JSON_BODY), JSON_BODY),), "valid")
    assert _run(server, [valid]) == ["200"]


def test_error_body_names_the_parsers_reason(server: tuple[str, int]) -> None:
    stream = Stream((b"GET /health HTTP/1.1\r\nHost: t\r\nBad Header\r\n\r\n",), "no colon")
    answer = asyncio.run(exchange(*server, stream))
    assert classify(stream, answer) == "400"
    body = answer.raw.partition(b"\r\n\r\n")[2]
    assert b"malformed HTTP request: " in body and b"header" in body.lower(), body
    assert b'"code": "malformed_http"' in body, body


def test_h11_fallback_answers_json_too() -> None:
    """Where httptools is missing uvicorn parses with h11: the same JSON 400."""
    streams = [s for s in HAND_PICKED if s.label in ("garbage", "header without colon",
                                                     "content-length letters")]
    with uvicorn_server(http_framing._H11FramingErrors) as address:
        assert _run(address, streams) == ["400"] * len(streams)


def test_serve_proxy_callback_installs_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    """The callback Serve is told to call (services.serve_config) resolves, adds no
    middleware, and installs the protocol."""
    from uvicorn import config as uvicorn_config

    from services.serve_config import HTTP_PROXY_CALLBACK

    monkeypatch.setitem(uvicorn_config.HTTP_PROTOCOLS, "auto",
                        uvicorn_config.HTTP_PROTOCOLS["auto"])
    module, _, name = HTTP_PROXY_CALLBACK.partition(":")
    assert getattr(importlib.import_module(module), name)() == []
    assert uvicorn_config.HTTP_PROTOCOLS["auto"] == http_framing.PROTOCOL_PATH


def test_install_points_uvicorn_auto_at_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    from uvicorn import config as uvicorn_config

    monkeypatch.setitem(uvicorn_config.HTTP_PROTOCOLS, "auto",
                        uvicorn_config.HTTP_PROTOCOLS["auto"])
    http_framing.install()
    http_framing.install()  # idempotent
    config = uvicorn.Config(echo_app, lifespan="off")
    config.load()
    assert config.http_protocol_class is http_framing.FramingErrorProtocol
