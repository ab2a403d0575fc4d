"""Our LlamaModel vs transformers on the same random weights; loaders and ModelInfo."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from model_helpers import (
    DenseAttention,
    ReferenceOps,
    greedy_generate,
    make_random_llama,
    transformers_gguf_model,
    write_llama_gguf,
)
from safetensors.torch import load_file, save_file

from detserve.model import loader
from detserve.model.gguf_loader import open_gguf, permute_rotary, unpermute_rotary
from detserve.model.hf_loader import hf_weight_files, read_hf_config
from detserve.model.identity import ModelInfo
from detserve.model.llama import LlamaModel
from detserve.model.loader import load_model
from detserve.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
VARIANTS: dict[str, dict[str, Any]] = {
    "untied_gqa": {},
    "tied": {"tie_word_embeddings": True},
    "mha": {"num_kv_heads": 4, "num_layers": 3},
    "qwen2_bias": {"attention_bias": True},
    "llama3_rope": {"rope_scaling_llama3": True},
}


def _hf_model(folder: Path) -> Any:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    # transformers fills missing weights randomly with only a warning: insist on none.
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _our_logits(model: LlamaModel, attn: DenseAttention, ids: list[int], start: int) -> torch.Tensor:
    ops = ReferenceOps()
    positions = torch.arange(start, start + len(ids))
    attn.set_positions(positions)
    return model.logits(model(torch.tensor(ids), positions, attn, ops), ops)


def _compare_prefill_and_decode(folder: Path, prompt_len: int, steps: int = 4) -> float:
    """Max |logit difference| over a prefill and ``steps`` greedy single-token decodes."""
    ours, _, _ = load_model(folder)
    theirs = _hf_model(folder)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, ours.config.vocab_size, (prompt_len,), generator=gen).tolist()
    attn = DenseAttention(ours.config, prompt_len + steps)
    with torch.no_grad():
        out = theirs(input_ids=torch.tensor([prompt]), use_cache=True)
        ref, past = out.logits[0], out.past_key_values
        got = _our_logits(ours, attn, prompt, 0)
        worst = float((got - ref).abs().max())
        assert torch.allclose(got, ref, atol=ATOL, rtol=0), worst
        for step in range(steps):
            token = int(ref[-1].argmax())
            assert int(got[-1].argmax()) == token
            out = theirs(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
            ref, past = out.logits[0], out.past_key_values
            got = _our_logits(ours, attn, [token], prompt_len + step)
            worst = max(worst, float((got - ref).abs().max()))
            assert torch.allclose(got, ref, atol=ATOL, rtol=0), (step, worst)
    return worst


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant: str) -> None:
    folder = make_random_llama(**VARIANTS[variant])
    # Past the llama3 variant's original context (64), where the scaled bands matter most.
    prompt_len = 80 if variant == "llama3_rope" else 12
    _compare_prefill_and_decode(folder, prompt_len)


def test_config_reads_transformers5_rope_parameters(tmp_path: Path) -> None:
    # transformers 5 writes llama3 scaling only under rope_parameters.
    folder = make_random_llama(tmp_path / "m", rope_scaling_llama3=True)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["rope_scaling"], cfg["rope_theta"]
    (folder / "config.json").write_text(json.dumps(cfg))
    config = read_hf_config(folder)
    assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0
    assert config.rope_theta == 10000.0


def test_random_llama_is_cached_and_deterministic(tmp_path: Path) -> None:
    a = make_random_llama(tmp_path / "a", seed=3)
    b = make_random_llama(tmp_path / "b", seed=3)
    c = make_random_llama(tmp_path / "c", seed=4)
    ws = [load_file(str(d / "model.safetensors")) for d in (a, b, c)]
    assert all(torch.equal(ws[0][k], ws[1][k]) for k in ws[0])
    assert not torch.equal(ws[0]["lm_head.weight"], ws[2]["lm_head.weight"])
    assert make_random_llama(seed=3) != make_random_llama(seed=4)


def test_random_llama_tokenizer_and_chat(tmp_path: Path) -> None:
    folder = make_random_llama(vocab_size=700)
    _, tok, _ = load_model(folder)
    assert tok.vocab_size == 700
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == 1 and 2 in ids
    assert tok.decode(tok.encode("The quick brown fox, café 😀")) == "The quick brown fox, café 😀"


def _reshard(src: Path, dst: Path) -> None:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copyfile(f, dst / f.name)
    weights = load_file(str(src / "model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(dst / shard))
        weight_map.update(dict.fromkeys(keys, shard))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _prefill(model: LlamaModel, n: int = 10) -> torch.Tensor:
    attn = DenseAttention(model.config, n)
    return _our_logits(model, attn, list(range(3, 3 + n)), 0)


def test_sharded_and_torch_bin_weights_load_identically(tmp_path: Path) -> None:
    src = make_random_llama()
    ref = _prefill(load_model(src)[0])
    _reshard(src, tmp_path / "sharded")
    assert len(hf_weight_files(tmp_path / "sharded")) == 2
    assert torch.equal(_prefill(load_model(tmp_path / "sharded")[0]), ref)
    binned = tmp_path / "bin"
    shutil.copytree(src, binned)
    torch.save(load_file(str(binned / "model.safetensors")), binned / "pytorch_model.bin")
    (binned / "model.safetensors").unlink()
    assert torch.equal(_prefill(load_model(binned)[0]), ref)


def test_rotary_permutation_round_trip() -> None:
    w = torch.arange(2 * 3 * 8 * 5, dtype=torch.float32).reshape(2 * 3 * 8, 5)
    assert torch.equal(unpermute_rotary(permute_rotary(w, 3), 3), w)
    bias = torch.arange(48, dtype=torch.float32)
    assert torch.equal(unpermute_rotary(permute_rotary(bias, 3), 3), bias)
    # Head 0, HF rows (0..7 | 8..15) become interleaved pairs (0, 8), (1, 9), ...
    assert permute_rotary(bias, 3)[:4].tolist() == [0.0, 8.0, 1.0, 9.0]


@pytest.mark.parametrize("variant", ["untied_gqa", "tied", "llama3_rope"])
def test_gguf_f32_round_trip_is_bit_exact(variant: str, tmp_path: Path) -> None:
    folder = make_random_llama(**VARIANTS[variant])
    path = write_llama_gguf(folder, tmp_path / "m.gguf")
    hf_model, hf_tok, _ = load_model(folder)
    gguf_model, gguf_tok, info = load_model(path)
    assert gguf_model.config.rope_scaling == hf_model.config.rope_scaling
    assert gguf_model.config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    assert torch.equal(_prefill(gguf_model, 80), _prefill(hf_model, 80))
    text = "The quick brown fox: def f(x): return 12345 😀  café\n\n"
    assert gguf_tok.encode(text) == hf_tok.encode(text)
    assert gguf_tok.eos_token_ids == hf_tok.eos_token_ids
    assert gguf_tok.chat_template == hf_tok.chat_template
    assert info.name == "m" and info.weights_hash == hashlib.sha256(path.read_bytes()).hexdigest()


def test_gguf_q8_matches_transformers_gguf_loader(tmp_path: Path) -> None:
    folder = make_random_llama()
    path = write_llama_gguf(folder, tmp_path / "q8.gguf", qtype="Q8_0")
    ours = load_model(path)[0]
    theirs = transformers_gguf_model(path)
    ids = list(range(3, 15))
    with torch.no_grad():
        ref = theirs(input_ids=torch.tensor([ids])).logits[0]
    got = _our_logits(ours, DenseAttention(ours.config, len(ids)), ids, 0)
    assert torch.allclose(got, ref, atol=ATOL, rtol=0), float((got - ref).abs().max())
    # Q8_0 changes the weights, so the logits move away from the float checkpoint.
    assert not torch.equal(got, _prefill(load_model(folder)[0], 12))


def test_model_info_hash_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = make_random_llama(tmp_path / "m")
    _, _, info = load_model(folder, dtype="bfloat16")
    assert isinstance(info, ModelInfo) and info.dtype == "bfloat16" and info.name == "m"
    lines = sorted(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n"
                   for f in (folder / "config.json", folder / "model.safetensors"))
    assert info.weights_hash == hashlib.sha256("".join(lines).encode()).hexdigest()
    # Big files cache their digest in <file>.sha256 and reuse it while size/mtime hold.
    monkeypatch.setattr(loader, "_HASH_CACHE_MIN_BYTES", 0)
    weights = folder / "model.safetensors"
    digest = loader.file_sha256(weights)
    cache = folder / "model.safetensors.sha256"
    assert cache.read_text().split()[0] == digest
    stat = weights.stat()
    cache.write_text(f"{'0' * 64} {stat.st_size} {stat.st_mtime_ns}\n")
    assert loader.file_sha256(weights) == "0" * 64
    weights.write_bytes(weights.read_bytes() + b" ")  # size changes: the cache is stale
    assert loader.file_sha256(weights) == hashlib.sha256(weights.read_bytes()).hexdigest()


def test_load_model_bad_specs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model"):
        load_model("no-such-alias")
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "missing" / "folder"))
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=".gguf"):
        load_model(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match="dtype"):
        load_model(make_random_llama(), dtype="float8")


def test_greedy_generate_matches_transformers_generate() -> None:
    folder = make_random_llama(tie_word_embeddings=True, seed=5)
    ours, tok, _ = load_model(folder)
    prompt = tok.encode("The quick brown fox")
    got = greedy_generate(ours, prompt, 12)
    ref = _hf_model(folder).generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    assert got == ref.tolist()


def test_tokenizer_json_folder_and_missing_gguf() -> None:
    folder = make_random_llama()
    tok = Tokenizer.from_tokenizer_json(folder / "tokenizer.json")
    assert tok.vocab_size == 512
    with pytest.raises(FileNotFoundError):
        open_gguf(folder / "nope.gguf")
