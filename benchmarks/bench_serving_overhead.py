"""Overhead of the served path (HTTP -> router -> decoder replica) over the offline engine.

Same workload both ways: random-token prompts sent as token ids, greedy, ignore-EOS, fixed
output length, one decoder with one torch thread (what a Ray replica with one CPU gets).
Measured per mode:
- idle TTFT: requests one at a time (median over ``--idle-requests``);
- loaded: all ``--requests`` submitted at t=0; median TTFT, wall time, output tokens/s.
Offline = ``LLMEngine`` stepped in this process; served = ``services.app`` on a local Ray
Serve with the embedded Redis (``llm42`` adds one verifier replica: the lane then runs in
another process and the decoder reaches it over gRPC), streamed through HTTP.

    python -m benchmarks.bench_serving_overhead --model smollm2 \
        --out docs/benchmarks/serving_overhead_cpu
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.bench_offline import hardware
from detserve.engine import LLMEngine
from detserve.params import SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_len: int
    deterministic: bool


@dataclass(frozen=True)
class Result:
    path: str
    mode: str
    idle_ttft_ms: float
    load_ttft_ms: float
    load_wall_s: float
    output_tok_s: float


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


# ---- offline ------------------------------------------------------------------------
def _offline_run(engine: LLMEngine, prompts: list[list[int]], w: Workload, tag: str
                 ) -> tuple[list[float], float]:
    """TTFTs (s) and wall time of ``prompts`` submitted together."""
    params = SamplingParams(max_tokens=w.output_len, ignore_eos=True,
                            is_deterministic=w.deterministic)
    start = time.perf_counter()
    first: dict[str, float] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", None, params, prompt_token_ids=ids)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
    return list(first.values()), time.perf_counter() - start


def run_offline(model: str, mode: str, engine_kw: dict[str, Any], w: Workload,
                idle_requests: int) -> Result:
    torch.set_num_threads(1)
    engine = LLMEngine.from_args(model, mode, **engine_kw)
    _offline_run(engine, w.prompts[:1], w, "warmup")
    idle = [_offline_run(engine, [p], w, f"idle{i}")[0][0]
            for i, p in enumerate(w.prompts[:idle_requests])]
    ttfts, wall = _offline_run(engine, w.prompts, w, "load")
    return Result("offline", mode, 1e3 * statistics.median(idle),
                  1e3 * statistics.median(ttfts), wall, len(w.prompts) * w.output_len / wall)


# ---- served -------------------------------------------------------------------------
async def _stream(client: httpx.AsyncClient, model: str, ids: list[int], w: Workload
                  ) -> float:
    body = {"model": model, "prompt": ids, "max_tokens": w.output_len, "temperature": 0,
            "ignore_eos": True, "is_deterministic": w.deterministic, "stream": True}
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"token_ids":[]' not in line:
                ttft = time.perf_counter() - start
    assert ttft is not None, "no token streamed"
    return ttft


async def _served_phases(url: str, model: str, w: Workload, idle_requests: int
                         ) -> tuple[list[float], list[float], float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await _stream(client, model, w.prompts[0], w)  # warm-up
        idle = [await _stream(client, model, p, w) for p in w.prompts[:idle_requests]]
        start = time.perf_counter()
        ttfts = await asyncio.gather(*(_stream(client, model, p, w) for p in w.prompts))
        return idle, list(ttfts), time.perf_counter() - start


def run_served(model: str, mode: str, engine_kw: dict[str, Any], w: Workload,
               idle_requests: int) -> Result:
    import ray
    from ray import serve

    from detserve.redis_server import EmbeddedRedis
    from detserve.serve_config import GRPC_SERVICER_FUNCTIONS, default_serve_config
    from services.app import compose

    port, grpc_port = 18000, 19000
    with EmbeddedRedis() as redis:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port},
                        grpc_options={"port": grpc_port,
                                      "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS)})
            config = default_serve_config(
                model=model, mode=mode, num_decoders=1, num_verifiers=int(mode == "llm42"),
                redis_url=redis.url, http_port=port, grpc_port=grpc_port, **engine_kw)
            args = config["applications"][0]["args"]
            serve.run(compose(args, replica_cpus=1.0), name="detserve", route_prefix="/")
            idle, ttfts, wall = asyncio.run(_served_phases(f"http://127.0.0.1:{port}", model,
                                                           w, idle_requests))
        finally:
            serve.shutdown()
            ray.shutdown()
    return Result("served (HTTP)", mode, 1e3 * statistics.median(idle),
                  1e3 * statistics.median(ttfts), wall, len(w.prompts) * w.output_len / wall)


# ---- report -------------------------------------------------------------------------
NOTE = ("Served = HTTP client -> Ray Serve proxy -> Router replica -> Decoder replica (a Ray "
        "actor with one CPU and one torch thread) and back, per committed chunk. The client, "
        "proxy, router, Ray's own processes and the decoder share the machine's cores, and "
        "served requests reach the engine one by one rather than all at t=0. In `llm42` the "
        "offline engine verifies in-process, the served decoder sends its lane passes to a "
        "verifier replica over gRPC (KV shared through shared memory).")

def markdown(results: list[Result], meta: dict[str, Any]) -> str:
    lines = [f"# Serving overhead on CPU ({meta['date']})", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}. Command: `{meta['command']}`",
             "", f"Workload: {meta['requests']} requests, prompt {meta['prompt_len']} tokens, "
             f"output {meta['output_len']} tokens (ignore EOS, greedy), model "
             f"`{meta['model']}`, W={meta['verify_window']}, G={meta['verify_group']}; "
             "`llm42` rows send every request with `is_deterministic`.", "",
             "| mode | path | idle TTFT ms | loaded TTFT ms | loaded wall s | output tok/s |",
             "|---|---|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.mode} | {r.path} | {r.idle_ttft_ms:.1f} | {r.load_ttft_ms:.1f} | "
                     f"{r.load_wall_s:.2f} | {r.output_tok_s:.1f} |")
    lines += ["", "Overhead of the served path (served / offline):", ""]
    for mode in dict.fromkeys(r.mode for r in results):
        off, srv = (next(r for r in results if r.mode == mode and r.path.startswith(p))
                    for p in ("offline", "served"))
        lines.append(f"- {mode}: idle TTFT x{srv.idle_ttft_ms / off.idle_ttft_ms:.2f} "
                     f"(+{srv.idle_ttft_ms - off.idle_ttft_ms:.1f} ms), throughput "
                     f"x{srv.output_tok_s / off.output_tok_s:.2f}")
    lines += ["", NOTE]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--modes", default="nondeterministic,llm42")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--idle-requests", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--verify-window", "-W", type=int, default=16)
    ap.add_argument("--verify-group", "-G", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    a = ap.parse_args()
    kw = dict(verify_window=a.verify_window, verify_group=a.verify_group,
              max_model_len=a.max_model_len)
    vocab = LLMEngine.from_args(a.model, "nondeterministic", **kw).model.config.vocab_size
    results = []
    for mode in a.modes.split(","):
        w = Workload(make_prompts(a.requests, a.prompt_len, vocab, 0), a.output_len,
                     mode in ("llm42", "lane_only"))
        for run in (run_offline, run_served):
            results.append(run(a.model, mode, kw, w, a.idle_requests))
            print(results[-1], flush=True)
    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{hardware('cpu')}, {os.cpu_count()} cores", "torch": torch.__version__, "model": a.model,
            "requests": a.requests, "prompt_len": a.prompt_len, "output_len": a.output_len,
            **kw, "command": "python -m benchmarks.bench_serving_overhead " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v is not None)}
    report = markdown(results, meta)
    print(report)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(json.dumps(
            {"meta": meta, "results": [asdict(r) for r in results]}, indent=2))
        a.out.with_suffix(".md").write_text(report)


if __name__ == "__main__":
    main()
