"""Request limits and load-shedding thresholds of the router (validated, frozen)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

_SHED_FACTOR = 2  # admitted sequences per decoder slot before the router sheds load


@dataclass(frozen=True)
class ServingLimits:
    max_model_len: int
    max_outstanding: int = 256        # sequences admitted at once (all choices), then 429
    max_body_bytes: int = 1 << 20
    max_n: int = 4
    max_prompts: int = 8              # prompts in one /v1/completions batch
    max_choices: int = 8              # n x prompts
    max_stop: int = 4
    max_stop_chars: int = 128
    max_messages: int = 256
    max_request_id_chars: int = 128
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")
        if self.max_choices < self.max_n:
            raise ValueError("max_choices must be >= max_n")

    @classmethod
    def from_args(cls, args: Mapping[str, Any], **overrides: int) -> ServingLimits:
        """Defaults sized from the app args: shed above twice the decoders' batch slots."""
        outstanding = _SHED_FACTOR * int(args["num_decoders"]) * int(args["max_num_seqs"])
        values: dict[str, int] = {"max_model_len": int(args["max_model_len"]),
                                  "max_outstanding": outstanding}
        values.update(overrides)
        return cls(**values)
