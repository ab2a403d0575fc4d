"""Argument groups shared by the CLI's subcommands, and their conversion to specs."""

from __future__ import annotations

import argparse
import math
from typing import Any

from loadgen.datasets import DATASETS, DatasetSpec
from loadgen.metrics import DEFAULT_PERCENTILES
from loadgen.targets import Target, make_target
from loadgen.tokenizer import Tokenizer, load_tokenizer
from loadgen.traffic import TrafficSpec

ENGINE_MODES = ("llm42", "nondeterministic", "batch_invariant", "lane_only")


def floats(text: str) -> tuple[float, ...]:
    return tuple(math.inf if x.strip() == "inf" else float(x) for x in text.split(",") if x)


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", help="data file/folder (default: fetch the real data)")
    g.add_argument("--num-requests", "--num-prompts", type=int, default=100)
    g.add_argument("--dataset-seed", type=int, default=0)
    g.add_argument("--input-len", type=int, default=1024, help="random/shared-prefix")
    g.add_argument("--output-len", type=int, default=128, help="random/shared-prefix")
    g.add_argument("--range-ratio", type=float, default=0.0, help="random lengths +/- ratio")
    g.add_argument("--prefix-len", type=int, default=0, help="random/shared-prefix")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix")
    g.add_argument("--suffix-len", type=int, default=64, help="shared-prefix")
    g.add_argument("--min-len", type=int, default=4, help="sharegpt filter")
    g.add_argument("--max-prompt-len", type=int, default=1024, help="sharegpt filter")
    g.add_argument("--max-total-len", type=int, default=2048, help="sharegpt filter")
    g.add_argument("--fixed-output-len", type=int, help="sharegpt: override output lengths")
    g.add_argument("--max-input-len", type=int, help="arxiv(-like): cap prompt tokens")
    g.add_argument("--max-output-len", type=int, help="arxiv-like: cap output tokens")


def dataset_spec(a: argparse.Namespace) -> DatasetSpec:
    return DatasetSpec(
        name=a.dataset, num_requests=a.num_requests, seed=a.dataset_seed, path=a.dataset_path,
        min_len=a.min_len, max_prompt_len=a.max_prompt_len, max_total_len=a.max_total_len,
        fixed_output_len=a.fixed_output_len, input_len=a.input_len, output_len=a.output_len,
        range_ratio=a.range_ratio, prefix_len=a.prefix_len, num_prefixes=a.num_prefixes,
        suffix_len=a.suffix_len, max_input_len=a.max_input_len,
        max_output_len=a.max_output_len)


def add_traffic_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("traffic")
    g.add_argument("--qps", "--request-rate", type=float, default=math.inf,
                   help="requests per second; inf (default) sends everything at t=0")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    g.add_argument("--ramp-up-s", type=float, default=0.0)
    g.add_argument("--ramp-start-qps", type=float, default=0.0)
    g.add_argument("--deterministic-ratio", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0, help="arrivals and deterministic flags")
    g.add_argument("--sampling-seed", type=int, help="per-request seeds = this + index")
    g.add_argument("--temperature", type=float)
    g.add_argument("--logprobs", type=int)


def traffic_spec(a: argparse.Namespace) -> TrafficSpec:
    return TrafficSpec(qps=a.qps, burstiness=a.burstiness, ramp_up_s=a.ramp_up_s,
                       ramp_start_qps=a.ramp_start_qps, deterministic_ratio=a.deterministic_ratio,
                       seed=a.seed, sampling_seed=a.sampling_seed, temperature=a.temperature,
                       logprobs=a.logprobs)


def add_target_args(p: argparse.ArgumentParser, *, many: bool = False) -> None:
    g = p.add_argument_group("target")
    if many:
        g.add_argument("--target", action="append", default=[], metavar="[MODE=]URL",
                       help="http(s)://, grpc:// or 'engine'; MODE=URL binds a server to a "
                            "mode; repeatable (default: engine)")
    else:
        g.add_argument("--target", default="engine", help="http(s)://..., grpc://... or engine")
    g.add_argument("--api", choices=("completions", "chat"), default="completions")
    g.add_argument("--served-model-name", help="the 'model' field (default: the server's)")
    g.add_argument("--no-extra-fields", action="store_true",
                   help="do not send is_deterministic/ignore_eos (for other servers)")
    g.add_argument("--send-token-ids", action="store_true",
                   help="send prompt token ids instead of text where the trace has them")
    g.add_argument("--tokenizer", help="bytes | llama3 | smollm2 | path (default: the "
                                       "engine's; llama3 for servers)")
    e = p.add_argument_group("in-process engine (--target engine)")
    e.add_argument("--model", default="smollm2", help="HF folder, .gguf file or 'smollm2'")
    e.add_argument("--mode", choices=ENGINE_MODES, default="llm42")
    e.add_argument("--device", default="cpu")
    e.add_argument("--verify-window", type=int, default=64)
    e.add_argument("--verify-group", type=int, default=8)
    e.add_argument("--fastpath-perturbation", type=float, default=0.0)
    e.add_argument("--engine-seed", type=int, default=0)
    e.add_argument("--dtype", help="engine dtype (default: the engine's)")
    e.add_argument("--max-model-len", type=int, help="(default: the engine's)")
    e.add_argument("--max-num-seqs", type=int, help="(default: the engine's)")


def engine_args(a: argparse.Namespace, mode: str | None = None) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": a.model, "mode": mode or a.mode, "device": a.device,
        "verify_window": a.verify_window, "verify_group": a.verify_group,
        "fastpath_perturbation": a.fastpath_perturbation, "seed": a.engine_seed}
    for key in ("dtype", "max_model_len", "max_num_seqs"):
        if getattr(a, key) is not None:
            args[key] = getattr(a, key)
    return args


def tokenizer_arg(a: argparse.Namespace, target: Target | None) -> Tokenizer:
    if a.tokenizer:
        return load_tokenizer(a.tokenizer)
    if target is not None and target.tokenizer is not None:
        return target.tokenizer
    return load_tokenizer("llama3")


def build_target(a: argparse.Namespace, url: str, mode: str | None = None,
                 tokenizer: Tokenizer | None = None) -> Target:
    return make_target(url, label=mode, model=a.served_model_name, api=a.api,
                       extra_fields=not a.no_extra_fields, send_token_ids=a.send_token_ids,
                       tokenizer=tokenizer, engine_args=engine_args(a, mode))


def add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--max-concurrency", type=int)
    g.add_argument("--request-timeout-s", type=float, default=600.0)
    g.add_argument("--percentiles", type=floats, default=DEFAULT_PERCENTILES,
                   help="comma-separated, e.g. 50,90,99")
    g.add_argument("--no-progress", action="store_true")
