"""The offline API's vLLM-style defaults: dtype "auto", max_model_len from the model, and
prompts given as text or as token-id dicts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from engine_utils import random_prompts
from model_helpers import make_random_llama, write_llama_gguf

from detserve import LLM, SamplingParams
from detserve.cli import build_parser, register_detserve_commands
from detserve.config import DEFAULT_MAX_MODEL_LEN_CAP, EngineConfig
from detserve.model.config import auto_dtype
from detserve.model.loader import load_model, read_model_config


def _folder(tmp_path: Path, name: str, **config: object) -> Path:
    """A tiny random HF checkpoint whose config.json has ``config`` merged in."""
    folder = make_random_llama(tmp_path / name)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


@pytest.fixture(scope="module")
def model_512() -> str:
    return str(make_random_llama(max_position_embeddings=512))


@pytest.fixture(scope="module")
def llm(model_512: str) -> LLM:
    return LLM(model_512, verify_window=8, verify_group=4)


def test_auto_dtype_rule() -> None:
    base = read_model_config("random:tiny")
    assert base.checkpoint_dtype is None
    for checkpoint, cuda in ((None, "bfloat16"), ("float32", "bfloat16"),
                             ("bfloat16", "bfloat16"), ("float16", "float16")):
        cfg = dataclasses.replace(base, checkpoint_dtype=checkpoint)
        assert auto_dtype(cfg, "cpu") == "float32"
        assert auto_dtype(cfg, "cuda") == auto_dtype(cfg, "cuda:1") == cuda


def test_auto_dtype_reads_the_checkpoint(tmp_path: Path) -> None:
    """HF folders carry their dtype in config.json (absent: float32); a GGUF file has none
    of its own (its weights dequantize); CPU runs float32 whatever the checkpoint."""
    f32 = _folder(tmp_path, "f32")
    bf16 = _folder(tmp_path, "bf16", torch_dtype="bfloat16", dtype=None)
    fp16 = _folder(tmp_path, "fp16", dtype="float16")
    bare = _folder(tmp_path, "bare", dtype=None)
    gguf = write_llama_gguf(f32, tmp_path / "m.gguf")
    expect = {f32: "bfloat16", bf16: "bfloat16", fp16: "float16", bare: "bfloat16",
              gguf: "bfloat16", "random:tiny": "bfloat16"}
    for spec, cuda in expect.items():
        # the config is validated only, nothing is allocated: a CUDA config builds anywhere
        assert EngineConfig.create(str(spec), device="cuda").dtype == cuda, spec
        assert EngineConfig.create(str(spec)).dtype == "float32", spec
    assert EngineConfig.create(str(bf16), device="cuda", dtype="float32").dtype == "float32"
    assert load_model(fp16)[2].dtype == "float32"  # the loader resolves "auto" alike
    with pytest.raises(ValueError, match="EngineConfig.create resolves 'auto'"):
        EngineConfig(model=str(f32), dtype="auto")


def test_llm_defaults_follow_the_model(llm: LLM) -> None:
    """A model with 512 positions is served at 512 (no longer refused), in float32 on CPU."""
    assert llm.engine.config.dtype == "float32" and llm.engine.model_info.dtype == "float32"
    assert llm.engine.config.scheduler.max_model_len == 512
    out = llm.generate([{"prompt_token_ids": [5] * 500}],
                       SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"  # up to 512 in all


def test_explicit_max_model_len_beyond_the_model_is_refused(model_512: str) -> None:
    with pytest.raises(ValueError, match="max_model_len 1024 exceeds the model's 512 "
                                         "positions"):
        LLM(model_512, max_model_len=1024)
    assert LLM(model_512, max_model_len=256).engine.config.scheduler.max_model_len == 256


def test_long_context_models_get_a_bounded_cache_by_default(tmp_path: Path) -> None:
    """The KV cache is sized from max_model_len: a 131072-position model's default is
    capped, so the default cache stays as small as for any model; an explicit length
    sizes the cache from that length, as before."""
    long = str(_folder(tmp_path, "long", max_position_embeddings=131072))
    cfg = EngineConfig.create(long)
    assert cfg.scheduler.max_model_len == DEFAULT_MAX_MODEL_LEN_CAP
    assert cfg.cache.num_tokens <= 2 * DEFAULT_MAX_MODEL_LEN_CAP + cfg.cache.block_size
    assert EngineConfig.create(long, max_model_len=2048).cache.num_blocks == 1024
    explicit = EngineConfig.create(long, max_model_len=65536)
    assert explicit.scheduler.max_model_len == 65536
    assert explicit.cache.num_tokens >= 2 * 65536
    # the benchmarks' shape with their explicit --max-model-len 2048: the cache they had
    bench = EngineConfig.create("random:llama3-8b", device="cuda", dtype="bfloat16",
                                max_model_len=2048)
    assert (bench.scheduler.max_model_len, bench.cache.num_blocks) == (2048, 1024)
    assert EngineConfig.create("random:llama3-8b").scheduler.max_model_len == min(
        read_model_config("random:llama3-8b").max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)


def test_prompts_as_text_and_token_dicts_in_one_list(llm: LLM) -> None:
    text = "hello world, this is a test"
    ids = llm.tokenizer.encode(text, add_special_tokens=True)
    other = random_prompts(1, [9], seed=4)[0]
    p = SamplingParams(max_tokens=6, ignore_eos=True, is_deterministic=True, logprobs=0)
    mixed = llm.generate([text, {"prompt_token_ids": other}, {"prompt_token_ids": ids},
                          {"prompt": text}], p)
    alone = [llm.generate(text, p)[0], llm.generate({"prompt_token_ids": other}, p)[0]]
    assert [o.token_ids for o in mixed] == [alone[0].token_ids, alone[1].token_ids,
                                            alone[0].token_ids, alone[0].token_ids]
    assert mixed[0].logprobs == mixed[2].logprobs == alone[0].logprobs
    assert mixed[1].logprobs == alone[1].logprobs


@pytest.mark.parametrize("prompt,match", [
    (5, "prompt 1: expected a string or a dict with 'prompt_token_ids', got int"),
    (None, "got NoneType"),
    ([1, 2, 3], "got list"),
    ("", "non-empty"),
    ({"prompt_token_ids": "1 2 3"}, "prompt_token_ids must be a list of integer token ids"),
    ({"prompt_token_ids": [1, "2"]}, "prompt_token_ids must be a list of integer token ids"),
    ({"prompt_token_ids": [1, True]}, "prompt_token_ids must be a list of integer token ids"),
    ({"prompt_token_ids": 7}, "prompt_token_ids must be a list of integer token ids"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, 10_000]}, "token ids must be integers in"),
    ({"token_ids": [1, 2]}, r"a dict prompt is .*got keys \['token_ids'\]"),
    ({"prompt_token_ids": [1], "prompt": "x"}, "got keys"),
    ({"prompt": 3}, "'prompt' must be a string"),
])
def test_bad_prompt_items_are_refused(llm: LLM, prompt: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine", prompt], SamplingParams(max_tokens=2))  # type: ignore[list-item]
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()


def test_params_count_must_match(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"one SamplingParams per prompt \(2\), got 1"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_cli_defaults_are_auto() -> None:
    args = build_parser([register_detserve_commands]).parse_args(
        ["generate", "--prompt", "hi"])
    assert args.dtype == "auto" and args.max_model_len is None
