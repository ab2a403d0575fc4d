"""Random-weight models of real shapes, for throughput benchmarks (speed does not depend
on the weights). Weights are drawn on the target device; nothing is written to disk."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from detserve.model.config import ModelConfig, RopeScaling
from detserve.model.identity import ModelInfo
from detserve.model.llama import LlamaModel, WeightShard
from detserve.model.tokenizer import Tokenizer

SHAPES: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), max_position_embeddings=16384,
        eos_token_ids=(128001,)),
    # the TP target shape (larger than one GPU in bf16: loaded only as shards, at TP >= 2)
    "llama3-70b": ModelConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), max_position_embeddings=16384,
        eos_token_ids=(128001,)),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, eos_token_ids=(2,)),
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=4096, eos_token_ids=(0,)),
}


def random_tokenizer(shape: str) -> Tokenizer:
    """The tokenizer ``random_model(shape)`` comes with (token i is the word ``t<i>``)."""
    cfg = shape_config(shape)
    return _word_tokenizer(cfg.vocab_size, cfg.eos_token_ids)


def shape_config(shape: str) -> ModelConfig:
    """A shape by name, or ``name@N``: its first N layers (the same draws for those
    layers; a cut of a large shape that fits one GPU, to study its numerics at TP=1)."""
    name, cut, layers = shape.partition("@")
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    config = SHAPES[name]
    if cut:
        if not layers.isdigit() or not 1 <= int(layers) <= config.num_layers:
            raise ValueError(f"shape {shape!r}: after '@', a layer count in "
                             f"1..{config.num_layers}")
        config = replace(config, num_layers=int(layers))
    return config


def _word_tokenizer(vocab: int, eos: tuple[int, ...]) -> Tokenizer:
    backend = BackendTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, eos_token_ids=eos)


@torch.inference_mode()
def random_model(shape: str, dtype: torch.dtype, device: str, seed: int = 0,
                 shard: WeightShard | None = None) -> tuple[LlamaModel, Tokenizer, ModelInfo]:
    """``shard``: keep only that part of every weight (each whole weight is drawn, then
    cut, one at a time: the same bits as cutting the whole model)."""
    cfg = shape_config(shape)
    gen = torch.Generator(device=device).manual_seed(seed)
    whole = LlamaModel(cfg, dtype=dtype, device="meta")  # names and shapes, in draw order
    model = (LlamaModel(cfg, dtype=dtype, device=device) if shard is None else
             LlamaModel(shard.local_config(), dtype=dtype, device=device,
                        vocab_rows=shard.vocab_rows))
    params = dict(model.named_parameters())
    for name, p in whole.named_parameters():
        if name.endswith("norm"):
            params[name].fill_(1.0)
            continue
        std = 1.0 / p.shape[-1] ** 0.5
        w = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
        w = w.mul_(std).to(dtype)
        params[name].copy_(w if shard is None else shard.weight(name, w))
        del w
    info = ModelInfo(name=f"random-{shape}", source=Path("/dev/null"),
                     weights_hash=f"random-seed{seed}", dtype=str(dtype).removeprefix("torch."))
    return model.eval(), _word_tokenizer(cfg.vocab_size, cfg.eos_token_ids), info
