"""Validated OpenAI request -> ``Job``: the decoder requests to run, one per choice.

Everything that can be refused is refused here, before any decoder sees the request:
unknown model, unsupported features, prompt and output lengths, sampling values (via
``SamplingParams``), contradictory determinism asks. Errors are ``APIError``s (HTTP 4xx)
naming the offending field.

Whether a request is deterministic is asked in one of four ways (the ``source`` label of
``detserve:determinism_requests_total``): the body's ``is_deterministic`` field, the
``X-Detserve-Deterministic`` header (gRPC: metadata of that name), the model's
deterministic name (``smollm2:deterministic``), or, when none of them says, the server's
default. Asks that disagree are refused.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from detserve.params import SamplingParams
from services.decoder.messages import DecodeRequest
from services.router.errors import APIError, excerpt, invalid
from services.router.limits import ServingLimits
from services.router.model_context import ModelContext
from services.router.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

R = TypeVar("R", bound=SamplingFields)

DETERMINISM_HEADER = "X-Detserve-Deterministic"
# the seed of a deterministic request that sends none; choice i of a request samples with
# seed + i (mod 2**63), so the choices differ and each stays reproducible
DEFAULT_SEED = 0
_SEED_SPACE = 2**63
_FLAGS = {"true": True, "1": True, "false": False, "0": False}
_SOURCE_NAMES = {"field": "is_deterministic", "header": DETERMINISM_HEADER,
                 "alias": "the model name"}


@dataclass(frozen=True)
class Job:
    """One client request: ``choices[i]`` produces the choice with index i."""

    id: str
    kind: str                                  # "completion" | "chat"
    model: str
    choices: tuple[DecodeRequest, ...]
    stream: bool
    include_usage: bool
    top_logprobs: int | None                   # None: no logprobs requested
    is_deterministic: bool
    n: int = 1                                 # choices per prompt
    # how ``is_deterministic`` was decided: one of ``metrics.DETERMINISM_SOURCES``
    determinism_source: str = "default"
    # completions with ``echo``: each choice's prompt text, sent before its output (and,
    # with logprobs, its prompt tokens' logprobs before the output's)
    echo: tuple[str, ...] = ()

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens, each prompt counted once (not once per choice)."""
        return sum(len(c.prompt_token_ids) for c in self.choices[::self.n])

    def accepted_at(self, accepted: float) -> Job:
        """This job with the time (monotonic) its request reached the router's handler on
        every choice (``DecodeRequest.accepted``)."""
        return replace(self, choices=tuple(replace(c, accepted=accepted) for c in self.choices))


def check_model(name: str, ctx: ModelContext) -> None:
    if not ctx.serves(name):
        raise APIError(404, f"The model `{excerpt(name)}` does not exist.", param="model",
                       code="model_not_found")


def parse_determinism_header(value: str | None) -> bool | None:
    """The ``X-Detserve-Deterministic`` header's value: None when absent."""
    if value is None:
        return None
    flag = _FLAGS.get(value.strip().lower())
    if flag is None:
        raise invalid(f"{DETERMINISM_HEADER} must be true or false, got {value!r}",
                      param=DETERMINISM_HEADER)
    return flag


def resolve_determinism(req: SamplingFields, ctx: ModelContext,
                        header: bool | None = None) -> tuple[bool, str]:
    """``(deterministic, source)`` of a request; 400 when its asks disagree."""
    asked: list[tuple[str, bool]] = []
    if "is_deterministic" in req.model_fields_set:
        asked.append(("field", req.is_deterministic))
    if header is not None:
        asked.append(("header", header))
    if ctx.names_deterministic(req.model):
        asked.append(("alias", True))
    if len({value for _, value in asked}) > 1:
        said = ", ".join(f"{_SOURCE_NAMES[s]} says {str(v).lower()}" for s, v in asked)
        raise invalid(f"contradictory determinism: {said}", param="is_deterministic",
                      code="determinism_conflict")
    if asked:
        source, value = asked[0]
        return value, source
    return ctx.deterministic_by_default, "default"


def _with_determinism(req: R, ctx: ModelContext, header: bool | None) -> tuple[R, str]:
    """``req`` with ``is_deterministic`` resolved, and what decided it."""
    on, source = resolve_determinism(req, ctx, header)
    return req.model_copy(update={"is_deterministic": on}), source


def prepare_completion(req: CompletionRequest, ctx: ModelContext,
                       limits: ServingLimits, header: bool | None = None) -> Job:
    """``header``: the parsed ``X-Detserve-Deterministic`` (None: absent)."""
    check_model(req.model, ctx)
    req, source = _with_determinism(req, ctx, header)
    _check_common(req, limits)
    prompts = completion_prompts(req.prompt, ctx, limits)
    if len(prompts) * req.n > limits.max_choices:
        raise invalid(f"n x prompts must be <= {limits.max_choices}", param="n")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise invalid("logprobs must be in [0, 20]", param="logprobs")
    job_id = f"cmpl-{uuid.uuid4().hex}"
    # echo with logprobs: the prompt tokens' logprobs too (loglikelihood scoring)
    prompt_lps = req.logprobs if req.echo else None
    choices = [decode_request(f"{job_id}-{p * req.n + i}", ids, req,
                              req.max_tokens, req.logprobs, ctx, i, prompt_lps)
               for p, ids in enumerate(prompts) for i in range(req.n)]
    job = _job(job_id, "completion", req, choices, req.logprobs, source)
    if not req.echo:
        return job
    texts = [item if isinstance(item, str) else ctx.tokenizer.decode(ids)
             for item, ids in zip(_prompt_items(req.prompt), prompts, strict=True)]
    return replace(job, echo=tuple(t for t in texts for _ in range(req.n)))


def prepare_chat(req: ChatCompletionRequest, ctx: ModelContext, limits: ServingLimits,
                 header: bool | None = None) -> Job:
    check_model(req.model, ctx)
    req, source = _with_determinism(req, ctx, header)
    _check_common(req, limits)
    ids = chat_prompt(req, ctx, limits)
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs needs logprobs=true", param="top_logprobs")
    top = (req.top_logprobs or 0) if req.logprobs else None
    if top is not None and not 0 <= top <= 20:
        raise invalid("top_logprobs must be in [0, 20]", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    job_id = f"chatcmpl-{uuid.uuid4().hex}"
    choices = [decode_request(f"{job_id}-{i}", ids, req, max_tokens, top, ctx, i)
               for i in range(req.n)]
    return _job(job_id, "chat", req, choices, top, source)


def _job(job_id: str, kind: str, req: SamplingFields, choices: list[DecodeRequest],
         top: int | None, source: str) -> Job:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return Job(job_id, kind, req.model, tuple(choices), req.stream, include_usage, top,
               req.is_deterministic, req.n, determinism_source=source)


def _check_common(req: SamplingFields, limits: ServingLimits) -> None:
    bad = req.unsupported()
    if bad:
        raise invalid(f"unsupported parameter: {bad[0]}", param=bad[0], code="unsupported")
    if not 1 <= req.n <= limits.max_n:
        raise invalid(f"n must be in [1, {limits.max_n}]", param="n")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options is only allowed with stream=true", param="stream_options")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > limits.max_stop:
        raise invalid(f"at most {limits.max_stop} stop sequences", param="stop")
    if any(len(s) > limits.max_stop_chars for s in stops):
        raise invalid(f"stop sequences must be <= {limits.max_stop_chars} chars", param="stop")


def completion_prompts(prompt: str | list, ctx: ModelContext,
                       limits: ServingLimits) -> list[list[int]]:
    """Token ids of each prompt of a completion request (text is tokenized with BOS rules
    of the engine: ``add_special_tokens=True``)."""
    items = _prompt_items(prompt)
    if not items:
        raise invalid("prompt must not be empty", param="prompt")
    if len(items) > limits.max_prompts:
        raise invalid(f"at most {limits.max_prompts} prompts per request", param="prompt")
    out = []
    for item in items:
        ids = encode(item, ctx, add_special_tokens=True) if isinstance(item, str) \
            else list(item)
        out.append(check_prompt_ids(ids, ctx))
    return out


def _prompt_items(prompt: str | list) -> list:
    """A completion's prompts: one string, one list of token ids, or a list of either."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def check_prompt_ids(ids: Sequence[int], ctx: ModelContext, param: str = "prompt") -> list[int]:
    if not ids:
        raise invalid("prompt must not be empty", param=param)
    vocab = ctx.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise invalid(f"prompt token ids must be in [0, {vocab})", param=param)
    if len(ids) >= ctx.max_model_len:
        raise invalid(f"This model's maximum context length is {ctx.max_model_len} tokens; "
                      f"the prompt has {len(ids)}", param=param,
                      code="context_length_exceeded")
    return list(ids)


def chat_prompt(req: ChatCompletionRequest, ctx: ModelContext,
                limits: ServingLimits) -> list[int]:
    if len(req.messages) > limits.max_messages:
        raise invalid(f"at most {limits.max_messages} messages", param="messages")
    messages = []
    for i, m in enumerate(req.messages):
        if not m.valid_role():
            raise invalid(f"messages[{i}].role: unknown role {excerpt(m.role)!r}",
                          param=f"messages.{i}.role")
        messages.append({"role": m.role, "content": m.text()})
    try:
        text = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as e:
        raise invalid(str(e), param="messages") from e
    return check_prompt_ids(encode(text, ctx, add_special_tokens=False, param="messages"),
                            ctx, param="messages")


def encode(text: str, ctx: ModelContext, add_special_tokens: bool,
           param: str = "prompt") -> list[int]:
    """Token ids of ``text``; a text the tokenizer cannot take is the client's error."""
    try:
        return ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except (TypeError, ValueError) as e:  # the tokenizers library's refusals
        raise invalid(f"{param}: the tokenizer cannot encode this text ({e})",
                      param=param) from e


def decode_request(request_id: str, ids: list[int], req: SamplingFields, max_tokens: int | None,
                   logprobs: int | None, ctx: ModelContext, index: int,
                   prompt_logprobs: int | None = None) -> DecodeRequest:
    room = ctx.max_model_len - len(ids)
    if max_tokens is None:
        max_tokens = room
    if max_tokens < 1:
        raise invalid("max_tokens must be >= 1", param="max_tokens")
    if max_tokens > room:
        raise invalid(f"This model's maximum context length is {ctx.max_model_len} tokens; "
                      f"you requested {len(ids) + max_tokens} ({len(ids)} in the prompt, "
                      f"{max_tokens} for the completion)", param="max_tokens",
                      code="context_length_exceeded")
    params = sampling_params(req, max_tokens, logprobs, index, logit_bias(req, ctx),
                             prompt_logprobs)
    return DecodeRequest(request_id, tuple(ids), params)


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None,
                    index: int, bias: dict[int, float] | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    seed = DEFAULT_SEED if req.seed is None and req.is_deterministic else req.seed
    if seed is not None and index:
        seed = (seed + index) % _SEED_SPACE  # choices differ, and stay reproducible
    top_k = req.top_k if req.top_k not in (None, -1) else 0
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k, seed=seed,
            is_deterministic=req.is_deterministic, stop=_stops(req.stop), logprobs=logprobs,
            ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
            prompt_logprobs=prompt_logprobs, logit_bias=bias,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            skip_special_tokens=req.skip_special_tokens)
    except ValueError as e:
        raise invalid(str(e), param=str(e).split(" ", 1)[0]) from e


def logit_bias(req: SamplingFields, ctx: ModelContext) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) with int keys, each in the
    vocabulary; values are checked by ``SamplingParams``."""
    if not req.logit_bias:
        return None
    vocab = ctx.tokenizer.vocab_size
    out: dict[int, float] = {}
    for key, value in req.logit_bias.items():
        token = key.strip()
        # ASCII digits only (str.isdigit also takes superscripts and other scripts' digits),
        # and few enough for int() (it refuses thousands of digits)
        tid = int(token) if token.isascii() and token.isdigit() and len(token) < 20 else -1
        if not 0 <= tid < vocab:
            raise invalid(f"logit_bias keys must be token ids in [0, {vocab}), "
                          f"got {excerpt(key)!r}", param="logit_bias")
        out[tid] = value
    return out


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)
