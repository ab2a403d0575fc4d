"""The one place that converts link messages (``proto/link.proto``) to and from protobuf.

A link frame is parsed into typed messages and validated, never executed: bytes that are
not a ``RouterFrames`` / ``DecoderChunks`` message raise ``FrameError`` (the link server
ends that stream with INVALID_ARGUMENT); a submit whose fields are well-formed protobuf
but not a valid request becomes ``Refused`` (its request is answered with an error chunk,
the stream goes on). Round trips are exact (floats travel as doubles, top-logprob order is
kept, ``None`` stays ``None``): ``tests/test_decoder_link.py`` checks them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError, Message

from detserve.outputs import TokenLogprob
from detserve.params import SamplingParams
from services.decoder import link_pb2 as pb
from services.decoder.messages import DecodeChunk, DecodeRequest

MAX_REQUEST_ID = 256  # characters of a request id (the router's are far shorter)
# SamplingParams fields that do not travel: ``extra`` is the caller's own scratch space
LOCAL_FIELDS = ("extra",)
M = TypeVar("M", pb.RouterFrames, pb.DecoderChunks)


class FrameError(ValueError):
    """The bytes are not a link message of the expected kind."""


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Refused:
    """A submit that parsed but is not a valid request; ``error`` says why."""

    request_id: str
    error: str


Frame = DecodeRequest | Abort | Refused


# ---- router -> decoder ----------------------------------------------------------------
def encode_submit(request: DecodeRequest) -> pb.RouterFrame:
    """Raises ValueError when a field does not fit its protobuf type (an id out of int64)."""
    p = request.params
    bias = p.logit_bias_pairs
    try:
        params = pb.Sampling(
            max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
            seed=p.seed, is_deterministic=p.is_deterministic, stop=p.stop,
            stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos, logprobs=p.logprobs,
            prompt_logprobs=p.prompt_logprobs, min_tokens=p.min_tokens,
            has_logit_bias=p.logit_bias is not None, bias_ids=[t for t, _ in bias],
            bias_values=[b for _, b in bias], presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, skip_special_tokens=p.skip_special_tokens,
            output_kind=p.output_kind)
        return pb.RouterFrame(submit=pb.Submit(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            params=params, accepted=request.accepted, dispatched=request.dispatched,
            avoid=request.avoid))
    except (TypeError, ValueError) as e:  # protobuf's range and type checks
        raise ValueError(f"request {request.request_id!r} cannot be sent: {e}") from e


def encode_abort(request_id: str) -> pb.RouterFrame:
    return pb.RouterFrame(abort=request_id)


def encode_frames(frames: Iterable[pb.RouterFrame]) -> bytes:
    return pb.RouterFrames(frames=frames).SerializeToString()


def decode_frames(data: bytes) -> list[Frame]:
    message = _parse(pb.RouterFrames, data)
    out: list[Frame] = []
    for frame in message.frames:
        kind = frame.WhichOneof("kind")
        _known_fields_only(frame)
        if kind == "submit":
            _known_fields_only(frame.submit, frame.submit.params)
            out.append(_decode_submit(frame.submit))
        elif kind == "abort":
            out.append(Abort(_request_id(frame.abort)))
        else:
            raise FrameError("a frame with neither a submit nor an abort")
    return out


def _decode_submit(m: pb.Submit) -> DecodeRequest | Refused:
    rid = _request_id(m.request_id)
    s = m.params
    if len(s.bias_ids) != len(s.bias_values):
        return Refused(rid, "logit bias ids and values differ in number")
    try:
        params = SamplingParams(
            max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            seed=s.seed if s.HasField("seed") else None, is_deterministic=s.is_deterministic,
            stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            logprobs=s.logprobs if s.HasField("logprobs") else None,
            prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
            min_tokens=s.min_tokens,
            logit_bias=(dict(zip(s.bias_ids, s.bias_values, strict=True))
                        if s.has_logit_bias else None),
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
            skip_special_tokens=s.skip_special_tokens, output_kind=s.output_kind)
    except ValueError as e:
        return Refused(rid, f"invalid sampling parameters: {e}")
    if not m.prompt_token_ids:
        return Refused(rid, "the prompt has no tokens")
    return DecodeRequest(rid, tuple(m.prompt_token_ids), params, accepted=m.accepted,
                         dispatched=m.dispatched, avoid=tuple(m.avoid))


def _request_id(rid: str) -> str:
    if not rid or len(rid) > MAX_REQUEST_ID:
        raise FrameError(f"a request id must have 1 to {MAX_REQUEST_ID} characters")
    return rid


# ---- decoder -> router ----------------------------------------------------------------
def encode_chunks(chunks: Sequence[DecodeChunk]) -> bytes:
    return pb.DecoderChunks(chunks=[_encode_chunk(c) for c in chunks]).SerializeToString()


def decode_chunks(data: bytes) -> list[DecodeChunk]:
    return [_decode_chunk(c) for c in _parse(pb.DecoderChunks, data).chunks]


def _encode_chunk(c: DecodeChunk) -> pb.Chunk:
    prompt = c.prompt_logprobs or ()
    return pb.Chunk(
        request_id=c.request_id, replica=c.replica, text=c.text, token_ids=c.token_ids,
        has_logprobs=c.logprobs is not None, logprobs=[_lp(p) for p in c.logprobs or ()],
        finished=c.finished, finish_reason=c.finish_reason,
        num_prompt_tokens=c.num_prompt_tokens, num_output_tokens=c.num_output_tokens,
        determinism_json=(None if c.determinism is None
                          else json.dumps(dict(c.determinism), sort_keys=True)),
        error=c.error, error_type=c.error_type, engine_stats=dict(c.engine_stats),
        has_prompt_logprobs=c.prompt_logprobs is not None,
        prompt_logprobs=[pb.PromptLogprob(value=None if p is None else _lp(p))
                         for p in prompt])


def _decode_chunk(m: pb.Chunk) -> DecodeChunk:
    determinism: Mapping[str, object] | None = None
    if m.HasField("determinism_json"):
        try:
            determinism = json.loads(m.determinism_json)
        except ValueError as e:
            raise FrameError(f"a determinism profile that is not JSON: {e}") from e
        if not isinstance(determinism, dict):
            raise FrameError("a determinism profile that is not a JSON object")
    return DecodeChunk(
        m.request_id, m.replica, text=m.text, token_ids=tuple(m.token_ids),
        logprobs=tuple(_token_lp(p) for p in m.logprobs) if m.has_logprobs else None,
        finished=m.finished,
        finish_reason=m.finish_reason if m.HasField("finish_reason") else None,
        num_prompt_tokens=m.num_prompt_tokens, num_output_tokens=m.num_output_tokens,
        determinism=determinism, error=m.error if m.HasField("error") else None,
        error_type=m.error_type if m.HasField("error_type") else None,
        engine_stats=dict(m.engine_stats),
        prompt_logprobs=(tuple(_token_lp(p.value) if p.HasField("value") else None
                               for p in m.prompt_logprobs)
                         if m.has_prompt_logprobs else None))


def _lp(p: TokenLogprob) -> pb.Logprob:
    return pb.Logprob(token_id=p.token_id, logprob=p.logprob, top_ids=list(p.top),
                      top_logprobs=list(p.top.values()))


def _token_lp(m: pb.Logprob) -> TokenLogprob:
    if len(m.top_ids) != len(m.top_logprobs):
        raise FrameError("top logprob ids and values differ in number")
    return TokenLogprob(m.token_id, m.logprob, dict(zip(m.top_ids, m.top_logprobs, strict=True)))


def _parse(kind: type[M], data: bytes) -> M:
    message = kind()
    try:
        message.ParseFromString(data)
    except (DecodeError, ValueError) as e:  # ValueError: a string field not UTF-8
        raise FrameError(f"not a {kind.__name__} message: {e}") from e
    _known_fields_only(message)
    return message


def _known_fields_only(*messages: Message) -> None:
    """Refuse fields this side does not know: bytes that merely happen to parse (protobuf
    keeps unknown fields) are not a message of ours. Both ends are built from one
    ``link.proto``."""
    for m in messages:
        if len(unknown_fields.UnknownFieldSet(m)):
            raise FrameError(f"unknown fields in a {type(m).__name__} message")
