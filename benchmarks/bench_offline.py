"""Offline throughput of the engine per mode and deterministic-traffic ratio.

Random-token prompts (ignore-EOS, fixed output lengths: speed does not depend on content),
all requests submitted at t=0, like the LLM-42 paper's offline runs. Prints a table and
writes JSON + markdown with the hardware and date.

    python -m benchmarks.bench_offline --model random:tiny --num-requests 64
    python -m benchmarks.bench_offline --model smollm2 --num-requests 16 --output-len 64
    python -m benchmarks.bench_offline --model random:llama3-8b --device cuda --dtype bfloat16 \
        --lengths sharegpt --num-requests 1024
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.stream_profile import cuda_kernels, describe, stream_summary
from detserve.config import EngineConfig, opt
from detserve.engine import LLMEngine
from detserve.flags import add_engine_flags, add_flags, engine_kwargs, engine_options, options
from detserve.kernels.config import TABLE, lane_variant
from detserve.model.config import auto_dtype
from detserve.model.loader import load_model, read_model_config, resolve_dtype
from detserve.outputs import RequestOutput
from detserve.parallel.shard import rank_weights
from detserve.params import SamplingParams
from detserve.scheduler import LANE_STATES
from detserve.stats import TIMES


def lengths(kind: str, n: int, input_len: int, output_len: int, seed: int
            ) -> list[tuple[int, int]]:
    """(prompt, output) lengths. "sharegpt": log-normal fits of the paper's Table 3
    (input mean 304 / median 136, output mean 192 / median 118), clipped to [4, 1024]."""
    rng = random.Random(seed)
    if kind == "fixed":
        return [(input_len, output_len)] * n
    if kind != "sharegpt":
        raise ValueError(f"unknown length distribution {kind!r}")
    def draw(median: float, mean: float) -> int:
        sigma = math.sqrt(2 * math.log(mean / median))
        return int(min(1024, max(4, round(rng.lognormvariate(math.log(median), sigma)))))
    return [(draw(136, 304), draw(118, 192)) for _ in range(n)]


def hardware(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({torch.get_num_threads()} threads)"


def trace_prompts(path: str, tokenizer: Any, max_model_len: int
                  ) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) of a loadgen trace (``detserve bench trace``), each
    clipped to fit ``max_model_len``."""
    from loadgen.trace import load_trace

    out = []
    for r in load_trace(path).requests:
        ids = list(r.prompt_token_ids) if r.prompt_token_ids else tokenizer.encode(
            r.prompt, add_special_tokens=True)
        ids = ids[: max_model_len // 2]
        out.append((ids, max(1, min(r.output_len, max_model_len - len(ids) - 1))))
    return out


DEDICATED = "llm42-dedicated"  # llm42 verified by a replica on a device of its own


class Weights:
    """The weights the run's engines share, loaded once per TP size: the whole model at
    TP=1, rank 0's shard at TP=N (a run at TP=N never holds the whole model on one device,
    as a served decoder does not). Random shapes take ``load_model``'s fixed seed, as the
    TP workers and verifier replicas that load the same spec do."""

    def __init__(self, args: argparse.Namespace, dtype: torch.dtype | str) -> None:
        self.args, self.dtype = args, dtype
        self._by_tp: dict[int, tuple[Any, Any, Any]] = {}

    def __call__(self, tp: int) -> tuple[Any, Any, Any]:
        if tp not in self._by_tp:
            a = self.args
            self._by_tp[tp] = load_model(a.model, self.dtype, a.device,
                                         shard=rank_weights(a.model, tp))
        return self._by_tp[tp]


def run_one(weights: Weights, args: argparse.Namespace, mode: str, ratio: float,
            shapes: list[tuple[int, int]],
            prompts: list[tuple[list[int], int]] | None = None,
            profile: tuple[int, int] | None = None,
            dedicated: Any = None,
            on_start: Callable[[], None] | None = None) -> dict[str, Any]:
    """One engine run. Prompts are random tokens of ``shapes``' lengths, or ``prompts``.
    ``profile`` (a, b): record the GPU kernels of engine steps a..b-1 (``stream_profile``).
    ``dedicated`` (``benchmarks.dedicated.DedicatedVerifier`` or ``VerifierClient``): the
    verifier of a ``llm42-dedicated`` run. ``on_start``: called once every request is
    queued, just before the clock starts (several engines started together wait there)."""
    label, mode = mode, "llm42" if mode == DEDICATED else mode
    cfg = EngineConfig.create(args.model, mode, **engine_kwargs(args))
    loaded = weights(cfg.tensor_parallel_size)
    if label == DEDICATED:
        engine = dedicated.engine(cfg, loaded)
        health0 = dedicated.health()
    else:
        engine = LLMEngine(cfg, loaded=loaded)
    request_ids = add_requests(engine, args, ratio, shapes, prompts)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    sync()
    if on_start is not None:
        on_start()
    t0 = time.perf_counter()
    start = time.monotonic()  # the clock of the requests' stats
    out_tokens = finished_requests = 0
    finished: dict[bool, list[float]] = {True: [], False: []}  # deterministic? -> finish s
    first: dict[bool, list[float]] = {True: [], False: []}  # deterministic? -> first token s
    window = None if profile is None else ProfileWindow(*profile, sync)
    det_digests: dict[str, str] = {}  # request id -> digest of its tokens and logprobs
    drop = getattr(engine.verifier, "drop_requests", None)
    stopped_s = None  # the deadline (``--run-seconds``) passed: the rest were aborted
    while engine.has_unfinished_requests():
        if window is not None:
            window.tick()
        if (stopped_s is None and args.run_seconds
                and time.perf_counter() - t0 > args.run_seconds):
            stopped_s = time.perf_counter() - t0
            for request_id in request_ids:
                engine.abort_request(request_id)
        done = []
        for o in engine.step():  # final outputs only, as offline generation returns them
            if o.finish_reason == "abort":
                continue
            out_tokens += len(o.token_ids)
            finished_requests += 1
            finished[o.is_deterministic].append((o.stats.finish_time or start) - start)
            first[o.is_deterministic].append((o.stats.first_token_time or start) - start)
            if o.is_deterministic:
                det_digests[o.request_id] = output_digest(o)
                done.append(o.request_id)
        if done and drop is not None:  # a dedicated verifier frees their K/V
            drop(done)
    sync()
    elapsed = time.perf_counter() - t0
    profiled = window.finish() if window is not None else None
    stats = engine.stats()
    transfer = None
    if label == DEDICATED:
        xs = engine.verifier.transfer_stats  # type: ignore[attr-defined]
        h = dedicated.health()
        passes = max(1, stats["verify_passes"])
        transfer = {
            "pushed_bytes_per_pass": xs.bytes_out / passes,
            "pulled_bytes_per_pass": xs.bytes_in / passes,
            "pushed_rows": xs.rows_out, "pulled_rows": xs.rows_in,
            # host time the decoder waited for rows (pull) and for its pushes to be taken
            "decoder_wait_ms_per_pass": 1e3 * xs.wait_s / passes,
            "verifier_busy_fraction": (h.busy_s - health0.busy_s) / elapsed,
            "verifier_passes": h.passes - health0.passes,
        }
    gemm_rows = engine.lane_gemm_rows
    one_call = {f"{n}x{k}": sorted(v) for (n, k), v in engine.runner.lane_one_call.items()}
    buckets = engine.alignment.buckets if engine.alignment else None
    lane_sizes = engine.runner.lane_sizes() if engine.scheduler.cfg.uses_lane else None
    async_scheduling = engine.async_scheduling
    prefill_batch_tokens = engine.scheduler.cfg.prefill_batch_tokens
    engine.close()
    del engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    in_tokens = sum(len(p) for p, _ in prompts) if prompts else sum(s[0] for s in shapes)
    decoded = stats["fast_tokens"] + stats["windows"]
    lane_used = stats["lane_rows"] - stats["lane_padding_rows"]
    kinds = (("deterministic", True), ("non_deterministic", False))
    return {
        "mode": label, "deterministic_ratio": ratio, "num_requests": len(shapes),
        "finished_requests": finished_requests, "stopped_s": stopped_s,
        "transfer": transfer,
        "det_digests": dict(sorted(det_digests.items())),
        "verify_window": args.verify_window, "verify_group": args.verify_group,
        "align_fast_path": args.align_fast_path, "lane_gemm_rows": gemm_rows,
        "single_calls": args.probe_single_calls,
        "lane_one_calls": one_call,
        "lane_sizes": lane_sizes,
        "pipeline_lane_prefill": args.pipeline_lane_prefill,
        "decode_past_queued_windows": args.decode_past_queued_windows,
        "lane_max_wait_steps": args.lane_max_wait_steps,
        "parked_seq_headroom": args.parked_seq_headroom,
        "lane_prefill_ahead": args.lane_prefill_ahead,
        "lane_prefill_lookahead": args.lane_prefill_lookahead,
        "lane_partial_windows": args.lane_partial_windows,
        "variant": getattr(args, "variant", ""),
        "prefill_batch_tokens": prefill_batch_tokens,
        "prefill_held_steps": stats["prefill_held_steps"],
        "parked_admissions": stats["parked_admissions"],
        "lane_ahead_admissions": stats["lane_ahead_admissions"],
        "partial_windows": stats["partial_windows"],
        "seq_capped_steps": stats["seq_capped_steps"],
        "duration_s": elapsed,
        "request_throughput": len(shapes) / elapsed,
        "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (out_tokens + in_tokens) / elapsed,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "rollbacks": stats["rollbacks"], "windows": stats["windows"],
        "recomputed_tokens": stats["recomputed_tokens"],
        "tokens_rolled_back": stats["tokens_rolled_back"], "preemptions": stats["preemptions"],
        "rolled_back_pct_of_decoded": 100 * stats["tokens_rolled_back"] / max(1, decoded),
        "recomputed_pct_of_decoded": 100 * stats["recomputed_tokens"] / max(1, decoded),
        "verify_passes": stats["verify_passes"],
        "lane_padding_fraction": stats["lane_padding_fraction"],
        "lane_seconds": stats["lane_seconds"],
        "lane_rows_computed_per_pass": stats["lane_computed_rows"] / max(1, stats["verify_passes"]),
        # padding among the rows the lane computed (lane_padding_fraction: among G x W per pass)
        "lane_computed_padding_fraction": (1 - lane_used / stats["lane_computed_rows"]
                                           if stats["lane_computed_rows"] else 0.0),
        "decode_buckets": list(buckets) if buckets else None,
        "lane_bound_waits": stats["lane_bound_waits"],
        "steps": {k: stats[k] for k in ("decode_steps", "mixed_steps")},
        # the tail: when the last request of each kind finished, and the mean fast-path
        # batch (tokens a fast step produced)
        "last_finish_s": {"deterministic": max(finished[True], default=None),
                          "non_deterministic": max(finished[False], default=None)},
        "mean_finish_s": {k: statistics.fmean(finished[d]) if finished[d] else None
                          for k, d in kinds},
        # from t=0 (every request queued then): admission wait + prompt + the first token
        "mean_first_token_s": {k: statistics.fmean(first[d]) if first[d] else None
                               for k, d in kinds},
        "fast_tokens_per_step": stats["fast_tokens"] / max(1, stats["decode_steps"]
                                                           + stats["mixed_steps"]),
        # running lane sequences per step: on the fast path, waiting for their prompt in
        # the lane, holding a full window not yet sent, decoded as far past the lane as allowed
        "lane_seqs_per_step": {k: stats[f"lane_seqs_{k}"] for k in LANE_STATES},
        # eager steps' products with lane-aligned decode rows: one call, or split in two
        # (a second weight read; see ModelRunner._padded)
        "head_products": {k: stats[f"head_products_{k}"] for k in ("one_call", "split")},
        "profile": profiled,
        # asynchronous scheduling: rows fed the previous step's token on the device, rows
        # run after a stop token nobody had read yet (dropped)
        "async_scheduling": async_scheduling,
        "fed_rows": stats["fed_rows"], "dropped_rows": stats["dropped_rows"],
        "decision_syncs": stats["decision_syncs"],
        # steps with prompt chunks replayed as graphs (the others ran eagerly)
        "step_graph_replays": stats["step_graph_replays"],
        "decode_graph_replays": stats["decode_graph_replays"],
        "plain_graph_replays": stats["plain_graph_replays"],
        "step_seconds": {k: stats[f"{k}_seconds"] for k in TIMES},
    }


def add_requests(engine: LLMEngine, args: argparse.Namespace, ratio: float,
                 shapes: list[tuple[int, int]],
                 prompts: list[tuple[list[int], int]] | None = None) -> list[str]:
    """Queue requests ``b0``, ``b1``, ... of ``shapes``' lengths (random tokens drawn from
    ``args.seed``, or ``prompts``), a ``ratio`` of them deterministic (which ones: drawn
    from the same seed), all with ``args``' sampling options, and return their ids. The
    same arguments give the same requests in any engine."""
    vocab = engine.model.config.vocab_size
    rng = random.Random(args.seed)
    n_det = round(ratio * len(shapes))
    det_flags = [True] * n_det + [False] * (len(shapes) - n_det)
    rng.shuffle(det_flags)
    ids = [f"b{i}" for i in range(len(shapes))]
    for i, ((n_in, n_out), det) in enumerate(zip(shapes, det_flags, strict=True)):
        if prompts is not None:
            prompt, n_out = prompts[i]
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(n_in)]
        engine.add_request(ids[i], None, SamplingParams(
            max_tokens=n_out, ignore_eos=True, is_deterministic=det, output_kind="final_only",
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            logprobs=args.logprobs),
            prompt_token_ids=prompt)
    return ids


def output_digest(o: RequestOutput) -> str:
    """A request's tokens and logprobs, hashed (equal digests: bit-identical outputs)."""
    return hashlib.sha256(repr((o.token_ids, o.logprobs)).encode()).hexdigest()[:16]


class ProfileWindow:
    """torch.profiler over engine steps a..b-1 of a run (``tick`` before each step). The
    profiler's own cost slows the window, so a profiled run's throughput is not a figure."""

    def __init__(self, first: int, end: int, sync: Any) -> None:
        self.first, self.end, self.sync, self.step = first, end, sync, 0
        self.prof: Any = None
        self.summary: dict[str, Any] | None = None

    def tick(self) -> None:
        if self.step == self.first:
            from torch.profiler import ProfilerActivity, profile

            self.sync()
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.start()
        elif self.step == self.end:
            self.finish()
        self.step += 1

    def finish(self) -> dict[str, Any] | None:
        if self.prof is not None:
            self.sync()
            self.prof.stop()
            steps = min(self.step, self.end) - self.first
            self.summary = stream_summary(cuda_kernels(self.prof.events()), steps)
            self.prof = None
        return self.summary


def profile_range(text: str) -> tuple[int, int]:
    """``A:B`` -> (A, B), engine steps A..B-1 (argparse type)."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (engine steps), got {text!r}") from None
    if not 0 <= a < b:
        raise argparse.ArgumentTypeError(f"need 0 <= A < B, got {text!r}")
    return a, b


@dataclass(frozen=True)
class RequestOptions:
    """The request set (how many, their lengths, their sampling options), the untimed
    warm-up's size and a run's deadline: ``run_one`` reads them (``multi_decoder`` too);
    their flags are generated from these fields."""

    num_requests: int = opt(64, "requests in each timed run")
    lengths: str = opt("fixed", "prompt and output lengths: --input-len/--output-len for "
                                "every request, or drawn like ShareGPT conversations (seeded)",
                       choices=("fixed", "sharegpt"))
    input_len: int = opt(64, "prompt tokens (--lengths fixed)")
    output_len: int = opt(64, "output tokens (--lengths fixed)")
    warmup_requests: int = opt(4, "requests run (untimed) in each mode before the timed runs")
    temperature: float = opt(0.0, "every request's temperature (0: greedy); sampled requests "
                                  "are seeded by the engine's seed")
    top_k: int = opt(0, "every request's top-k (0: off)")
    logprobs: int | None = opt(None, "every request's number of top logprobs (none: off)")
    top_p: float = opt(1.0, "every request's top-p (1: off)")
    run_seconds: float = opt(0.0, "stop a run this long after its start, aborting its "
                                  "unfinished requests: its rollbacks and lane statistics "
                                  "still print, its throughput counts only what finished "
                                  "(0: no deadline)")


@dataclass(frozen=True)
class OfflineOptions:
    """``bench_offline``'s own options (besides the engine's and the requests'), its flags
    generated from these fields."""

    modes: str = opt("nondeterministic,batch_invariant,llm42",
                     f"comma list of the engine's modes, and {DEDICATED} (llm42 with a "
                     "verifier replica of its own, --dedicated-verifier-device)")
    ratios: str = opt("0,0.1,1.0", "deterministic ratios for llm42")
    switch_interval: float | None = opt(
        None, "Python's thread switch interval in seconds (sys.setswitchinterval): how long "
              "the engine thread may hold the GIL while the lane thread waits for it")
    variants: str | None = opt(
        None, "llm42 runs once per variant, each a comma list of flag=value (argparse "
              "names), variants split by ';', e.g. "
              "'lane_max_wait_steps=8;lane_max_wait_steps=16,lane_one_calls=0'")
    profile_steps: str | None = opt(
        None, "A:B, CUDA: profile engine steps A..B-1 of every timed run and report GPU "
              "kernel time per stream (lane vs fast path) and their overlap; the profiler "
              "slows those runs, so read their throughput as nothing")
    repeat: int = opt(1, "run the whole list of modes this many times, interleaved; the "
                         "summary gives each mode's median (two identical runs can differ by "
                         "10 % and more on a GPU)")
    trace: str | None = opt(None, "loadgen JSONL trace (real prompts, e.g. ShareGPT); "
                                  "overrides --lengths")
    sweep: str | None = opt(None, "llm42 W x G grid at the largest ratio, e.g. "
                                  "16,32,64,128x1,4,8,16")
    dedicated_verifier_device: str | None = opt(
        None, f"mode {DEDICATED}: the verifier replica's device (e.g. cuda:1; cpu registers "
              "it as another host); its K/V moves over NCCL / gloo")
    dedicated_verifier_tp: int = opt(
        1, f"mode {DEDICATED}: ranks the verifier replica's lane runs over, on its device and "
           "the ones after it (needs --tp-invariant-lane above 1)")
    out: str | None = opt(None, "JSON path (markdown written beside it)")


def add_request_flags(p: argparse.ArgumentParser) -> None:
    """The request set's flags (``RequestOptions``)."""
    add_flags(p.add_argument_group("requests"), options(RequestOptions))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    # the engine's options (one flag each, as ``detserve generate`` has them), the model a
    # random-weight one by default, the mode per run (--modes)
    add_engine_flags(p, skip=("mode",), defaults={"model": "random:tiny", "max_model_len": 2048})
    add_request_flags(p)
    add_flags(p, options(OfflineOptions))
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.profile_steps is not None:
        try:
            args.profile_steps = profile_range(args.profile_steps)
        except argparse.ArgumentTypeError as e:
            p.error(f"--profile-steps: {e}")
    if args.profile_steps and not str(args.device).startswith("cuda"):
        p.error("--profile-steps needs --device cuda (it reports CUDA kernels)")
    variants = parse_variants(args)
    for sub in variants:  # refused here, not after the first timed runs
        try:
            lane_variant(TABLE.lane, sub.aligned_decode_lane)
        except ValueError as e:
            p.error(f"--aligned-decode-lane: {e}")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.dtype == "auto":  # resolved once: the loaded weights and every engine agree
        args.dtype = auto_dtype(read_model_config(args.model), args.device)
    weights = Weights(args, resolve_dtype(args.dtype))
    prompts = None
    if args.trace:
        tokenizer = weights(args.tensor_parallel_size)[1]
        prompts = trace_prompts(args.trace, tokenizer, args.max_model_len)[: args.num_requests]
        shapes = [(len(p), n) for p, n in prompts]
    else:
        shapes = lengths(args.lengths, args.num_requests, args.input_len, args.output_len,
                         args.seed)
    runs: list[dict[str, Any]] = []
    dedicated = None
    if DEDICATED in args.modes.split(","):
        if not args.dedicated_verifier_device:
            p.error(f"mode {DEDICATED} needs --dedicated-verifier-device")
        from benchmarks.dedicated import DedicatedVerifier

        if args.dedicated_verifier_tp > 1 and not args.tp_invariant_lane:
            p.error("--dedicated-verifier-tp above 1 needs --tp-invariant-lane")
        dedicated = DedicatedVerifier(args.model, args.dtype, args.dedicated_verifier_device,
                                      tensor_parallel_size=args.dedicated_verifier_tp)
    try:
        return _run_all(args, weights, shapes, prompts, variants, runs, dedicated)
    finally:
        if dedicated is not None:
            dedicated.close()


def _run_all(args: argparse.Namespace, weights: Weights, shapes: list[tuple[int, int]],
             prompts: list[tuple[list[int], int]] | None, variants: list[argparse.Namespace],
             runs: list[dict[str, Any]], dedicated: Any) -> int:
    # warm-up (not recorded): compiles kernels and captures graphs for the shapes the timed
    # runs meet, so the first timed run does not pay for them
    warm = shapes[: max(1, min(args.warmup_requests, len(shapes)))]
    warm_prompts = prompts[: len(warm)] if prompts else None
    run_one(weights, args, "nondeterministic", 0.0, warm, warm_prompts)
    if "llm42" in args.modes.split(","):
        run_one(weights, args, "llm42", 1.0, warm, warm_prompts)
    if dedicated is not None:
        run_one(weights, args, DEDICATED, 1.0, warm, warm_prompts, dedicated=dedicated)

    def record(r: dict[str, Any]) -> None:
        runs.append(r)
        lane = r["mode"] in ("llm42", DEDICATED)
        geo = f"W={r['verify_window']:<3} G={r['verify_group']:<2}" if lane else " " * 11
        if r.get("variant"):
            print(f"{'':>16} variant: {r['variant']}", flush=True)
        if r.get("stopped_s") is not None:
            print(f"{'':>16} stopped at {r['stopped_s']:.0f} s: {r['finished_requests']} of "
                  f"{r['num_requests']} requests finished", flush=True)
        print(f"{r['mode']:>16} det={r['deterministic_ratio']:>4.0%} {geo} "
              f"{r['output_throughput']:9.1f} out tok/s  "
              f"{r['total_token_throughput']:9.1f} tot tok/s  rollbacks={r['rollbacks']:>4} "
              f"recomputed={r['recomputed_pct_of_decoded']:5.2f}%  "
              f"lane padding={r['lane_padding_fraction']:.1%}", flush=True)
        st, sec = r["steps"], r["step_seconds"]
        print(f"{'':>16} steps: {st['decode_steps']:.0f} decode-only "
              f"({sec['decode_step']:.1f} s), {st['mixed_steps']:.0f} with prefill "
              f"({sec['mixed_step']:.1f} s, {r['step_graph_replays']:.0f} as graphs); schedule {sec['schedule']:.1f} s, lane "
              f"submit {sec['lane_submit']:.2f} s, wait/apply {sec['lane_wait']:.2f} s, "
              f"outputs {sec['output']:.1f} s; "
              f"{r['prefill_held_steps']:.0f} steps held prompts back", flush=True)
        last, mean = r["last_finish_s"], r["mean_finish_s"]
        fmt = lambda x: "-" if x is None else f"{x:.1f} s"  # noqa: E731
        print(f"{'':>16} finish (mean / last): deterministic {fmt(mean['deterministic'])} / "
              f"{fmt(last['deterministic'])}, others {fmt(mean['non_deterministic'])} / "
              f"{fmt(last['non_deterministic'])}; {r['fast_tokens_per_step']:.1f} fast tokens "
              "a step", flush=True)
        ttft = r["mean_first_token_s"]
        print(f"{'':>16} first token (mean from t=0): deterministic "
              f"{fmt(ttft['deterministic'])}, others {fmt(ttft['non_deterministic'])}", flush=True)
        if r.get("transfer"):
            t = r["transfer"]
            print(f"{'':>16} transfer: {t['pushed_bytes_per_pass'] / 1e6:.2f} MB pushed and "
                  f"{t['pulled_bytes_per_pass'] / 1e6:.2f} MB pulled a pass; the decoder "
                  f"waited {t['decoder_wait_ms_per_pass']:.3f} ms a pass; verifier busy "
                  f"{t['verifier_busy_fraction']:.1%}", flush=True)
        if lane:
            hp = r["head_products"]
            print(f"{'':>16} lane sequences a step: " + ", ".join(
                f"{k} {v:.1f}" for k, v in r["lane_seqs_per_step"].items())
                + f"; products with aligned decode rows: {hp['one_call']} one call, "
                f"{hp['split']} split; {r['plain_graph_replays']} of "
                f"{r['decode_graph_replays']} decode graph replays plain", flush=True)
            print(f"{'':>16} lane: {r['verify_passes']} passes, "
                  f"{r['lane_rows_computed_per_pass']:.0f} rows computed a pass, "
                  f"{r['lane_computed_padding_fraction']:.1%} of them padding, "
                  f"{r['lane_seconds']:.2f} s; {r['parked_admissions']:.0f} admissions in "
                  f"parked sequences' slots, {r['seq_capped_steps']:.0f} steps full at "
                  f"max-num-seqs; {r['lane_ahead_admissions']:.0f} prompts admitted ahead "
                  f"into spare lane rows; {r['partial_windows']:.0f} partial windows; "
                  f"{r['decision_syncs']:.0f} decisions read the batch in flight first",
                  flush=True)
        if r.get("profile"):
            for line in describe(r["profile"]):
                print(f"{'':>16} {line}", flush=True)
        _save(args, runs)  # after every run: a cut-off job still leaves its figures

    for rep in range(args.repeat):  # interleaved: a slow spell hits every mode alike
        for mode in args.modes.split(","):
            lane = mode in ("llm42", DEDICATED)
            ratios = ([float(r) for r in args.ratios.split(",")] if lane
                      else [1.0 if mode in ("batch_invariant", "lane_only") else 0.0])
            for ratio in ratios:
                for sub in variants if lane else [args]:
                    record({**run_one(weights, sub, mode, ratio, shapes, prompts,
                                      args.profile_steps, dedicated), "repeat": rep})
    for line in audit_lines(runs):
        print(line, flush=True)
    if args.sweep:
        ws, gs = (tuple(int(x) for x in part.split(",")) for part in args.sweep.split("x"))
        ratio = max(float(r) for r in args.ratios.split(","))
        for w in ws:
            for g in gs:
                sub = argparse.Namespace(**{**vars(args), "verify_window": w, "verify_group": g})
                record(run_one(weights, sub, "llm42", ratio, shapes, prompts))
    return 0


def audit_lines(runs: list[dict[str, Any]]) -> list[str]:
    """Whether every run with a lane gave each deterministic request the same tokens and
    logprobs (co-located, dedicated, repeats, and across ratios where a request is
    deterministic in both); batch_invariant runs, whose kernels have other bits than the
    lane's, are audited among themselves."""
    lines = []
    for family, label in (("lane", "determinism audit"),
                          ("batch_invariant", "determinism audit, batch_invariant")):
        mine = [r for r in runs if r.get("det_digests")
                and (r["mode"] == "batch_invariant") == (family == "batch_invariant")]
        seen: dict[str, set[str]] = {}
        for r in mine:
            for rid, digest in r["det_digests"].items():
                seen.setdefault(rid, set()).add(digest)
        if not seen:
            continue
        differ = sorted(rid for rid, d in seen.items() if len(d) > 1)
        lines.append(f"{label}: {len(seen)} deterministic requests over {len(mine)} runs: "
                     f"{len(seen) - len(differ)} with one output, {len(differ)} with more"
                     + (f" ({', '.join(differ[:8])})" if differ else ""))
    return lines


def parse_variants(args: argparse.Namespace) -> list[argparse.Namespace]:
    """``args`` once per ``--variants`` entry, with its flags set (values parsed as the
    engine option's declared type, else as the flag's current type) and ``variant`` naming
    it; ``[args]`` without the option."""
    if not args.variants:
        return [args]
    declared = {name: o.type for name, o in engine_options().items()}
    out = []
    for spec in args.variants.split(";"):
        over: dict[str, Any] = {}
        for part in filter(None, spec.split(",")):
            name, _, text = part.partition("=")
            name = name.strip().replace("-", "_")
            if name not in vars(args) or name in ("variants", "out") or not text:
                raise SystemExit(f"--variants: {part!r} is not flag=value of a known flag")
            cur, text = getattr(args, name), text.strip()
            kind = declared.get(name, type(cur) if cur is not None else None)
            if kind is bool:
                over[name] = text not in ("0", "false", "no", "off")
            elif kind is None:  # (flags without a default here take numbers)
                over[name] = int(text) if text.lstrip("-").isdigit() else text
            else:
                try:
                    over[name] = kind(text)
                except ValueError:
                    raise SystemExit(f"--variants: {part!r}: {name} takes a "
                                     f"{kind.__name__}") from None
        out.append(argparse.Namespace(**{**vars(args), **over, "variant": spec.strip()}))
    return out


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mode, ratio, W, G, variant): the median output throughput over its runs, its
    range, and its ratio to the median nondeterministic run."""
    groups: dict[tuple[Any, ...], list[float]] = {}
    for r in runs:
        key = (r["mode"], r["deterministic_ratio"], r["verify_window"], r["verify_group"],
               r.get("variant", ""))
        groups.setdefault(key, []).append(r["output_throughput"])
    base = groups.get(next((k for k in groups if k[0] == "nondeterministic"), ()), [])
    base_med = statistics.median(base) if base else None
    return [{"mode": k[0], "deterministic_ratio": k[1], "verify_window": k[2],
             "verify_group": k[3], "variant": k[4], "runs": len(v), "median_output_throughput":
             statistics.median(v), "min": min(v), "max": max(v),
             "vs_nondeterministic_median": statistics.median(v) / base_med if base_med else None}
            for k, v in groups.items()]


def _save(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    meta = {"date": dt.date.today().isoformat(), "hardware": hardware(args.device),
            "torch": torch.__version__, "args": vars(args)}
    report = {"meta": meta, "runs": runs, "summary": summarize(runs)}
    base = next((r for r in runs if r["mode"] == "nondeterministic"), None)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        out.with_suffix(".md").write_text(markdown(report, base))


def markdown(report: dict[str, Any], base: dict[str, Any] | None) -> str:
    m = report["meta"]
    a = m["args"]
    lines = [f"# Offline throughput: {a['model']} on {m['hardware']}", "",
             f"Date {m['date']}, torch {m['torch']}, dtype {a['dtype']}, W={a['verify_window']}, "
             f"G={a['verify_group']}, {a['num_requests']} requests, "
             + (f"prompts and output lengths from {a['trace']}." if a.get("trace") else
                f"lengths={a['lengths']} (input {a['input_len']}, output {a['output_len']} "
                "when fixed)."), "",
             f"Command: `python -m benchmarks.bench_offline {' '.join(command_flags(a))}`", "",
             "| mode | det. ratio | W x G | output tok/s | total tok/s | vs nondet | rollbacks | "
             "recomputed % of decoded | lane padding |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        rel = (f"{r['output_throughput'] / base['output_throughput']:.3f}x"
               if base and base['output_throughput'] else "-")
        geo = (f"{r['verify_window']} x {r['verify_group']}"
               if r["mode"] in ("llm42", DEDICATED) else "-")
        name = f"{r['mode']} ({r['variant']})" if r.get("variant") else r["mode"]
        lines.append(f"| {name} | {r['deterministic_ratio']:.0%} | {geo} | "
                     f"{r['output_throughput']:.1f} | {r['total_token_throughput']:.1f} | {rel} | "
                     f"{r['rollbacks']} | {r['recomputed_pct_of_decoded']:.2f} | "
                     f"{r['lane_padding_fraction']:.1%} |")
    summary = report.get("summary") or []
    if any(s["runs"] > 1 for s in summary):
        lines += ["", "Medians over the repeated runs (ratios: median / median of "
                  "nondeterministic):", "",
                  "| mode | det. ratio | runs | median output tok/s | range | vs nondet |",
                  "|---|---|---|---|---|---|"]
        for s in summary:
            rel = (f"{s['vs_nondeterministic_median']:.3f}x"
                   if s["vs_nondeterministic_median"] else "-")
            name = f"{s['mode']} ({s['variant']})" if s.get("variant") else s["mode"]
            lines.append(f"| {name} | {s['deterministic_ratio']:.0%} | {s['runs']} | "
                         f"{s['median_output_throughput']:.1f} | {s['min']:.1f}-{s['max']:.1f} | "
                         f"{rel} |")
    return "\n".join(lines) + "\n"


def command_flags(a: Mapping[str, Any], skip: Iterable[str] = ("out",)) -> list[str]:
    """Parsed arguments back as the command-line flags that give them (unset ones left out;
    a store_true flag bare)."""
    skipped = set(skip)
    flags = []
    for k, v in a.items():
        if v is None or v is False or k in skipped:
            continue
        flags.append(f"--{k.replace('_', '-')}" + ("" if v is True else f" {shlex.quote(str(v))}"))
    return flags


if __name__ == "__main__":
    raise SystemExit(main())
