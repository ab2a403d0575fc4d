"""Tokenizer: chat-message validation, template behaviour, config files, streaming decode."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from model_helpers import make_random_llama

from detserve.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_tokenizer_json(make_random_llama() / "tokenizer.json")


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty"),
    ("hello", "non-empty"),
    (None, "non-empty"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"role": "user"}], "'role' and 'content'"),
    ([{"content": "hi"}], "'role' and 'content'"),
    ([{"role": "robot", "content": "hi"}], "role 'robot'"),
    ([{"role": "user", "content": None}], "content must be a string"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "content must be a string"),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": 3}], r"messages\[1\]"),
])
def test_bad_messages(tok: Tokenizer, messages: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_roles_and_generation_prompt(tok: Tokenizer) -> None:
    chat = [{"role": r, "content": r.upper()} for r in ("system", "user", "assistant", "tool")]
    text = tok.apply_chat_template(chat, add_generation_prompt=False)
    assert text.count("<|im_start|>") == 4 and not text.endswith("assistant\n")
    assert tok.apply_chat_template(chat).endswith("<|im_start|>assistant\n")


def _with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tok.backend, eos_token_ids=tok.eos_token_ids, bos_token_id=tok.bos_token_id,
                     chat_template=template, special_tokens=tok.special_tokens)


def test_template_helpers_and_errors(tok: Tokenizer) -> None:
    strict = _with_template(tok, (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'system' %}{{ raise_exception('no system here') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}{{ tools | tojson }}"))
    assert strict.apply_chat_template([{"role": "user", "content": "a"}],
                                      tools=[{"name": "é<b>"}]) == '<|im_start|>a[{"name": "é<b>"}]'
    with pytest.raises(ValueError, match="no system here"):
        strict.apply_chat_template([{"role": "system", "content": "a"}])
    with pytest.raises(ValueError, match="no chat template"):
        _with_template(tok, None).apply_chat_template([{"role": "user", "content": "a"}])
    # The sandbox refuses to mutate the caller's messages.
    mutating = _with_template(tok, "{{ messages.append(1) }}")
    with pytest.raises(ValueError, match="unsafe"):
        mutating.apply_chat_template([{"role": "user", "content": "a"}])


def test_config_files_variants(tmp_path: Path) -> None:
    folder = make_random_llama(tmp_path)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    template = cfg.pop("chat_template")
    cfg["eos_token"] = {"content": "<|im_end|>", "special": True}
    cfg_path.write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_text(template)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    t = Tokenizer.from_tokenizer_json(folder)
    assert t.chat_template == template and t.eos_token_ids == (0, 2) and t.bos_token_id == 1
    cfg["chat_template"] = [{"name": "tool_use", "template": "x"},
                            {"name": "default", "template": "{{ messages[0]['content'] }}"}]
    cfg_path.write_text(json.dumps(cfg))
    t = Tokenizer.from_tokenizer_json(folder / "tokenizer.json", config_dir=folder)
    assert t.apply_chat_template([{"role": "user", "content": "only"}]) == "only"
    cfg["eos_token"] = "<|not-a-token|>"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not in the vocab"):
        Tokenizer.from_tokenizer_json(folder)
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_tokenizer_json(tmp_path / "nowhere")


MULTIBYTE = "Grüße aus 東京 😀👍🏽 — naïve façade ∑λ → ok"


def _stream(tok: Tokenizer, ids: list[int], start: tuple[int, int] = (0, 0)) -> list[str]:
    prefix, read = start
    first = read
    chunks = []
    for n in range(first + 1, len(ids) + 1):
        text, prefix, read = tok.decode_incremental(ids[:n], prefix, read)
        chunks.append(text)
    return chunks


def test_incremental_decode_never_splits_a_character(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE)
    # The small vocabulary spells most of these characters with several byte tokens.
    assert len(ids) > len(MULTIBYTE)
    chunks = _stream(tok, ids)
    assert "".join(chunks) == MULTIBYTE
    assert all("\ufffd" not in c for c in chunks)
    assert chunks.count("") >= 5  # withheld while a character was incomplete


def test_incremental_decode_after_prompt_and_specials(tok: Tokenizer) -> None:
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi 東京"}]))
    output = tok.encode(" 😀 fine") + list(tok.eos_token_ids)
    chunks = _stream(tok, prompt + output, Tokenizer.initial_offsets(len(prompt)))
    assert "".join(chunks) == " 😀 fine"  # the eos token is a special token: skipped
    assert chunks[-1] == ""


def test_incremental_decode_final_flush(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")
    partial = ids[:-1]  # cut inside the emoji's bytes
    text, prefix, read = tok.decode_incremental(partial, 0, 0)
    assert text == "" and (prefix, read) == (0, 0)
    text, _, read = tok.decode_incremental(partial, 0, 0, final=True)
    assert text.startswith("ok") and text.endswith("\ufffd") and read == len(partial)
