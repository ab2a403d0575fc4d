"""OpenAI request bodies (pydantic, strict types) plus our extra fields.

Extra fields: ``is_deterministic`` (bit-exact reproducible output; when absent, the model
name, the ``X-Detserve-Deterministic`` header or the server's default decide: see
``services.router.prepare``), vLLM's ``top_k``, ``min_tokens``, ``ignore_eos`` and
``skip_special_tokens``. Unknown fields are ignored, as OpenAI does; known-but-unsupported
features (tools, suffix, best_of, ...) are refused with a 400 naming the field rather than
silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from detserve.model.tokenizer import CHAT_ROLES

Prompt = str | list[str] | list[int] | list[list[int]]


class StrictModel(BaseModel):
    """Strict types (no coercion of "1" to 1); unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # extras (OpenAI clients send them through extra_body)
    is_deterministic: bool = False
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def unsupported(self) -> list[str]:
        """Fields set to something this server does not implement."""
        return []


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.suffix:
            bad.append("suffix")
        if self.best_of not in (None, self.n):
            bad.append("best_of")
        return bad


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def valid_role(self) -> bool:
        return self.role in CHAT_ROLES


class ResponseFormat(StrictModel):
    type: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.tools:
            bad.append("tools")
        if self.tool_choice not in (None, "none"):
            bad.append("tool_choice")
        if self.response_format is not None and self.response_format.type != "text":
            bad.append("response_format")
        return bad
