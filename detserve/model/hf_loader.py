"""Load a Hugging Face checkpoint folder: ``config.json`` plus safetensors or torch shards.

Weights are yielded one tensor at a time (safetensors are memory-mapped), so peak memory
stays near one copy of the model: the ``LlamaModel`` being filled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from detserve.model.config import ModelConfig

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"

_SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


def read_hf_config_dict(folder: str | Path) -> dict[str, Any]:
    """``config.json`` as a dict, normalised to the keys ``ModelConfig.from_hf`` reads."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    cfg: dict[str, Any] = json.loads(path.read_text())
    # transformers >= 5 writes RoPE scaling only under "rope_parameters" (merged with
    # rope_theta); without this the llama3 scaling would be silently dropped.
    params = cfg.get("rope_parameters")
    if not cfg.get("rope_scaling") and isinstance(params, dict):
        if params.get("rope_type", params.get("type")) not in (None, "default"):
            cfg["rope_scaling"] = params
    return cfg


def read_hf_config(folder: str | Path) -> ModelConfig:
    """Validated ``ModelConfig`` for a Llama-family HF folder; raises ValueError otherwise."""
    cfg = read_hf_config_dict(folder)
    model_type = cfg.get("model_type")
    if model_type not in _SUPPORTED_TYPES:
        raise ValueError(f"{folder}: model_type {model_type!r} not in {_SUPPORTED_TYPES}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{folder}: hidden_act {cfg['hidden_act']!r} unsupported (need silu)")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{folder}: mlp_bias is unsupported")
    # Llama's attention_bias also puts a bias on o_proj, which LlamaModel does not have;
    # only the Qwen2 form (bias on q/k/v alone) is supported.
    if model_type != "qwen2" and cfg.get("attention_bias"):
        raise ValueError(f"{folder}: attention_bias with an o_proj bias is unsupported")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{folder}: sliding-window attention is unsupported")
    return ModelConfig.from_hf(cfg)


def hf_weight_files(folder: str | Path) -> list[Path]:
    """The weight files of the folder, in load order; FileNotFoundError when there are none.

    Preference: single safetensors, sharded safetensors, single torch bin, sharded bin.
    """
    root = Path(folder)
    if (root / SAFETENSORS).is_file():
        return [root / SAFETENSORS]
    for index_name in (SAFETENSORS_INDEX, TORCH_BIN_INDEX):
        index = root / index_name
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = [root / name for name in sorted(set(weight_map.values()))]
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"{index} names missing shards: {missing[:3]}")
            return files
    if (root / TORCH_BIN).is_file():
        return [root / TORCH_BIN]
    raise FileNotFoundError(
        f"no weights in {root} (looked for {SAFETENSORS}, {SAFETENSORS_INDEX}, {TORCH_BIN})"
    )


def iter_hf_weights(folder: str | Path) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(HF name, tensor)`` lazily, file by file, on the CPU."""
    for path in hf_weight_files(folder):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            # weights_only refuses arbitrary pickles; mmap avoids reading the shard twice.
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
            del state
