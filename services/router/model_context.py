"""What the router knows about the served model: its names, its tokenizer (no weights),
and how a request that does not say whether it is deterministic is served."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detserve.model.fetch import fetch_smollm2
from detserve.model.loader import RANDOM_PREFIX
from detserve.model.random_init import random_tokenizer
from detserve.model.tokenizer import Tokenizer

# the deterministic name's default: the served name with this suffix
DETERMINISTIC_SUFFIX = ":deterministic"


@dataclass(frozen=True)
class ModelContext:
    model_id: str                      # listed by /v1/models; what clients send as "model"
    aliases: frozenset[str]            # other accepted spellings (path basename, stem)
    tokenizer: Tokenizer
    max_model_len: int
    # a second name of the same model, listed by /v1/models too: every request naming it
    # is deterministic (for clients that can send no extra field, only a model name)
    deterministic_id: str = ""
    # whether a request that names no preference (field, header or deterministic name) is
    # deterministic; ``is_deterministic: false`` still opts out
    deterministic_by_default: bool = False

    def __post_init__(self) -> None:
        if not self.deterministic_id:
            object.__setattr__(self, "deterministic_id", self.model_id + DETERMINISTIC_SUFFIX)
        if self.deterministic_id == self.model_id or self.deterministic_id in self.aliases:
            raise ValueError(f"the deterministic model name {self.deterministic_id!r} must "
                             "differ from the served model's names")

    @classmethod
    def load(cls, spec: str, max_model_len: int, *, served_name: str | None = None,
             deterministic_name: str | None = None,
             deterministic_by_default: bool = False) -> ModelContext:
        """``served_name`` (default: ``spec``) is what /v1/models lists and responses carry;
        ``deterministic_name`` defaults to it with ``DETERMINISTIC_SUFFIX``."""
        if spec.startswith(RANDOM_PREFIX):  # random weights of a real shape (benchmarks)
            tokenizer = random_tokenizer(spec[len(RANDOM_PREFIX):])
            spellings: frozenset[str] = frozenset({spec})
        else:
            path = fetch_smollm2() if spec == "smollm2" else Path(spec).expanduser()
            if path.is_dir():
                tokenizer = Tokenizer.from_tokenizer_json(path / "tokenizer.json", path)
            elif path.suffix == ".gguf" and path.is_file():
                tokenizer = Tokenizer.from_gguf(path)
            else:
                raise FileNotFoundError(f"model {spec!r}: no HF folder or .gguf file at {path}")
            spellings = frozenset({spec, path.name, path.stem, str(path.resolve())})
        name = served_name or spec
        return cls(name, spellings - {name}, tokenizer, max_model_len,
                   deterministic_name or "", deterministic_by_default)

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> ModelContext:
        """The context of the serve application's args (``services.serve_config``)."""
        return cls.load(str(args["model"]), int(args["max_model_len"]),
                        served_name=args.get("served_model_name") or None,
                        deterministic_name=args.get("deterministic_model_name") or None,
                        deterministic_by_default=bool(args.get("deterministic_by_default")))

    def serves(self, name: str) -> bool:
        return name == self.model_id or name in self.aliases or self.names_deterministic(name)

    def names_deterministic(self, name: str) -> bool:
        """Whether ``name`` is the model's deterministic name."""
        return name == self.deterministic_id

    def token_text(self, token_id: int) -> str:
        """One token as text (special tokens included), for logprobs."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
