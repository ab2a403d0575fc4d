"""Hypothesis strategies for hostile requests to the served APIs.

HTTP: OpenAI JSON bodies for /v1/completions and /v1/chat/completions, each a valid
request with a few fields replaced, dropped or added (wrong types at any depth, numbers
past every range, NaN and Infinity, lone surrogate escapes, control characters), then
sometimes broken at the byte level (invalid UTF-8, truncation, UTF-16, a byte-order mark,
deep nesting, an oversized body, random bytes), sent with a content type that may be
wrong. gRPC: ``GenerateRequest`` messages with any field values the wire allows, then
sometimes broken on the wire (invalid UTF-8 in a string field, a field of the wrong wire
type, a truncated message, an over-long varint, a length past the end, deeply nested
groups, random bytes).

Many generated requests are refused; some happen to be valid. Either is fine: what the
fuzz test asserts is the kind of answer (no 5xx, an OpenAI error body for every 4xx).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from services.router import detserve_pb2 as pb

MODEL = "\x00MODEL\x00"  # replaced by the served model's id when the body is written
INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class Raw:
    """A JSON fragment written as is: numbers Python cannot print or json refuses."""

    text: str


def to_json(value: Any, model: str) -> str:
    """``value`` as JSON text (ASCII: lone surrogates become ``\\udXXX`` escapes, NaN and
    infinities json's extensions), with ``MODEL`` replaced by ``model``."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        items = (f"{json.dumps(model if k == MODEL else k)}:{to_json(v, model)}"
                 for k, v in value.items())
        return "{" + ",".join(items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(to_json(v, model) for v in value) + "]"
    return json.dumps(model if value == MODEL else value)


# ---- values -------------------------------------------------------------------------------
LONE_SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\udc80b", "\ud83d", "x\ude00y",
                                   "\udbff\udbff"])
ODD_TEXT = st.sampled_from(["", " ", "\x00", "\x00\x01\x1f\x7f", "\ufeff", "\uffff", "\ufffe",
                            "\U0010ffff", "\u202e\u200b", "\U0001f642" * 40, "\r\n\t",
                            "<|im_start|>", "<|endoftext|>", "{{ raise_exception('x') }}",
                            "%s%n%x", "../../etc/passwd", "x" * 5000, "é" * 3000])
UNICODE_TEXT = st.text(max_size=24)  # any code point but surrogates
TEXT = st.one_of(UNICODE_TEXT, ODD_TEXT, LONE_SURROGATES)
PROTO_TEXT = st.one_of(UNICODE_TEXT, ODD_TEXT)  # protobuf strings hold no surrogates

EXTREME_INTS = st.sampled_from([0, -1, 1, 2, 21, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64,
                                -(2**63), -(2**64), 10**30, 10**300])
INTS = st.one_of(st.integers(-4, 300), EXTREME_INTS)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 0.5, 1.0, 1.0000001, 2.0001,
                                    100.5, 1e308, -1e308]))
RAW_NUMBERS = st.sampled_from(["NaN", "-NaN", "Infinity", "-Infinity", "1e400", "-1e400",
                               "1e-400", "9" * 5000, "-" + "9" * 5000, "1" + "0" * 4299,
                               "0." + "0" * 400 + "1", "1E+2", "-0", "01", "1.", ".5",
                               "0x10", "+1", "1e", "true1"]).map(Raw)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, RAW_NUMBERS, TEXT)
ANY_JSON = st.recursive(
    SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=8)
# values that reach far into validation: right types, wrong values, wrong types
VALUES = st.one_of(SCALARS, ANY_JSON)

VALID_ROLES = st.sampled_from(["system", "user", "assistant", "tool"])
ROLES = st.one_of(VALID_ROLES, st.sampled_from(["developer", "function", "USER", " user", ""]),
                  TEXT, ANY_JSON)
PART = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio", "TEXT"]),
                           "text": st.one_of(TEXT, ANY_JSON)},
                          optional={"image_url": ANY_JSON, "extra": ANY_JSON}),
    ANY_JSON)
CONTENT = st.one_of(TEXT, LONE_SURROGATES, st.lists(PART, max_size=3), ANY_JSON)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": VALID_ROLES, "content": CONTENT}),  # hostile content only
    st.fixed_dictionaries({"role": ROLES, "content": CONTENT},
                          optional={"name": st.one_of(TEXT, ANY_JSON), "tool_calls": ANY_JSON}),
    st.fixed_dictionaries({}, optional={"role": ROLES, "content": CONTENT}),
    ANY_JSON)
MESSAGES = st.one_of(st.lists(MESSAGE, max_size=4), ANY_JSON,
                     st.just([{"role": "user", "content": "hi"}] * 300))
BIAS_KEYS = st.one_of(st.sampled_from(["5", " 5 ", "-1", "²", "٣", "5.0", "1e3", "0x5", "",
                                       "1" * 5000, "99999999999999999999", "\ud800"]),
                      TEXT, st.integers(-5, 10**6).map(str))
PROMPT = st.one_of(
    TEXT, TEXT, LONE_SURROGATES,
    st.lists(TEXT, max_size=10),
    st.lists(INTS, max_size=10),
    st.lists(st.lists(INTS, max_size=4), max_size=10),
    st.lists(st.one_of(TEXT, INTS, st.lists(SCALARS, max_size=3)), max_size=5),
    st.just([7] * 200), st.just([[]]), st.just(["a"] * 9),
    ANY_JSON)

COMMON_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.just(MODEL), TEXT, ANY_JSON, st.just("x" * 60000)),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=6), ANY_JSON),
    "logit_bias": st.one_of(st.dictionaries(BIAS_KEYS, st.one_of(FLOATS, INTS, RAW_NUMBERS,
                                                                 VALUES), max_size=4),
                            ANY_JSON),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": VALUES}), ANY_JSON),
    "seed": VALUES, "n": VALUES, "temperature": VALUES, "top_p": VALUES, "top_k": VALUES,
    "stream": VALUES, "user": VALUES, "presence_penalty": VALUES,
    "frequency_penalty": VALUES, "is_deterministic": VALUES, "min_tokens": VALUES,
    "ignore_eos": VALUES, "skip_special_tokens": VALUES, "max_tokens": VALUES,
}
COMPLETION_FIELDS = {**COMMON_FIELDS, "prompt": PROMPT, "logprobs": VALUES, "echo": VALUES,
                     "suffix": VALUES, "best_of": VALUES}
CHAT_FIELDS = {**COMMON_FIELDS, "messages": MESSAGES, "max_completion_tokens": VALUES,
               "logprobs": VALUES, "top_logprobs": VALUES, "tools": VALUES,
               "tool_choice": VALUES, "response_format": st.one_of(
                   st.fixed_dictionaries({"type": VALUES}), VALUES)}
COMPLETION_BASE = {"model": MODEL, "prompt": "hello there", "max_tokens": 2}
CHAT_BASE = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any],
            fields: dict[str, st.SearchStrategy[Any]]) -> dict[str, Any]:
    """``base`` with 1-3 fields replaced, some fields dropped, maybe unknown ones added."""
    body = dict(base)
    # the fields that reach the tokenizer, the chat template and error messages most often
    names = sorted(fields) + [n for n in ("prompt", "messages", "model", "stop", "logit_bias")
                              if n in fields] * 4
    for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)):
        body[name] = draw(fields[name])
    for name in draw(st.sets(st.sampled_from(sorted(base)), max_size=1)):
        body.pop(name, None)
    body.update(draw(st.dictionaries(TEXT, VALUES, max_size=1)))
    return body


# ---- HTTP bodies and headers ----------------------------------------------------------------
BAD_UTF8 = st.sampled_from([b"\xff", b"\xfe\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82",
                            b"\xf8\x88\x80\x80\x80", b"\x80", b"\xf4\x90\x80\x80"])
CONTENT_TYPES = st.sampled_from(
    ["application/json"] * 48 + [None, "application/json; charset=utf-8", "APPLICATION/JSON",
                                 "application/vnd.api+json", "text/plain", "text/json",
                                 "application/x-www-form-urlencoded",
                                 "multipart/form-data; boundary=x",
                                 "application/json; charset=utf-16", "application/xml", "*/*",
                                 "", "application/jsonx", "json"])


@dataclass(frozen=True)
class HttpCase:
    method: str
    path: str
    content_type: str | None
    body: bytes


@st.composite
def http_case(draw: st.DrawFn, path: str, base: dict[str, Any],
              fields: dict[str, st.SearchStrategy[Any]], model: str, max_body: int) -> HttpCase:
    text = to_json(draw(mutated(base, fields)), model)
    data = text.encode("utf-8")
    form = draw(st.sampled_from(["as_is"] * 12 + ["bad_utf8", "truncate", "random", "utf16",
                                                 "bom", "deep", "oversize", "not_object",
                                                 "surrogate_key"]))
    if form == "bad_utf8":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(BAD_UTF8) + data[at:]
    elif form == "truncate":
        data = data[:draw(st.integers(0, max(0, len(data) - 1)))]
    elif form == "random":
        data = draw(st.binary(max_size=64))
    elif form == "utf16":
        data = text.encode(draw(st.sampled_from(["utf-16", "utf-16-le", "utf-32"])))
    elif form == "bom":
        data = b"\xef\xbb\xbf" + data
    elif form == "deep":
        depth = draw(st.sampled_from([50, 900, 1100, 20000]))
        nest = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        data = (text[:-1] + ', "prompt": ' + nest[0] * depth + "1" + nest[1] * depth
                + "}").encode()
    elif form == "oversize":
        data = (text[:-1] + ', "pad": "' + "x" * max_body + '"}').encode()
    elif form == "not_object":
        data = draw(st.sampled_from([b"[1, 2]", b"null", b'"text"', b"1", b"true", b"[]",
                                     b"NaN", b" ", b"{}", b"{\"model\": null}"]))
    elif form == "surrogate_key":
        data = (text[:-1] + ', "\\ud800": 1}').encode()
    method = draw(st.sampled_from(["POST"] * 60 + ["GET", "PUT", "DELETE", "PATCH"]))
    suffix = draw(st.sampled_from([""] * 60 + ["/", "?stream=true", "x", "/%00"]))
    return HttpCase(method, path + suffix, draw(CONTENT_TYPES), data)


# ---- gRPC messages --------------------------------------------------------------------------
PROTO_INTS = st.one_of(st.integers(-4, 300), st.integers(*INT64),
                       st.sampled_from([INT64[0], INT64[1], 2**31, 2**53 + 1]))
PROTO_FLOATS = FLOATS


@st.composite
def generate_request(draw: st.DrawFn, model: str) -> pb.GenerateRequest:
    """Any ``GenerateRequest`` the wire can carry; most of them are not valid requests."""
    req = pb.GenerateRequest(max_tokens=2)
    source = draw(st.sampled_from(["prompt", "prompt_token_ids", "messages", "none", "all"]))
    if source in ("prompt", "all"):
        req.prompt = draw(st.one_of(st.just("hello there"), PROTO_TEXT))
    if source in ("prompt_token_ids", "all"):
        req.prompt_token_ids.extend(draw(st.lists(PROTO_INTS, max_size=8)))
    if source in ("messages", "all"):
        roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), PROTO_TEXT)
        for role, content in draw(st.lists(st.tuples(roles, PROTO_TEXT), max_size=4)):
            req.messages.add(role=role, content=content)
    optional: dict[str, st.SearchStrategy[Any]] = {
        "request_id": PROTO_TEXT, "model": st.one_of(st.just(model), PROTO_TEXT,
                                                     st.just("m" * 60000)),
        "max_tokens": PROTO_INTS, "top_k": PROTO_INTS, "seed": PROTO_INTS,
        "logprobs": PROTO_INTS, "min_tokens": PROTO_INTS, "temperature": PROTO_FLOATS,
        "top_p": PROTO_FLOATS, "presence_penalty": PROTO_FLOATS,
        "frequency_penalty": PROTO_FLOATS, "is_deterministic": st.booleans(),
        "ignore_eos": st.booleans(), "echo": st.booleans()}
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True)):
        setattr(req, name, draw(optional[name]))
    req.stop.extend(draw(st.lists(PROTO_TEXT, max_size=6)))
    req.logit_bias.update(draw(st.dictionaries(PROTO_INTS, PROTO_FLOATS, max_size=3)))
    return req


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + payload


def _string_field(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


@st.composite
def wire_damage(draw: st.DrawFn) -> bytes:
    """Bytes that break a message when appended to it (or stand alone)."""
    kind = draw(st.sampled_from(["bad_utf8", "bad_utf8_nested", "wire_type", "long_varint",
                                 "past_end", "groups", "random", "zero_tag"]))
    if kind == "bad_utf8":  # request_id, prompt, model, stop: strings
        return _string_field(draw(st.sampled_from([1, 2, 5, 13])),
                             b"ok" + draw(BAD_UTF8) + b"ok")
    if kind == "bad_utf8_nested":  # a ChatMessage whose role or content is not UTF-8
        inner = _string_field(draw(st.sampled_from([1, 2])), draw(BAD_UTF8))
        return _string_field(4, inner)
    if kind == "wire_type":  # a known field with the wrong wire type (or a bad one)
        number = draw(st.sampled_from([2, 4, 6, 7, 11, 16]))
        wire = draw(st.sampled_from([0, 1, 2, 5, 6, 7]))
        return _field(number, wire, draw(st.binary(min_size=0, max_size=9)))
    if kind == "long_varint":
        return _field(6, 0, b"\xff" * 10 + b"\x01")
    if kind == "past_end":
        return _field(2, 2, _varint(draw(st.sampled_from([10, 2**31, 2**40]))) + b"abc")
    if kind == "groups":  # nested start-group tags past protobuf's recursion limit
        return _field(99, 3, b"") * draw(st.sampled_from([50, 200, 5000]))
    if kind == "zero_tag":
        return b"\x00" + draw(st.binary(max_size=4))
    return draw(st.binary(max_size=48))


@dataclass(frozen=True)
class GrpcCase:
    method: str  # "Generate" | "Health"
    data: bytes


@st.composite
def grpc_case(draw: st.DrawFn, model: str, max_body: int) -> GrpcCase:
    data = draw(generate_request(model)).SerializeToString()
    form = draw(st.sampled_from(["as_is"] * 8 + ["damaged"] * 3 + ["truncated", "oversize",
                                                                    "health"]))
    if form == "damaged":
        at = draw(st.sampled_from([0, len(data)]))
        data = data[:at] + draw(wire_damage()) + data[at:]
    elif form == "truncated" and data:
        data = data[:draw(st.integers(0, len(data) - 1))]
    elif form == "oversize":
        data += _string_field(13, b"s" * max_body)
    elif form == "health":
        return GrpcCase("Health", draw(st.one_of(st.just(b""), wire_damage())))
    return GrpcCase("Generate", data)
