"""Broken HTTP/1.1 framing as raw byte streams, a raw-socket client, and the contract check.

The streams start from a valid request (a GET, a POST with a JSON body, a chunked POST) and
break one or more of its parts: the method (non-token or non-ASCII bytes), the request
target (control bytes, spaces, an oversized one), the version, a header (no colon, control
bytes, obsolete line folding, a space before the colon, an oversized one, too many), the
Content-Length (not a number, negative, huge, twice), Transfer-Encoding beside it, the
chunked body (a bad size, a missing CRLF, an overflowing size), the line endings, or the
end of the stream (cut short). Some streams stay valid by chance: they are counted, and
must be answered like any request.

``exchange`` sends one stream and reads what comes back until the server closes the
connection or ``timeout_s`` passes; ``classify`` checks the answer against the contract
(a 4xx carries an OpenAI error body, nothing is a 5xx) and names it for the counts.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass

from hypothesis import strategies as st

BIG = 80 * 1024  # beyond the server's bounds on the request target and head
JSON_BODY = b'{"model": "m", "prompt": "hi", "max_tokens": 1}'
STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3}) ")


@dataclass(frozen=True)
class Stream:
    """One connection's bytes; ``parts`` are sent one write each (a head split in two)."""

    parts: tuple[bytes, ...]
    label: str
    hang_up: bool = False  # half-close after the last part (a client that gave up)

    @property
    def data(self) -> bytes:
        return b"".join(self.parts)


@dataclass(frozen=True)
class Answer:
    raw: bytes
    timed_out: bool  # the server neither answered nor closed the connection in time


async def exchange(host: str, port: int, stream: Stream, timeout_s: float = 10.0) -> Answer:
    """Send ``stream``; what comes back until the server closes or ``timeout_s`` passes.
    The timeout only ends the wait for a request the server rightly waits on (its head or
    body incomplete), so it is long beside any answer's latency on a loaded machine."""
    reader, writer = await asyncio.open_connection(host, port)
    received = bytearray()
    timed_out = False
    try:
        for part in stream.parts:
            writer.write(part)
            await writer.drain()
        if stream.hang_up:
            writer.write_eof()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            left = deadline - loop.time()
            if left <= 0:
                timed_out = True
                break
            try:
                chunk = await asyncio.wait_for(reader.read(65536), left)
            except TimeoutError:
                timed_out = True
                break
            if not chunk:
                break
            received += chunk
            if _complete(bytes(received)):
                break
    except (ConnectionResetError, BrokenPipeError):
        pass  # refused while we were still writing: what was read so far is the answer
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionResetError, BrokenPipeError):
            pass
    return Answer(bytes(received), timed_out)


def classify(stream: Stream, answer: Answer) -> str:
    """The answer's name in the counts: its status, or ``closed`` (the server closed the
    connection without answering: allowed for a stream cut short) or ``no answer`` (it
    waited for more bytes of an incomplete request). Raises AssertionError for an answer
    that breaks the contract."""
    what = f"{stream.label}: {stream.data[:200]!r}"
    if not answer.raw:
        return "no answer" if answer.timed_out else "closed"
    match = STATUS_LINE.match(answer.raw)
    assert match, f"not an HTTP response for {what}: {answer.raw[:300]!r}"
    status = int(match.group(1))
    assert status < 500, f"{status} for {what}: {answer.raw[:500]!r}"
    if status >= 400:
        head, _, body = answer.raw.partition(b"\r\n\r\n")
        assert b"content-type: application/json" in head.lower(), (what, head)
        length = re.search(rb"(?i)content-length: (\d+)", head)
        if length:
            body = body[:int(length.group(1))]
        error = json.loads(body)["error"]
        assert set(error) >= {"message", "type", "param", "code"}, (what, error)
        assert isinstance(error["message"], str) and error["message"], (what, error)
        assert error["type"] == "invalid_request_error", (what, error)
    return str(status)


def _complete(raw: bytes) -> bool:
    """A whole response has arrived (keep-alive: no close follows): its Content-Length's
    bytes, or a chunked body's last chunk."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    length = re.search(rb"(?i)\r\ncontent-length: (\d+)", head)
    if length:
        return len(body) >= int(length.group(1))
    return b"transfer-encoding: chunked" in head.lower() and body.endswith(b"0\r\n\r\n")


# ---- the hand-picked streams ----------------------------------------------------------------
def _post(headers: bytes, body: bytes, path: bytes = b"/v1/completions") -> bytes:
    return b"POST " + path + b" HTTP/1.1\r\nHost: t\r\n" + headers + b"\r\n" + body


HAND_PICKED: tuple[Stream, ...] = tuple(Stream((data,), label) for label, data in (
    ("garbage", b"GARBAGE\r\n\r\n"),
    ("nul bytes", b"\x00" * 64),
    ("tls client hello", bytes.fromhex("16030100a1010000") + b"\x03\x03" + b"\x00" * 64),
    ("http/0.9", b"GET /health\r\n\r\n"),
    ("http/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    ("websocket upgrade", b"GET /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\n"
     b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"),
    ("h2c upgrade", b"GET /v1/models HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, HTTP2-Settings\r\n"
     b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n"),
    ("absolute target, other host", b"GET http://elsewhere.example/health HTTP/1.1\r\n"
     b"Host: t\r\nConnection: close\r\n\r\n"),
    ("asterisk target", b"OPTIONS * HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"),
    ("expect 100-continue, bad length", _post(b"Expect: 100-continue\r\nContent-Length: x\r\n", b"")),
    ("unknown version", b"GET /health HTTP/9.9\r\nHost: t\r\n\r\n"),
    ("version garbage", b"GET /health HTTX/1.1\r\nHost: t\r\n\r\n"),
    ("non-ascii method", "GÉT /health HTTP/1.1\r\nHost: t\r\n\r\n".encode()),
    ("lowercase method", b"get /health HTTP/1.1\r\nHost: t\r\n\r\n"),
    ("method with ctl", b"GE\x01T /health HTTP/1.1\r\nHost: t\r\n\r\n"),
    ("space in target", b"GET /he alth HTTP/1.1\r\nHost: t\r\n\r\n"),
    ("ctl in target", b"GET /\x7fhealth HTTP/1.1\r\nHost: t\r\n\r\n"),
    ("non-ascii target", b"GET /\xff\xfe HTTP/1.1\r\nHost: t\r\n\r\n"),
    ("header without colon", b"GET /health HTTP/1.1\r\nHost: t\r\nBad Header\r\n\r\n"),
    ("space before colon", b"GET /health HTTP/1.1\r\nHost : t\r\n\r\n"),
    ("nul in header value", b"GET /health HTTP/1.1\r\nHost: t\r\nX-A: a\x00b\r\n\r\n"),
    ("ctl in header name", b"GET /health HTTP/1.1\r\nHost: t\r\nX\x01A: b\r\n\r\n"),
    ("obs-fold", b"GET /health HTTP/1.1\r\nHost: t\r\nX-A: a\r\n b\r\n\r\n"),
    ("bare cr", b"GET /health HTTP/1.1\rHost: t\r\r"),
    ("content-length letters", _post(b"Content-Length: abc\r\n", JSON_BODY)),
    ("content-length negative", _post(b"Content-Length: -1\r\n", JSON_BODY)),
    ("content-length huge", _post(b"Content-Length: 99999999999999999999999\r\n", JSON_BODY)),
    ("content-length twice", _post(b"Content-Length: 5\r\nContent-Length: 7\r\n", JSON_BODY)),
    ("content-length and chunked",
     _post(b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", b"5\r\nhello\r\n0\r\n\r\n")),
    ("unknown transfer-encoding last",
     _post(b"Transfer-Encoding: chunked, gzip\r\n", JSON_BODY)),
    ("chunk size garbage", _post(b"Transfer-Encoding: chunked\r\n", b"zz\r\nhello\r\n0\r\n\r\n")),
    ("chunk size overflow",
     _post(b"Transfer-Encoding: chunked\r\n", b"ffffffffffffffffffff\r\nhello\r\n0\r\n\r\n")),
    ("chunk without crlf", _post(b"Transfer-Encoding: chunked\r\n", b"5\r\nhelloXX0\r\n\r\n")),
    ("chunk negative", _post(b"Transfer-Encoding: chunked\r\n", b"-5\r\nhello\r\n0\r\n\r\n")),
    ("oversized target", b"GET /" + b"a" * BIG + b" HTTP/1.1\r\nHost: t\r\n\r\n"),
    ("oversized header", b"GET /health HTTP/1.1\r\nHost: t\r\nX-A: " + b"a" * BIG + b"\r\n\r\n"),
    ("too many headers",
     b"GET /health HTTP/1.1\r\nHost: t\r\n" + b"X-A: b\r\n" * (BIG // 8) + b"\r\n"),
)) + tuple(Stream((data,), label, hang_up=True) for label, data in (
    ("cut in request line", b"GET /heal"),
    ("cut in headers", b"GET /health HTTP/1.1\r\nHost: t\r\nX-A:"),
    ("cut in body", _post(b"Content-Length: 100\r\n", b'{"model"')),
)) + (
    # the same without hanging up: the server waits for the rest (no answer in time)
    Stream((b"GET /health HTTP/1.1\r\nHost: t\r\nX-A:",), "incomplete head"),
    # an unending header line, sent in pieces: the bound must hold across reads
    Stream((b"GET /health HTTP/1.1\r\nX-A: ",) + (b"a" * 16384,) * 6, "unending header"),
)


# what each hand-picked stream gets: a 400 unless named here; "served" for a stream that is
# a valid request after all, answered by the app (any status below 500)
_EXPECTED = {"http/0.9": "served",  # a simple request of HTTP/0.9
             "h2c upgrade": "served", "websocket upgrade": "served",  # as plain requests
             "absolute target, other host": "served",
             "oversized target": "414", "oversized header": "431", "too many headers": "431",
             "unending header": "431", "cut in request line": "closed",
             "cut in headers": "closed", "cut in body": "closed", "incomplete head": "no answer"}


def as_expected(stream: Stream, answer: str) -> bool:
    """Whether ``answer`` (``classify``'s) is what the hand-picked ``stream`` should get."""
    want = _EXPECTED.get(stream.label, "400")
    return answer.isdigit() if want == "served" else answer == want


# ---- the generated streams ------------------------------------------------------------------
_TOKEN = st.sampled_from([b"GET", b"POST", b"PUT", b"HEAD"])
_BAD_BYTES = st.binary(min_size=1, max_size=12)
_CTL = st.sampled_from([b"\x00", b"\x01", b"\x7f", b"\r", b"\n", b" ", b"\t", b"\xff",
                        "é".encode(), b"\x1b[31m", b"(", b":"])
_EOL = st.sampled_from([b"\r\n", b"\n", b"\r", b"\r\r\n", b"\n\r"])
_PATHS = st.sampled_from([b"/health", b"/livez", b"/v1/completions", b"/v1/models", b"*",
                          b"http://t/health", b"//", b"/%zz", b"/%00"])
_VERSIONS = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.12", b"HTTP/1",
                             b"http/1.1", b"HTTP/", b"", b"HTTP/1.1 x"])
_LENGTHS = st.one_of(
    st.sampled_from([b"", b"-1", b"+5", b"0x10", b" 5", b"5 5", b"1e3", b"5,5",
                     b"99999999999999999999999", b"\xff"]),
    st.integers(0, 10**30).map(lambda n: str(n).encode()),
    st.binary(max_size=8))
_CHUNK_SIZES = st.one_of(st.sampled_from([b"zz", b"-1", b"", b"5;ext=\x00", b"fffffffffffffffffff",
                                          b"0x5", b" 5", b"5 "]),
                         st.binary(max_size=6))


@st.composite
def framing_stream(draw: st.DrawFn) -> Stream:
    """A request broken at one or more places of its framing (see the module docstring)."""
    method = draw(_TOKEN)
    path = draw(_PATHS)
    version = b"HTTP/1.1"
    headers = [(b"Host", b"t"), (b"Connection", b"close")]
    body = b""
    kind = draw(st.sampled_from(["length", "chunked", "none"]))
    if kind == "length":
        body = JSON_BODY
        headers += [(b"Content-Type", b"application/json"),
                    (b"Content-Length", str(len(body)).encode())]
    elif kind == "chunked":
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(JSON_BODY), JSON_BODY)
        headers += [(b"Content-Type", b"application/json"), (b"Transfer-Encoding", b"chunked")]
    eol = b"\r\n"
    labels = []
    for fault in draw(st.lists(st.sampled_from(
            ["method", "path", "version", "header", "length", "te", "chunk", "eol", "cut",
             "big", "random"]), min_size=1, max_size=3, unique=True)):
        labels.append(fault)
        if fault == "method":
            method = draw(st.one_of(_BAD_BYTES, st.text(min_size=1, max_size=6).map(str.encode)))
        elif fault == "path":
            at = draw(st.integers(0, len(path)))
            path = path[:at] + draw(_CTL) + path[at:]
        elif fault == "version":
            version = draw(st.one_of(_VERSIONS, _BAD_BYTES))
        elif fault == "header":
            name = draw(st.one_of(st.sampled_from([b"X-A", b"X A", b"X-A ", b"", b"X\x00A"]),
                                  _BAD_BYTES))
            value = draw(st.one_of(_CTL.map(lambda c: b"a" + c + b"b"), _BAD_BYTES))
            headers.insert(draw(st.integers(0, len(headers))), (name, value))
        elif fault == "length":
            headers += [(b"Content-Length", draw(_LENGTHS))]
        elif fault == "te":
            headers += [(b"Transfer-Encoding",
                         draw(st.sampled_from([b"chunked", b"gzip", b"chunked, gzip",
                                               b"identity", b"chunked\x00", b"xchunked"])))]
        elif fault == "chunk":
            if kind != "chunked":
                headers += [(b"Transfer-Encoding", b"chunked")]
            body = draw(_CHUNK_SIZES) + b"\r\n" + JSON_BODY + b"\r\n0\r\n\r\n"
        elif fault == "eol":
            eol = draw(_EOL)
        elif fault == "big":
            where = draw(st.sampled_from(["path", "header", "headers"]))
            if where == "path":
                path = b"/" + b"a" * BIG
            elif where == "header":
                headers += [(b"X-Big", b"a" * BIG)]
            else:
                headers += [(b"X-A", b"b")] * (BIG // 8)
    head = b" ".join((method, path, version)) + eol
    head += b"".join(name + b": " + value + eol for name, value in headers) + eol
    data = head + body
    if "cut" in labels:
        data = data[:draw(st.integers(0, max(len(data) - 1, 0)))]
    if "random" in labels:
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=32)) + data[at:]
    return Stream((data,), "+".join(labels), hang_up="cut" in labels)
