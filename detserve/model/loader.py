"""``load_model(spec)``: one entry point for HF folders, GGUF files and named demo models."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from detserve.model.config import ModelConfig, auto_dtype
from detserve.model.fetch import fetch_smollm2, sha256_file
from detserve.model.hf_loader import hf_weight_files, iter_hf_weights, read_hf_config
from detserve.model.identity import ModelInfo
from detserve.model.llama import LlamaModel, WeightShard
from detserve.model.random_init import random_model, shape_config
from detserve.model.tokenizer import Tokenizer

ALIASES = ("smollm2",)
RANDOM_PREFIX = "random:"
# Files at least this big get their digest cached beside them as <file>.sha256.
_HASH_CACHE_MIN_BYTES = 16 << 20
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The torch dtype of a name ("bfloat16", "bf16", ...); "auto" is resolved by
    ``load_model`` or ``EngineConfig.create``, which know the model and the device."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (known: auto, {', '.join(sorted(_DTYPES))})")
    return _DTYPES[dtype]


def read_model_config(spec: str | Path) -> ModelConfig:
    """``spec``'s hyper-parameters from its metadata alone (no weights read), as
    ``load_model`` would see them. The same errors as ``load_model`` for a bad ``spec``."""
    if str(spec).startswith(RANDOM_PREFIX):
        return shape_config(str(spec)[len(RANDOM_PREFIX):])
    _, path = _resolve_spec(spec)
    if path.is_dir():
        return read_hf_config(path)
    from detserve.model.gguf_loader import open_gguf, read_gguf_config

    return read_gguf_config(open_gguf(path))


def load_model(spec: str | Path, dtype: torch.dtype | str = "auto",
               device: str | torch.device = "cpu", shard: WeightShard | None = None
               ) -> tuple[LlamaModel, Tokenizer, ModelInfo]:
    """Load weights, tokenizer and identity for ``spec``.

    ``spec``: an HF folder (config.json + weights + tokenizer.json), a ``.gguf`` file, an
    alias (``smollm2``, fetched on first use), or ``random:<shape>`` (random weights of a
    real shape, e.g. ``random:llama3-8b``, drawn on ``device`` from a fixed seed: for
    throughput runs that need no checkpoint). ``dtype="auto"``: see
    ``model.config.auto_dtype``. ``shard``: load only that part of every weight (the
    checkpoint is read tensor by tensor and cut on the host, so ``device`` never holds
    the whole model); the identity is the whole model's. FileNotFoundError for a missing
    path, ValueError for something that is none of these.
    """
    if str(spec).startswith(RANDOM_PREFIX):
        shape = str(spec)[len(RANDOM_PREFIX):]
        return random_model(shape, _pick_dtype(dtype, shape_config(shape), device),
                            str(device), shard=shard)
    name, path = _resolve_spec(spec)
    if path.is_dir():
        config = read_hf_config(path)
        torch_dtype = _pick_dtype(dtype, config, device)
        tokenizer = Tokenizer.from_tokenizer_json(path / "tokenizer.json", path)
        model = _build(config, torch_dtype, device, iter_hf_weights(path), shard)
        files = [path / "config.json", *hf_weight_files(path)]
    else:
        # gguf is imported only for GGUF checkpoints
        from detserve.model.gguf_loader import iter_gguf_weights, open_gguf, read_gguf_config

        reader = open_gguf(path)
        config = read_gguf_config(reader)
        torch_dtype = _pick_dtype(dtype, config, device)
        tokenizer = Tokenizer.from_gguf(reader)
        model = _build(config, torch_dtype, device, iter_gguf_weights(reader, config),
                       shard)
        files = [path]
    info = ModelInfo(name=name, source=path, weights_hash=weights_hash(files),
                     dtype=str(torch_dtype).removeprefix("torch."))
    return model, tokenizer, info


def _pick_dtype(dtype: torch.dtype | str, config: ModelConfig,
                device: str | torch.device) -> torch.dtype:
    return resolve_dtype(auto_dtype(config, str(device)) if dtype == "auto" else dtype)


def _resolve_spec(spec: str | Path) -> tuple[str, Path]:
    if str(spec) == "smollm2":
        return "smollm2", fetch_smollm2()
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a folder without config.json: not a Hugging Face model")
        return path.resolve().name, path.resolve()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: expected a .gguf file or a Hugging Face folder")
        return path.stem, path.resolve()
    if path.suffix == ".gguf" or len(path.parts) > 1:
        raise FileNotFoundError(f"model path {path} does not exist")
    raise ValueError(f"unknown model {spec!r}: not a path, not one of the aliases {ALIASES}, "
                     f"and not {RANDOM_PREFIX}<shape>")


def _build(config: ModelConfig, dtype: torch.dtype, device: str | torch.device,
           weights: Iterable[tuple[str, torch.Tensor]], shard: WeightShard | None
           ) -> LlamaModel:
    if shard is None:
        model = LlamaModel(config, dtype=dtype, device=device)
        model.load_weights(weights)
    else:
        model = LlamaModel(shard.local_config(), dtype=dtype, device=device,
                           vocab_rows=shard.vocab_rows)
        model.load_weights(weights, shard.weight)
    return model.eval()


def weights_hash(files: list[Path]) -> str:
    """See ``ModelInfo.weights_hash``."""
    if len(files) == 1:
        return file_sha256(files[0])
    lines = sorted(f"{file_sha256(f)}  {f.name}\n" for f in files)
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file; big files cache it in ``<file>.sha256``, keyed by size and mtime."""
    stat = path.stat()
    if stat.st_size < _HASH_CACHE_MIN_BYTES:
        return sha256_file(path)
    cache = path.with_name(path.name + ".sha256")
    key = f"{stat.st_size} {stat.st_mtime_ns}"
    try:
        digest, cached_key = cache.read_text().strip().split(" ", 1)
        if cached_key == key and len(digest) == 64:
            return digest
    except (OSError, ValueError):
        pass
    digest = sha256_file(path)
    try:
        tmp = cache.with_name(cache.name + f".{os.getpid()}.tmp")
        tmp.write_text(f"{digest} {key}\n")
        tmp.replace(cache)
    except OSError:  # read-only model folder: just recompute next time
        pass
    return digest
