"""Load a llama.cpp GGUF file (Llama architecture) into Hugging Face names and layout.

Every tensor is dequantized to float32 (``gguf.quants.dequantize``); the model then casts
to its own dtype. Two things differ from an HF checkpoint and are undone here:
- tensor names (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``);
- llama.cpp's converter permutes the rows of q_proj/k_proj per head so that ggml's
  interleaved ("normal") RoPE applies; ``LlamaModel`` uses HF rotate-half RoPE, so the
  rows are put back in HF order.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from torch import Tensor

from detserve.model.config import ModelConfig, RopeScaling
from detserve.model.llama import rope_inv_freq

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Consumed by read_gguf_config (llama3 RoPE scaling), not a model weight.
_ROPE_FREQS = "rope_freqs.weight"
_SUPPORTED_ARCHS = ("llama",)


def open_gguf(path_or_reader: str | Path | GGUFReader) -> GGUFReader:
    """A ``GGUFReader`` (memory-maps the file; parsing the metadata takes a few seconds)."""
    if isinstance(path_or_reader, GGUFReader):
        return path_or_reader
    path = Path(path_or_reader)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    return GGUFReader(path)


def gguf_field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """Metadata value as a Python scalar, str or list; ``default`` when absent."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def gguf_hf_name(gguf_name: str) -> str | None:
    """HF name for a llama.cpp tensor name; None for tensors that are not weights."""
    if gguf_name == _ROPE_FREQS:
        return None
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    layer, kind, suffix = m.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def read_gguf_config(reader: GGUFReader) -> ModelConfig:
    """``ModelConfig`` from ``<arch>.*`` metadata, the token list and the tensor names."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} unsupported (supported: {_SUPPORTED_ARCHS})")

    def meta(key: str, default: Any = None) -> Any:
        value = gguf_field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF lacks required metadata {arch}.{key}")
        return value

    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    head_dim = int(gguf_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    rope_dim = int(gguf_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary (rope dim {rope_dim} != head dim {head_dim}) unsupported")
    tensors = {t.name: t for t in reader.tensors}
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    if tokens is not None:
        vocab = len(tokens)
    elif f"{arch}.vocab_size" in reader.fields:
        vocab = int(meta("vocab_size"))
    else:
        vocab = int(tensors["token_embd.weight"].shape[1])
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = gguf_field(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    config = ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
    )
    scaling_type = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type != "none":
        raise ValueError(f"GGUF rope scaling type {scaling_type!r} unsupported")
    if _ROPE_FREQS in tensors:
        factors = _dequantize(tensors[_ROPE_FREQS]).double()
        original = gguf_field(reader, f"{arch}.rope.scaling.original_context_length", 8192)
        config = dataclasses.replace(config, rope_scaling=_fit_llama3(config, factors, int(original)))
    return config


def _fit_llama3(config: ModelConfig, factors: Tensor, original: int) -> RopeScaling:
    """llama.cpp stores llama3 RoPE scaling only as per-frequency divisors (``rope_freqs``).

    The parameters are recovered by trying the ones Meta released (low 1, high 4, factor =
    largest divisor) and checking they reproduce every divisor; anything else is refused
    rather than approximated.
    """
    candidate = RopeScaling(
        factor=float(factors.max()), low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=original,
    )
    base = rope_inv_freq(dataclasses.replace(config, rope_scaling=None))
    scaled = rope_inv_freq(dataclasses.replace(config, rope_scaling=candidate))
    if factors.shape != base.shape or not torch.allclose(base / scaled, factors, rtol=1e-5):
        raise ValueError("GGUF rope_freqs do not match llama3 RoPE scaling; unsupported")
    return candidate


def _dequantize(tensor: Any) -> Tensor:
    """float32 torch tensor in PyTorch (row-major, HF) shape: GGUF lists dims reversed."""
    array = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    array = np.asarray(array, dtype=np.float32).reshape(shape)
    if not array.flags.writeable:  # F32 tensors are views into the read-only memory map
        array = array.copy()
    return torch.from_numpy(array)


def unpermute_rotary(w: Tensor, n_heads: int) -> Tensor:
    """Inverse of llama.cpp's ``permute(w, n_head, n_head_kv)`` on q/k rows.

    llama.cpp orders each head's rows as (pairs, 2) interleaved; HF as (2, pairs). Works
    for weights [rows, cols] and biases [rows].
    """
    rows = w.shape[0]
    pairs = rows // n_heads // 2
    return w.reshape(n_heads, pairs, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rotary(w: Tensor, n_heads: int) -> Tensor:
    """What llama.cpp's converter does (HF -> interleaved); used to write test GGUFs."""
    rows = w.shape[0]
    pairs = rows // n_heads // 2
    return w.reshape(n_heads, 2, pairs, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(reader: GGUFReader, config: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(HF name, float32 tensor)`` one tensor at a time, q/k rows in HF order."""
    for tensor in reader.tensors:
        name = gguf_hf_name(tensor.name)
        if name is None:
            continue
        w = _dequantize(tensor)
        if ".self_attn.q_proj." in name:
            w = unpermute_rotary(w, config.num_heads)
        elif ".self_attn.k_proj." in name:
            w = unpermute_rotary(w, config.num_kv_heads)
        yield name, w
