"""Tokenizer: a ``tokenizers.Tokenizer`` plus special ids, chat template and streaming decode.

Built either from a Hugging Face ``tokenizer.json`` (with the sibling config files) or from
the metadata of a GGUF file, which carries no ``tokenizer.json`` of its own.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2.ext
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

if TYPE_CHECKING:
    from gguf import GGUFReader

CHAT_ROLES = ("system", "user", "assistant", "tool")
# vLLM's window: decode this many already-emitted tokens again so that merges across the
# boundary (leading spaces, multi-token characters) come out the same as a full decode.
_PREFIX_WINDOW = 5
_REPLACEMENT = "\ufffd"

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """Pre-tokenizer for llama.cpp's ``tokenizer.ggml.pre`` name.

    "smollm" is the original SmolLM2 ``tokenizer.json`` (Digits then GPT-2 ByteLevel), i.e.
    llama.cpp's regexes ``\\p{N}`` followed by the GPT-2 pattern.
    """
    if pre == "smollm":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise ValueError(f"GGUF pre-tokenizer {pre!r} unsupported (supported: smollm, gpt2, llama3)")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table, as byte-level BPE vocabularies spell tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes, which chat templates do not want.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    # Templates such as Llama 3.1's call this unless given date_string=...: pass date_string
    # for prompts that must be reproducible across days.
    return datetime.datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    # The same environment transformers uses, so templates render identically.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages; ValueError naming the first bad one. Returns plain-dict copies."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    checked = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        if "role" not in msg or "content" not in msg:
            raise ValueError(f"messages[{i}] needs both 'role' and 'content'")
        if msg["role"] not in CHAT_ROLES:
            raise ValueError(f"messages[{i}]: role {msg['role']!r} not in {CHAT_ROLES}")
        if not isinstance(msg["content"], str):
            raise ValueError(f"messages[{i}]: content must be a string, "
                             f"got {type(msg['content']).__name__}")
        checked.append(dict(msg))
    return checked


class Tokenizer:
    """Text <-> token ids for one model. Immutable after construction; thread-safe to share."""

    def __init__(self, backend: BackendTokenizer, *, eos_token_ids: Iterable[int],
                 bos_token_id: int | None = None, chat_template: str | None = None,
                 special_tokens: Mapping[str, str] | None = None) -> None:
        self._backend = backend
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        # Strings the chat template may refer to: bos_token, eos_token, ...
        self.special_tokens: dict[str, str] = dict(special_tokens or {})

    @property
    def backend(self) -> BackendTokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special tokens written in ``text`` (e.g. ``<|im_start|>``) map to their ids."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @staticmethod
    def initial_offsets(num_prompt_tokens: int) -> tuple[int, int]:
        """``(prefix_offset, read_offset)`` to start streaming after a prompt of that length."""
        return max(num_prompt_tokens - _PREFIX_WINDOW, 0), num_prompt_tokens

    def decode_incremental(self, ids: Sequence[int], prefix_offset: int, read_offset: int, *,
                           skip_special_tokens: bool = True, final: bool = False,
                           ) -> tuple[str, int, int]:
        """Text added by ``ids[read_offset:]``, vLLM style: ``(new_text, prefix, read)``.

        ``ids`` is the whole sequence so far; start from ``(0, 0)`` for output-only ids or
        from ``initial_offsets(len(prompt))``. Text is withheld (and offsets kept) while the
        tail is an incomplete UTF-8 character, so a stream never shows half a character;
        ``final=True`` flushes whatever is left at the end of a stream.
        """
        prefix_text = self.decode(ids[prefix_offset:read_offset], skip_special_tokens)
        full_text = self.decode(ids[prefix_offset:], skip_special_tokens)
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith(_REPLACEMENT)):
            return full_text[len(prefix_text):], read_offset, len(ids)
        return "", prefix_offset, read_offset

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        return _compile_template(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **template_vars: Any) -> str:
        """Render messages with the model's template; ValueError for bad messages.

        ``template_vars`` (tools, date_string, ...) are passed to the template as is.
        """
        checked = validate_messages(messages)
        variables = {**self.special_tokens, **template_vars}
        try:
            return str(self._template.render(messages=checked,
                                             add_generation_prompt=add_generation_prompt,
                                             **variables))
        except TemplateError as e:  # raise_exception() in the template: the chat is invalid
            raise ValueError(f"chat template rejected the messages: {e}") from e

    @classmethod
    def from_tokenizer_json(cls, path: str | Path, config_dir: str | Path | None = None,
                            ) -> Tokenizer:
        """Load ``tokenizer.json`` (or a folder holding one).

        From ``config_dir`` (default: the file's folder), when present: tokenizer_config.json
        (chat_template, bos/eos tokens), chat_template.jinja, and the eos/bos ids of
        config.json and generation_config.json.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        backend = BackendTokenizer.from_file(str(path))
        folder = Path(config_dir) if config_dir is not None else path.parent
        tok_cfg = _read_json(folder / "tokenizer_config.json")
        special = {key: _token_content(tok_cfg[key]) for key in
                   ("bos_token", "eos_token", "unk_token", "pad_token") if tok_cfg.get(key)}
        eos_ids: list[int] = []
        for cfg_name in ("generation_config.json", "config.json"):
            eos_ids += _as_ids(_read_json(folder / cfg_name).get("eos_token_id"))
        bos_id = None
        for key, token in special.items():
            token_id = backend.token_to_id(token)
            if token_id is None:
                raise ValueError(f"{key} {token!r} of tokenizer_config.json is not in the vocab")
            if key == "eos_token":
                eos_ids.append(token_id)
            if key == "bos_token":
                bos_id = token_id
        if bos_id is None:
            bos_id = _read_json(folder / "config.json").get("bos_token_id")
        template = _chat_template(tok_cfg.get("chat_template"))
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():  # transformers >= 4.49 saves it apart
            template = jinja_file.read_text()
        return cls(backend, eos_token_ids=eos_ids, bos_token_id=bos_id,
                   chat_template=template, special_tokens=special)

    @classmethod
    def from_gguf(cls, reader_or_path: GGUFReader | str | Path) -> Tokenizer:
        """Rebuild the byte-level BPE tokenizer described by a GGUF's ``tokenizer.*`` metadata."""
        # Imported here so that text-only users of this module do not import torch.
        from detserve.model.gguf_loader import gguf_field, open_gguf

        reader = open_gguf(reader_or_path)
        kind = gguf_field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} unsupported (only byte-level 'gpt2')")
        tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
        merges: list[str] = gguf_field(reader, "tokenizer.ggml.merges", [])
        types: list[int] = gguf_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        alphabet = _byte_alphabet()
        letters = set(alphabet.values())

        def spell(token: str) -> str:
            # Vocab entries are stored byte-level spelled already; a few files store a
            # token as raw text, which is respelled so BPE can reach it.
            if set(token) <= letters:
                return token
            return "".join(alphabet[b] for b in token.encode("utf-8"))

        vocab = {spell(tok): i for i, tok in enumerate(tokens)}
        pairs = [(a, b) for a, _, b in (m.partition(" ") for m in merges)]
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
        backend.pre_tokenizer = _pre_tokenizer(gguf_field(reader, "tokenizer.ggml.pre", "gpt2"))
        backend.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|> ...) are matched whole and dropped by skip_special;
        # a control token outside the byte alphabet is a llama.cpp mislabel and is skipped.
        backend.add_special_tokens([
            AddedToken(tok, special=True, normalized=False)
            for tok, t in zip(tokens, types, strict=True) if t == _TOKEN_CONTROL and set(tok) <= letters
        ])
        backend.add_tokens([
            AddedToken(tok, special=False, normalized=False)
            for tok, t in zip(tokens, types, strict=True) if t == _TOKEN_USER_DEFINED
        ])
        bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
        bos_id = None if bos is None else int(bos)
        if bos_id is not None and gguf_field(reader, "tokenizer.ggml.add_bos_token", False):
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos_id]} $A", special_tokens=[(tokens[bos_id], bos_id)])
        eos_ids = [int(v) for key in ("eos_token_id", "eot_token_id", "eom_token_id")
                   if (v := gguf_field(reader, f"tokenizer.ggml.{key}")) is not None]
        special = {}
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
            token_id = gguf_field(reader, f"tokenizer.ggml.{key}")
            if token_id is not None:
                special[name] = tokens[int(token_id)]
        return cls(backend, eos_token_ids=eos_ids, bos_token_id=bos_id,
                   chat_template=gguf_field(reader, "tokenizer.chat_template"),
                   special_tokens=special)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_content(value: Any) -> str:
    # tokenizer_config.json writes special tokens either as "<s>" or {"content": "<s>", ...}.
    return str(value["content"] if isinstance(value, dict) else value)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _chat_template(value: Any) -> str | None:
    # Some configs hold several named templates; "default" is the chat one.
    if isinstance(value, list):
        named = {t["name"]: t["template"] for t in value}
        return named.get("default")
    return value if isinstance(value, str) else None
