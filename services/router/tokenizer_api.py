"""The served model's tokenizer over HTTP, in vLLM's terms: ``/tokenize``, ``/detokenize``
and ``/tokenizer_info``.

Clients that must count tokens themselves (an evaluation harness scoring loglikelihoods
needs each context's length) use these instead of downloading the tokenizer: the
EleutherAI harness's ``local-completions`` model finds them on its own and tokenizes
through them. Bodies are validated like the completion APIs (strict types, 400 naming the
field).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from services.router.errors import invalid
from services.router.model_context import ModelContext
from services.router.prepare import check_model
from services.router.schemas import ChatMessage, StrictModel


class TokenizeRequest(StrictModel):
    """Exactly one of ``prompt`` and ``messages`` (the chat template applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def tokenize(req: TokenizeRequest, ctx: ModelContext) -> dict[str, Any]:
    if req.model is not None:
        check_model(req.model, ctx)
    if (req.prompt is None) == (req.messages is None):
        raise invalid("set exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = ctx.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt)
        except ValueError as e:
            raise invalid(str(e), param="messages") from e
        ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = ctx.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
    strs = [ctx.token_text(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids,
            "token_strs": strs}


def detokenize(req: DetokenizeRequest, ctx: ModelContext) -> dict[str, Any]:
    if req.model is not None:
        check_model(req.model, ctx)
    vocab = ctx.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise invalid(f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def tokenizer_info(ctx: ModelContext) -> dict[str, Any]:
    """The special tokens, chat template and length limit (what a client-side tokenizer
    needs besides the vocabulary)."""
    special = ctx.tokenizer.special_tokens
    return {"tokenizer_class": "detserve.Tokenizer", "model_max_length": ctx.max_model_len,
            "eos_token": special.get("eos_token"), "bos_token": special.get("bos_token"),
            "pad_token": special.get("pad_token"), "chat_template": ctx.tokenizer.chat_template,
            "vocab_size": ctx.tokenizer.vocab_size}
