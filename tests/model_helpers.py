"""Test helpers: tiny random Llama checkpoints, a GGUF writer and a plain-torch reference path.

Nothing here is used by the server. ``make_random_llama`` is called by many engine tests, so
it is cached on disk by its arguments and does not import transformers: the weights are
drawn with a seeded torch generator and written in exactly the layout
``LlamaForCausalLM.save_pretrained`` produces (tests/test_model_parity.py checks that
transformers loads the folder with no missing or unexpected keys and the same logits).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import decoders, models, pre_tokenizers, trainers
from torch import Tensor

from detserve.model.config import ModelConfig
from detserve.model.hf_loader import iter_hf_weights, read_hf_config
from detserve.model.llama import LlamaModel, rope_inv_freq

# Bump when the folder layout or the way weights are drawn changes (invalidates caches).
_HELPER_VERSION = 1
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A deterministic server returns the same tokens
for the same request, whatever else is in the batch. Numbers like 12, 345 and 6789 appear,
as do symbols (a + b) * c = d; paths /usr/lib/python3; code: def f(x): return x ** 2.
Tokens are committed only after the verifier agrees with the fast path. Unicode: café,
naïve, Über, 東京, 😀, λ-calculus. Every request carries a fingerprint of the model weights.
"""


def _training_text(seed: int = 1234) -> list[str]:
    # The English above plus seeded pseudo-words: enough distinct pairs for a few thousand
    # merges, so the trained vocabulary reaches the model's vocab size.
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "zu", "sh", "th", "qu",
                 "an", "er", "in", "on", "es", "st", "ng", "ch", "ou", "ai", "ie"]
    lines = _CORPUS.splitlines() * 30  # weighted so small vocabularies learn English first
    for _ in range(400):
        words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
                 for _ in range(12)]
        lines.append(" ".join(words))
    return lines


def make_tokenizer(vocab_size: int) -> tokenizers.Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenizer) with exactly ``vocab_size`` ids, trained locally.

    Ids 0..2 are ``SPECIAL_TOKENS``; any ids training cannot fill become ``<|extra_N|>``.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} for byte-level BPE")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([f"<|extra_{i}|>" for i in range(missing)])
    return tok


def make_random_llama(
    dir: str | Path | None = None,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
    rope_scaling_llama3: bool = False,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    initializer_range: float = 0.02,
    seed: int = 0,
) -> Path:
    """A tiny random HF checkpoint folder; returns its path.

    ``attention_bias=True`` makes a Qwen2 checkpoint (bias on q/k/v only, which is what
    LlamaModel supports). ``rope_scaling_llama3`` uses factor 8, low 1, high 4 and an
    original context of 64, so all three frequency bands occur at these sizes. Norm
    weights are 1 + 0.1 N(0,1) so that swapping two norms is caught by a test.

    Built once per argument set under ``$TMPDIR/detserve-test-models`` (reuse takes
    milliseconds). With ``dir=None`` the shared cached folder is returned: do not modify it.
    Otherwise its files are copied into ``dir``.
    """
    args = dict(locals())
    args.pop("dir")
    key_src = json.dumps({**args, "v": _HELPER_VERSION, "torch": torch.__version__,
                          "tokenizers": tokenizers.__version__}, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cached = Path(tempfile.gettempdir()) / "detserve-test-models" / key
    if not (cached / "config.json").is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=cached.parent))
        _write_random_llama(tmp, **args)
        try:
            os.rename(tmp, cached)
        except OSError:  # another process finished first; its folder is identical
            shutil.rmtree(tmp, ignore_errors=True)
    if dir is None:
        return cached
    dest = Path(dir)
    dest.mkdir(parents=True, exist_ok=True)
    for f in cached.iterdir():
        shutil.copyfile(f, dest / f.name)
    return dest


def _write_random_llama(out: Path, *, vocab_size: int, hidden_size: int, intermediate_size: int,
                        num_layers: int, num_heads: int, num_kv_heads: int,
                        max_position_embeddings: int, tie_word_embeddings: bool,
                        attention_bias: bool, rope_scaling_llama3: bool, rope_theta: float,
                        rms_norm_eps: float, initializer_range: float, seed: int) -> None:
    head_dim = hidden_size // num_heads
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling_llama3:
        rope.update(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=64)
    model_type = "qwen2" if attention_bias else "llama"
    config: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if attention_bias else "LlamaForCausalLM"],
        "model_type": model_type, "vocab_size": vocab_size, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim, "hidden_act": "silu", "rms_norm_eps": rms_norm_eps,
        "max_position_embeddings": max_position_embeddings, "rope_theta": rope_theta,
        "rope_scaling": rope if rope_scaling_llama3 else None, "rope_parameters": rope,
        "tie_word_embeddings": tie_word_embeddings, "initializer_range": initializer_range,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "dtype": "float32",
    }
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None,
                      max_window_layers=num_layers, layer_types=["full_attention"] * num_layers)
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = initializer_range) -> Tensor:
        return torch.randn(*shape, generator=gen) * std

    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    weights = {"model.embed_tokens.weight": normal(vocab_size, hidden_size)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            weights[p + f"self_attn.{name}_proj.weight"] = normal(rows, hidden_size)
            if attention_bias:
                weights[p + f"self_attn.{name}_proj.bias"] = normal(rows)
        weights[p + "self_attn.o_proj.weight"] = normal(hidden_size, q)
        weights[p + "mlp.gate_proj.weight"] = normal(intermediate_size, hidden_size)
        weights[p + "mlp.up_proj.weight"] = normal(intermediate_size, hidden_size)
        weights[p + "mlp.down_proj.weight"] = normal(hidden_size, intermediate_size)
        weights[p + "input_layernorm.weight"] = 1 + normal(hidden_size, std=0.1)
        weights[p + "post_attention_layernorm.weight"] = 1 + normal(hidden_size, std=0.1)
    weights["model.norm.weight"] = 1 + normal(hidden_size, std=0.1)
    if not tie_word_embeddings:
        weights["lm_head.weight"] = normal(vocab_size, hidden_size)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    make_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
    tok_config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                  "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                  "chat_template": CHAT_TEMPLATE,
                  "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))


def write_llama_gguf(hf_dir: str | Path, path: str | Path, *, qtype: str = "F32") -> Path:
    """Convert a Llama HF folder to GGUF the way llama.cpp's converter does (for tests).

    q/k rows are permuted to the interleaved RoPE layout, names mapped to llama.cpp's, the
    byte-level tokenizer stored as metadata (pre "gpt2"), llama3 RoPE scaling stored as the
    ``rope_freqs`` divisors. ``qtype`` ("F32", "F16", "Q8_0", ...) applies to 2-D weights;
    norms stay F32 as in llama.cpp.
    """
    hf_dir = Path(hf_dir)
    cfg = read_hf_config(hf_dir)
    if cfg.attention_bias:
        raise ValueError("write_llama_gguf writes the llama architecture only (no qkv bias)")
    import gguf  # only the GGUF-writing helper needs it

    from detserve.model.gguf_loader import permute_rotary

    quant = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(hf_dir.name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_layers)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    _add_gguf_tokenizer(w, hf_dir, cfg)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer_names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                   "post_attention_layernorm": "ffn_norm"}
    for name, t in iter_hf_weights(hf_dir):
        stem, suffix = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, layer, rest = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{layer_names[rest]}.{suffix}"
        else:
            gguf_name = f"{names[stem]}.{suffix}"
        if ".self_attn.q_proj." in name:
            t = permute_rotary(t, cfg.num_heads)
        elif ".self_attn.k_proj." in name:
            t = permute_rotary(t, cfg.num_kv_heads)
        array = t.float().numpy()
        if array.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name, gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            w.add_tensor(gguf_name, array)
    if cfg.rope_scaling is not None:
        base = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
        w.add_tensor("rope_freqs.weight", (base / rope_inv_freq(cfg)).float().numpy())
        w.add_rope_scaling_orig_ctx_len(cfg.rope_scaling.original_max_position_embeddings)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _add_gguf_tokenizer(w: Any, hf_dir: Path, cfg: ModelConfig) -> None:
    data = json.loads((hf_dir / "tokenizer.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    special = {t["content"] for t in data.get("added_tokens", []) if t.get("special")}
    size = tok.get_vocab_size(with_added_tokens=True)
    tokens = [tok.id_to_token(i) for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_ids[0])
    w.add_add_bos_token(False)
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    if tok_cfg.get("chat_template"):
        w.add_chat_template(tok_cfg["chat_template"])


class ReferenceOps:
    """Plain torch ops in Hugging Face's exact order (fp32 RMSNorm, weight applied last).

    Kept apart from the executor's ops so the parity tests do not move when those do.
    """

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return F.linear(x, weight, bias)

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rmsnorm(self, x: Tensor, delta: Tensor, weight: Tensor,
                    eps: float) -> tuple[Tensor, Tensor]:
        h = x + delta
        return h, self.rmsnorm(h, weight, eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class DenseAttention:
    """Reference ``AttentionFn`` for one sequence with a dense KV cache (no paging).

    Call ``set_positions`` before each forward; it writes k/v at those positions, then each
    query attends causally to every cached position <= its own.
    """

    def __init__(self, config: ModelConfig, max_len: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        shape = (config.num_layers, max_len, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.group = config.num_heads // config.num_kv_heads
        self.scale = config.head_dim ** -0.5
        self.positions = torch.zeros(0, dtype=torch.long)

    def set_positions(self, positions: Tensor) -> None:
        self.positions = positions

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        pos = self.positions
        self.k[layer, pos] = k
        self.v[layer, pos] = v
        length = int(pos.max()) + 1
        keys = self.k[layer, :length].repeat_interleave(self.group, dim=1).float()
        values = self.v[layer, :length].repeat_interleave(self.group, dim=1).float()
        scores = torch.einsum("nhd,thd->hnt", q.float(), keys) * self.scale
        future = torch.arange(length, device=pos.device)[None, :] > pos[:, None]
        scores = scores.masked_fill(future[None], float("-inf"))
        out = torch.einsum("hnt,thd->nhd", scores.softmax(-1), values)
        return out.to(q.dtype)


def greedy_generate(model: LlamaModel, prompt: Sequence[int], max_new_tokens: int,
                    stop_ids: Sequence[int] = ()) -> list[int]:
    """Prefill ``prompt`` then decode one token at a time with ``DenseAttention``."""
    ops = ReferenceOps()
    attn = DenseAttention(model.config, len(prompt) + max_new_tokens, dtype=model.dtype)
    ids = torch.tensor(list(prompt), dtype=torch.long)
    positions = torch.arange(len(prompt))
    out: list[int] = []
    for _ in range(max_new_tokens):
        attn.set_positions(positions)
        hidden = model(ids, positions, attn, ops)
        token = int(model.logits(hidden[-1:], ops).argmax(-1))
        out.append(token)
        if token in stop_ids:
            break
        ids = torch.tensor([token])
        positions = positions[-1:] + 1
    return out


def transformers_gguf_model(path: str | Path) -> Any:
    """transformers' own GGUF conversion (dequantize, un-permute, rename) in a fresh model.

    ``from_pretrained(gguf_file=...)`` insists on ``accelerate``; this calls the same
    ``load_gguf_checkpoint`` directly, so the reference needs only transformers.
    """
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(path)
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager")
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    expected_missing = ["lm_head.weight"] if config.tie_word_embeddings else []
    if result.unexpected_keys or result.missing_keys != expected_missing:
        raise RuntimeError(f"transformers GGUF load incomplete: {result}")
    return model.eval()
