"""What the router knows about the served model: its id and its tokenizer (no weights)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from detserve.model.fetch import fetch_smollm2
from detserve.model.loader import RANDOM_PREFIX
from detserve.model.random_init import random_tokenizer
from detserve.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelContext:
    model_id: str                      # listed by /v1/models; what clients send as "model"
    aliases: frozenset[str]            # other accepted spellings (path basename, stem)
    tokenizer: Tokenizer
    max_model_len: int

    @classmethod
    def load(cls, spec: str, max_model_len: int) -> ModelContext:
        if spec.startswith(RANDOM_PREFIX):  # random weights of a real shape (benchmarks)
            return cls(spec, frozenset(), random_tokenizer(spec[len(RANDOM_PREFIX):]),
                       max_model_len)
        path = fetch_smollm2() if spec == "smollm2" else Path(spec).expanduser()
        if path.is_dir():
            tokenizer = Tokenizer.from_tokenizer_json(path / "tokenizer.json", path)
        elif path.suffix == ".gguf" and path.is_file():
            tokenizer = Tokenizer.from_gguf(path)
        else:
            raise FileNotFoundError(f"model {spec!r}: no HF folder or .gguf file at {path}")
        aliases = frozenset({path.name, path.stem, str(path.resolve())} - {spec})
        return cls(spec, aliases, tokenizer, max_model_len)

    def serves(self, name: str) -> bool:
        return name == self.model_id or name in self.aliases

    def token_text(self, token_id: int) -> str:
        """One token as text (special tokens included), for logprobs."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
