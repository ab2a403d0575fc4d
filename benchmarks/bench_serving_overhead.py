"""Overhead of the served path (HTTP -> router -> decoder replica) over the offline engine.

Same workload both ways: random-token prompts sent as token ids, greedy, ignore-EOS, fixed
output length, one decoder with one torch thread (what a Ray replica with one CPU gets).
Measured per mode:
- idle TTFT: requests one at a time (median over ``--idle-requests``);
- loaded: all ``--requests`` submitted at t=0; median TTFT, wall time, output tokens/s.
Offline = ``LLMEngine`` stepped in this process; served = ``services.app`` on a local Ray
Serve with the embedded Redis (``llm42`` adds one verifier replica: the lane then runs in
another process and the decoder reaches it over gRPC), streamed through HTTP.

On a GPU (``--device cuda``) the decoder replica is a Ray actor holding the GPU; with
``llm42`` the verifier replica shares it (``num_gpus`` of ``--verifier-gpu-fraction`` for
the verifier, the rest for the decoder; the verifier's lane kernels use every SM unless
``--verifier-confine`` confines them to that fraction: an MPS thread percentage when the MPS
daemon runs, else a green context). The model
is anything ``detserve.model.loader`` loads, ``random:<shape>`` included (e.g.
``random:llama3-8b``: the 8B shape served with no checkpoint to bring; decoder and verifier
draw the same weights from one seed); benchmarks/gpu_serving.sh runs it on the GPU machine.

    python -m benchmarks.bench_serving_overhead --model smollm2 \
        --out docs/benchmarks/serving_overhead_cpu
    python -m benchmarks.bench_serving_overhead --model /path/SmolLM2-135M-Instruct.Q4_1.gguf \
        --device cuda --dtype bfloat16 --out results/serving_overhead_gpu
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import json
import multiprocessing
import os
import random
import statistics
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.bench_offline import command_flags, hardware
from detserve.engine import LLMEngine
from detserve.model.loader import RANDOM_PREFIX, load_model
from detserve.model.random_init import shape_config
from detserve.params import SamplingParams
from services.router.metrics import watch_loop_lag
from services.serve_config import APP_NAME, DECODER


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_len: int
    deterministic: bool
    warmup_load: bool = False  # warm up with the whole load (every prompt at once), not one


@dataclass(frozen=True)
class Result:
    path: str
    mode: str
    idle_ttft_ms: float
    load_ttft_ms: float
    load_wall_s: float
    output_tok_s: float
    # what the engine did during the loaded phase (the decoder replica's engine when served):
    # ENGINE_KEYS' differences over the phase; where a served run's extra time goes
    engine: dict[str, float] = field(default_factory=dict)
    load_walls_s: list[float] = field(default_factory=list)  # every repeat's; the row: median
    # served only: where the time to first token went (``split_ttft``), idle and loaded
    ttft_split: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class ClientTiming:
    """One served request as its client saw it (monotonic seconds): sent, first token
    received, and the decoder's id of the request."""

    sent: float
    first: float
    request_id: str

    @property
    def ttft(self) -> float:
        return self.first - self.sent


SPLIT_KEYS = ("to_router_ms", "router_ms", "to_decoder_ms", "engine_queue_ms", "engine_ttft_ms",
              "back_ms")


def split_ttft(client: list[ClientTiming], server: Mapping[str, Any]) -> dict[str, float]:
    """Medians over the requests of where their TTFT went, from the client's clock and the
    decoder's ``RequestTiming`` (``server``: request id -> timing; one machine, one
    monotonic clock): the client's HTTP request until the router's handler has it
    (``to_router``), the router until it sends the request on (``router``: parsing,
    validation, admission), the handle call to the decoder replica (``to_decoder``),
    waiting there for the engine's
    next step boundary (``engine_queue``), the engine until the first token is committed
    (``engine_ttft``), and back to the client (``back``); ``dispatch_spread_s``: first
    request sent to last one received by the decoder."""
    parts: dict[str, list[float]] = {k: [] for k in SPLIT_KEYS}
    received = []
    for c in client:
        t = server.get(c.request_id)
        if t is None or t.first_token is None:
            continue
        received.append(t.received)
        for key, (a, b) in zip(SPLIT_KEYS, ((c.sent, t.accepted), (t.accepted, t.dispatched),
                                            (t.dispatched, t.received),
                                            (t.received, t.arrival),
                                            (t.arrival, t.first_token), (t.first_token, c.first)),
                               strict=True):
            parts[key].append(1e3 * (b - a))
    if not received:
        return {}
    out = {k: statistics.median(v) for k, v in parts.items()}
    out["dispatch_spread_s"] = max(received) - min(c.sent for c in client)
    out["requests"] = float(len(received))
    return out


def median_phase(phases: list[tuple[list[float], float, dict[str, float]]]
                 ) -> tuple[float, float, dict[str, float], list[float]]:
    """Of repeated loaded phases (TTFTs, wall, engine delta): the median-wall one's median
    TTFT, wall and engine delta, and every wall."""
    walls = [wall for _, wall, _ in phases]
    ttfts, wall, eng = sorted(phases, key=lambda p: p[1])[(len(phases) - 1) // 2]
    return statistics.median(ttfts), wall, eng, walls


BUSY_KEYS = ("decode_step_seconds", "mixed_step_seconds", "schedule_seconds",
             "output_seconds", "lane_submit_seconds", "lane_wait_seconds")
# decode_graph_gpu_s: GPU time of the decode steps' CUDA graph replays (CUDA events), the
# part of decode_step_seconds the GPU spent computing
# loop_deliver_seconds: the served decoder's engine thread between steps (chunks, text)
ENGINE_KEYS = ("steps", "decode_steps", "mixed_steps", *BUSY_KEYS, "decode_graph_gpu_s",
               "loop_deliver_seconds", "fast_rows",
               "preemptions", "recomputed_tokens", "prefix_cache_hit_tokens",
               "decode_graph_replays")


def engine_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """The loaded phase's share of the engine's counters (``LLMEngine.stats()``)."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ENGINE_KEYS}


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
                idle_requests: int, repeat: int = 1) -> Result:
    torch.set_num_threads(1)
    engine = LLMEngine.from_args(model, mode, **engine_kw)
    _offline_run(engine, w.prompts if w.warmup_load else w.prompts[:1], w, "warmup")
    idle = [_offline_run(engine, [p], w, f"idle{i}")[0][0]
            for i, p in enumerate(w.prompts[:idle_requests])]
    phases = []
    for r in range(repeat):
        before = engine.stats()
        ttfts, wall = _offline_run(engine, w.prompts, w, f"load{r}")
        phases.append((ttfts, wall, engine_delta(before, engine.stats())))
    ttft, wall, phase, walls = median_phase(phases)
    engine.verifier.close()  # stop the lane thread (CUDA) before the served run starts
    del engine
    gc.collect()
    if str(engine_kw.get("device", "cpu")).startswith("cuda"):
        torch.cuda.empty_cache()  # leave the GPU's memory to the served replicas
    return Result("offline", mode, 1e3 * statistics.median(idle), 1e3 * ttft, wall,
                  len(w.prompts) * w.output_len / wall, phase, walls)


# ---- served -------------------------------------------------------------------------
async def _stream(client: httpx.AsyncClient, model: str, ids: list[int], w: Workload
                  ) -> ClientTiming:
    body = {"model": model, "prompt": ids, "max_tokens": w.output_len, "temperature": 0,
            "ignore_eos": True, "is_deterministic": w.deterministic, "stream": True}
    sent = time.monotonic()
    first, rid = None, ""
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {") and '"token_ids":[]' not in line:
                first = time.monotonic()
                rid = f"{json.loads(line[len('data: '):])['id']}-0"  # the decoder's id (choice 0)
    assert first is not None, "no token streamed"
    return ClientTiming(sent, first, rid)


async def _served_phases(url: str, model: str, w: Workload, idle_requests: int, repeat: int,
                         client_procs: int = 1, links: bool = True
                         ) -> tuple[list[float], list[tuple[list[float], float, dict[str, float]]],
                                    dict[str, dict[str, float]]]:
    with ExitStack() as stack:
        pool = None
        if client_procs > 1:  # processes started (and their imports done) before any phase
            ctx = multiprocessing.get_context("spawn")
            pool = stack.enter_context(ProcessPoolExecutor(client_procs, mp_context=ctx))
            list(pool.map(time.sleep, [0.0] * client_procs))
        return await _phases(url, model, w, idle_requests, repeat, pool, client_procs, links)


def _http_client(url: str, requests: int) -> httpx.AsyncClient:
    """A client with one connection per request in flight: httpx's default pool (100
    connections) would hold back all requests past the 100th until others finish, which the
    offline engine never does (it has every request queued at t=0)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=requests)
    return httpx.AsyncClient(base_url=url, timeout=600, limits=limits)


def _client_share(url: str, model: str, w: Workload, prompts: list[list[int]], start_at: float
                  ) -> list[ClientTiming]:
    """One client process's share of a loaded phase, sent together at ``start_at``
    (monotonic seconds, one clock for the machine)."""
    async def run() -> list[ClientTiming]:
        async with _http_client(url, len(prompts)) as client:
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))
            return list(await asyncio.gather(*(_stream(client, model, p, w) for p in prompts)))
    return asyncio.run(run())


async def _pooled_load(pool: ProcessPoolExecutor, procs: int, url: str, model: str,
                       w: Workload) -> tuple[list[ClientTiming], float]:
    """The loaded phase's requests split over ``procs`` client processes (round robin),
    all sent at one instant: one Python client reading 64+ token streams falls behind.
    Returns the timings and that instant (monotonic seconds): the phase's wall starts
    there, not at this call (the processes get 0.3 s to receive their shares)."""
    start_at = time.monotonic() + 0.3
    shares = [w.prompts[i::procs] for i in range(procs)]
    done = await asyncio.gather(*(asyncio.wrap_future(pool.submit(
        _client_share, url, model, w, share, start_at)) for share in shares if share))
    return [t for share in done for t in share], start_at


async def _phases(url: str, model: str, w: Workload, idle_requests: int, repeat: int,
                  pool: ProcessPoolExecutor | None, client_procs: int, links: bool
                  ) -> tuple[list[float], list[tuple[list[float], float, dict[str, float]]],
                             dict[str, dict[str, float]]]:
    from ray import serve

    decoder = serve.get_deployment_handle(DECODER, app_name=APP_NAME)  # the one replica
    async with _http_client(url, len(w.prompts)) as client:
        if links:
            await _await_links(client)
        await asyncio.gather(*(_stream(client, model, p, w)  # warm-up
                               for p in (w.prompts if w.warmup_load else w.prompts[:1])))
        paths = parse_dispatch(await _metrics_page(client))
        idle = [await _stream(client, model, p, w) for p in w.prompts[:idle_requests]]
        splits = {"idle": await _split(decoder, idle)}
        splits["idle"]["link_share"] = _link_share(
            paths, parse_dispatch(await _metrics_page(client)))
        phases, loads = [], []
        for _ in range(repeat):
            before = (await decoder.stats.remote()).engine
            lags: list[float] = []
            page = await _metrics_page(client)
            router_before, paths = parse_router_lag(page), parse_dispatch(page)
            probe = asyncio.create_task(watch_loop_lag(lags.append, 0.005))
            cpu0 = time.process_time()  # this client's CPU (its sends and its stream reading)
            start = time.monotonic()
            if pool is None:
                timings = await asyncio.gather(*(_stream(client, model, p, w)
                                                 for p in w.prompts))
            else:
                timings, start = await _pooled_load(pool, client_procs, url, model, w)
            wall = time.monotonic() - start
            client_cpu = (time.process_time() - cpu0) / wall
            probe.cancel()
            await asyncio.sleep(0.2)  # the engine loop publishes its stats after each step
            after = (await decoder.stats.remote()).engine
            phases.append(([t.ttft for t in timings], wall, engine_delta(before, after)))
            split = await _split(decoder, list(timings))
            page = await _metrics_page(client)
            split["link_share"] = _link_share(paths, parse_dispatch(page))
            router = [b - a for a, b in zip(router_before, parse_router_lag(page), strict=True)]
            if router[0] > 0:  # the router's own loop (its /metrics histogram, this phase)
                split["router_loop_lag_mean_ms"] = 1e3 * router[1] / router[0]
                split["router_loop_late_50ms"] = (router[0] - router[2]) / router[0]
            if lags and pool is None:  # how late the client's own event loop ran
                # (inclusive: with few samples the default method puts p90 past the max)
                split["client_loop_lag_p90_ms"] = 1e3 * statistics.quantiles(
                    lags, n=10, method="inclusive")[-1] if len(lags) > 1 else 1e3 * lags[0]
                split["client_loop_lag_max_ms"] = 1e3 * max(lags)
            if pool is None:
                split["client_cpu_busy"] = client_cpu  # CPU seconds per wall second
            loads.append((wall, split))
        splits["loaded"] = sorted(loads, key=lambda x: x[0])[(len(loads) - 1) // 2][1]
        return [t.ttft for t in idle], phases, splits


LAG_METRIC = "detserve:router_event_loop_lag_seconds"


def parse_router_lag(text: str) -> tuple[float, float, float]:
    """(count, sum, count <= 50 ms) of the router's event-loop lag histogram in a
    Prometheus text page (zeros when absent)."""
    vals = {"count": 0.0, "sum": 0.0, "le": 0.0}
    for line in text.splitlines():
        if line.startswith(LAG_METRIC + "_count"):
            vals["count"] = float(line.split()[-1])
        elif line.startswith(LAG_METRIC + "_sum"):
            vals["sum"] = float(line.split()[-1])
        elif line.startswith(LAG_METRIC + '_bucket{le="0.05"}'):
            vals["le"] = float(line.split()[-1])
    return vals["count"], vals["sum"], vals["le"]


async def _metrics_page(client: httpx.AsyncClient) -> str:
    """The router's Prometheus page (``parse_router_lag``, ``parse_dispatch``)."""
    return (await client.get("/metrics")).text


DISPATCH_METRIC = "detserve:router_dispatch_total"
LINKS_METRIC = "detserve:router_decoder_links"


def parse_dispatch(text: str) -> tuple[float, float, float]:
    """(sequences sent over decoder links, through Ray Serve handle calls, links attached)
    from a router's Prometheus text page (zeros when absent)."""
    vals = {"link": 0.0, "handle": 0.0, "attached": 0.0}
    for line in text.splitlines():
        for path in ("link", "handle"):
            if line.startswith(f'{DISPATCH_METRIC}{{path="{path}"}}'):
                vals[path] = float(line.split()[-1])
        if line.startswith(LINKS_METRIC + " "):
            vals["attached"] = float(line.split()[-1])
    return vals["link"], vals["handle"], vals["attached"]


async def _await_links(client: httpx.AsyncClient, timeout_s: float = 60.0) -> None:
    """Until the router has attached its decoder's link (it reads them from Redis every
    second): the phases measure the path requests take once the cluster is up."""
    deadline = time.monotonic() + timeout_s
    while parse_dispatch(await _metrics_page(client))[2] < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the router attached no decoder link")
        await asyncio.sleep(0.2)


def _link_share(before: tuple[float, float, float], after: tuple[float, float, float]
                ) -> float:
    link, handle = after[0] - before[0], after[1] - before[1]
    return link / (link + handle) if link + handle else 0.0


async def _split(decoder: Any, client: list[ClientTiming]) -> dict[str, float]:
    timings = await decoder.request_timings.remote(min(c.sent for c in client))
    return split_ttft(client, {t.request_id: t for t in timings})


def run_served(model: str, mode: str, engine_kw: dict[str, Any], w: Workload,
               idle_requests: int, verifier_gpu_fraction: float = 0.5,
               stream_interval: int = 1, repeat: int = 1,
               pipeline_lane_prefill: bool = True, switch_interval: float = 0.0,
               client_procs: int = 1, verifier_confine: bool = False) -> Result:
    from ray import serve

    from services.app import compose
    from services.local import start_local_serve
    from services.redis_server import EmbeddedRedis
    from services.serve_config import default_serve_config

    port, grpc_port = 18000, 19000
    cuda = str(engine_kw.get("device", "cpu")).startswith("cuda")
    num_verifiers = int(mode == "llm42")
    # CPU: as before (Ray detects no GPU). CUDA: one GPU; the decoder replica takes all of it,
    # or 1 - f of it beside an llm42 verifier taking f (services.app places both).
    placement: dict[str, Any] = (
        {"verifier_gpu_fraction": verifier_gpu_fraction if num_verifiers else 0.0}
        if cuda else {})
    if switch_interval:
        placement["switch_interval"] = switch_interval
    if verifier_confine:
        placement["verifier_confine"] = True
    with EmbeddedRedis() as redis, ExitStack() as stack:
        config = default_serve_config(
            model=model, mode=mode, num_decoders=1, num_verifiers=num_verifiers,
            redis_url=redis.url, http_host="127.0.0.1", http_port=port, grpc_port=grpc_port,
            stream_interval=stream_interval, pipeline_lane_prefill=pipeline_lane_prefill,
            **engine_kw, **placement)
        start_local_serve(stack, config, num_gpus=1 if cuda else None,  # None: detect
                          num_cpus=max(4, min(8, os.cpu_count() or 4)) if cuda else 4,
                          log_to_driver=False)
        args = config["applications"][0]["args"]
        serve.run(compose(args, replica_cpus=1.0), name=APP_NAME, route_prefix="/")
        idle, phases, splits = asyncio.run(_served_phases(
            f"http://127.0.0.1:{port}", model, w, idle_requests, repeat, client_procs))
    ttft, wall, phase, walls = median_phase(phases)
    return Result("served (HTTP)", mode, 1e3 * statistics.median(idle), 1e3 * ttft, wall,
                  len(w.prompts) * w.output_len / wall, phase, walls, splits)


# ---- report -------------------------------------------------------------------------
NOTE = ("Served = HTTP client -> Router replica (Ray Serve direct ingress: no proxy actor; "
        "requests and chunks over the decoder's link, a gRPC stream, services.decoder.link) "
        "-> Decoder replica (a Ray "
        "actor with one CPU and one torch thread) and back, per committed chunk. The client, "
        "router, Ray's own processes and the decoder share the machine's cores, and "
        "served requests reach the engine one by one rather than all at t=0. In `llm42` the "
        "offline engine verifies in-process, the served decoder sends its lane passes to a "
        "verifier replica over gRPC (KV shared through shared memory).")
NOTE_GPU = ("Served = HTTP client -> Router replica (Ray Serve direct ingress: no proxy actor; "
            "requests and chunks over the decoder's link, a gRPC stream, services.decoder.link) "
            "-> Decoder replica (a Ray "
            "actor holding the GPU, one CPU) and back, per committed chunk; served requests "
            "reach the engine one by one rather than all at t=0. In `llm42` the offline engine "
            "verifies on a lane thread of its own process (all SMs), the served decoder holds "
            "1-f of the GPU and sends its lane passes over gRPC to a verifier replica holding f "
            "of it; when the MPS daemon runs, the two processes' kernels run side by side, "
            "without MPS they time-slice; either way the lane uses every SM unless "
            "--verifier-confine confines it to f (an MPS thread percentage, else a green "
            "context); KV shared through CUDA IPC. Targets (issue): "
            "served throughput >= 0.95 x offline, idle TTFT <= offline + 10 ms.")

def _loop_lines(rows: list[tuple[Result, str, dict[str, float]]], key: str, head: str,
                fmt: Callable[[dict[str, float]], str]) -> list[str]:
    """One paragraph of the rows whose split has ``key``: ``head``, then per mode ``fmt``."""
    picked = [(r, sp) for r, _, sp in rows if key in sp]
    return ["", head + "; ".join(f"{r.mode} {fmt(sp)}" for r, sp in picked)] if picked else []


def markdown(results: list[Result], meta: dict[str, Any]) -> str:
    gpu = str(meta.get("device", "cpu")).startswith("cuda")
    setup = (f"; device {meta['device']}, dtype {meta['dtype']}, verifier GPU fraction "
             f"f={meta['verifier_gpu_fraction']}, MPS {'on' if meta['mps'] else 'off'}"
             + (", verifier lane confined to f of the SMs" if meta.get("verifier_confine")
                else "") if gpu else "")
    lines = [f"# Serving overhead on {'GPU' if gpu else 'CPU'} ({meta['date']})", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}{setup}. "
             f"Command: `{meta['command']}`",
             "", f"Workload: {meta['requests']} requests, prompt {meta['prompt_len']} tokens, "
             f"output {meta['output_len']} tokens (ignore EOS, greedy), model "
             f"`{meta['model']}`, W={meta['verify_window']}, G={meta['verify_group']}; "
             "`llm42` rows send every request with `is_deterministic`; served stream "
             f"interval {meta.get('stream_interval', 1)} token(s) per chunk; served loaded "
             f"phase sent by {meta.get('client_procs', 1)} client process(es); loaded phase "
             f"run {meta.get('repeat', 1)} time(s) per path, rows from the median-wall run "
             "(walls of every run below).", "",
             "| mode | path | idle TTFT ms | loaded TTFT ms | loaded wall s | output tok/s |",
             "|---|---|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.mode} | {r.path} | {r.idle_ttft_ms:.1f} | {r.load_ttft_ms:.1f} | "
                     f"{r.load_wall_s:.2f} | {r.output_tok_s:.1f} |")
    lines += ["", "Loaded walls of every run (s): " + "; ".join(
        f"{r.mode} {r.path.split()[0]} " + ", ".join(f"{x:.2f}" for x in r.load_walls_s)
        for r in results)]
    lines += ["", "The engine during the loaded phase (seconds; the served decoder's engine):", "",
              "| mode | path | steps | decode-only | with prefill | decode-only s | decode GPU s "
              "| with prefill s | schedule s | outputs s | lane submit + wait s | busy / wall "
              "| between steps s |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        e = r.engine
        if not e:
            continue
        busy = sum(e.get(k, 0.0) for k in BUSY_KEYS)
        gpu_s = e.get("decode_graph_gpu_s", 0.0)
        lines.append(f"| {r.mode} | {r.path} | {e['steps']:.0f} | {e['decode_steps']:.0f} | "
                     f"{e['mixed_steps']:.0f} | {e['decode_step_seconds']:.2f} | "
                     f"{gpu_s:.2f} | "
                     f"{e['mixed_step_seconds']:.2f} | {e['schedule_seconds']:.2f} | "
                     f"{e['output_seconds']:.2f} | "
                     f"{e.get('lane_submit_seconds', 0.0) + e['lane_wait_seconds']:.2f} | "
                     f"{busy / r.load_wall_s:.2f} | "
                     f"{e.get('loop_deliver_seconds', 0.0):.2f} |")
    split_rows = [(r, phase, r.ttft_split[phase]) for r in results
                  for phase in ("idle", "loaded") if r.ttft_split.get(phase)]
    if split_rows:
        lines += ["", "Where a served request's time to first token went (medians, ms; one "
                  "machine-wide monotonic clock; dispatch spread: first request sent to last "
                  "one received by the decoder replica):", "",
                  "| mode | phase | client to router handler | router handler to dispatch "
                  "| router to decoder | engine queue | engine TTFT | back to client "
                  "| dispatch spread s | over links |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r, phase, sp in split_rows:
            lines.append(f"| {r.mode} | {phase} | {sp['to_router_ms']:.1f} | "
                         f"{sp['router_ms']:.1f} | {sp['to_decoder_ms']:.1f} | "
                         f"{sp['engine_queue_ms']:.1f} | {sp['engine_ttft_ms']:.1f} | "
                         f"{sp['back_ms']:.1f} | "
                         f"{'-' if phase == 'idle' else format(sp['dispatch_spread_s'], '.3f')} | "
                         f"{sp.get('link_share', 0.0):.0%} |")
        lines += _loop_lines(
            split_rows, "client_loop_lag_max_ms", "The benchmark client's own event loop during "
            "the loaded phase (how late a 5 ms sleep woke up): ",
            lambda sp: f"p90 {sp['client_loop_lag_p90_ms']:.1f} ms, max "
                       f"{sp['client_loop_lag_max_ms']:.1f} ms, its process busy "
                       f"{sp.get('client_cpu_busy', 0.0):.0%} of the wall")
        lines += _loop_lines(
            split_rows, "router_loop_lag_mean_ms", "The router's event loop during the loaded "
            "phase (its 10 ms wake-up, `detserve:router_event_loop_lag_seconds`): ",
            lambda sp: f"{sp['router_loop_lag_mean_ms']:.1f} ms late on average, "
                       f"{sp['router_loop_late_50ms']:.0%} of wake-ups more than 50 ms late")
    lines += ["", "Overhead of the served path (served / offline):", ""]
    for mode in dict.fromkeys(r.mode for r in results):
        off, srv = (next(r for r in results if r.mode == mode and r.path.startswith(p))
                    for p in ("offline", "served"))
        ratio, added = srv.output_tok_s / off.output_tok_s, srv.idle_ttft_ms - off.idle_ttft_ms
        verdict = ""
        if gpu:
            ok = ratio >= 0.95 and added <= 10.0
            verdict = f" ({'meets' if ok else 'misses'} the targets x>=0.95, <=+10 ms)"
        lines.append(f"- {mode}: idle TTFT x{srv.idle_ttft_ms / off.idle_ttft_ms:.2f} "
                     f"(+{added:.1f} ms), throughput x{ratio:.2f}{verdict}")
    lines += ["", NOTE_GPU if gpu else NOTE]
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
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the offline engine and the served replicas on GPU 0")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--verifier-gpu-fraction", type=float, default=0.5,
                    help="cuda + llm42: the verifier replica's share of the GPU (and of its "
                         "SMs), the decoder takes the rest")
    ap.add_argument("--warmup", choices=("one", "load"), default="one",
                    help="warm each path up with one request, or with the whole load once "
                         "(compiles every kernel shape the measured load meets: GPU)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="served: tokens a streamed chunk gathers before it goes out "
                         "(detserve serve --stream-interval; 1 = every step's tokens)")
    ap.add_argument("--no-pipeline-lane-prefill", action="store_true",
                    help="llm42 served: one lane round trip per prompt chunk (the offline "
                         "engine keeps its default)")
    ap.add_argument("--switch-interval", type=float, default=0.0,
                    help="served: the decoder replica's Python thread switch interval in "
                         "seconds (detserve serve --switch-interval; 0 = Python's 5 ms)")
    ap.add_argument("--verifier-confine", action="store_true",
                    help="cuda + llm42: confine the verifier's lane to its GPU share (an MPS "
                         "thread percentage, else a green context; detserve serve "
                         "--verifier-confine)")
    ap.add_argument("--prefill-batch-tokens", type=int, default=None,
                    help="both engines: while others decode, new prompts wait until this many "
                         "of their tokens are pending, at most 8 steps (detserve serve "
                         "--prefill-batch-tokens; default: the engine's for its device)")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="served loaded phase: split the requests over this many client "
                         "processes sent at one instant (one Python client reading every "
                         "token stream can fall behind the server)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the loaded phase this many times on each path (same engine, "
                         "same cluster); rows give the median-wall run")
    ap.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    a = ap.parse_args()
    gpu = a.device == "cuda"
    if a.repeat < 1 or a.client_procs < 1:
        ap.error("--repeat and --client-procs must be >= 1")
    if gpu and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device")
    if gpu and not 0.0 < a.verifier_gpu_fraction < 1.0:
        ap.error("--verifier-gpu-fraction must be in (0, 1): decoder and verifier share one GPU")
    kw: dict[str, Any] = dict(verify_window=a.verify_window, verify_group=a.verify_group,
                              max_model_len=a.max_model_len, device=a.device, dtype=a.dtype)
    if a.prefill_batch_tokens is not None:
        kw["prefill_batch_tokens"] = a.prefill_batch_tokens
    if a.model.startswith(RANDOM_PREFIX):
        vocab = shape_config(a.model[len(RANDOM_PREFIX):]).vocab_size
    else:
        vocab = load_model(a.model)[0].config.vocab_size  # on CPU: only the vocabulary
    results = []
    for mode in a.modes.split(","):
        w = Workload(make_prompts(a.requests, a.prompt_len, vocab, 0), a.output_len,
                     mode in ("llm42", "lane_only"), warmup_load=a.warmup == "load")
        results.append(run_offline(a.model, mode, kw, w, a.idle_requests, a.repeat))
        print(results[-1], flush=True)
        results.append(run_served(a.model, mode, kw, w, a.idle_requests,
                                  a.verifier_gpu_fraction, a.stream_interval, a.repeat,
                                  not a.no_pipeline_lane_prefill, a.switch_interval,
                                  a.client_procs, a.verifier_confine))
        print(results[-1], flush=True)
    cpu = f"{hardware('cpu')}, {os.cpu_count()} cores"
    machine = cpu
    if gpu:
        props = torch.cuda.get_device_properties(0)
        machine = (f"{hardware('cuda')} ({props.multi_processor_count} SMs, "
                   f"{props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}); {cpu}")
    from services.verifier.deployment import mps_running  # (what the verifier replica reads)

    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine, "torch": torch.__version__, "model": a.model,
            "verifier_gpu_fraction": a.verifier_gpu_fraction if gpu else 0.0,
            "mps": gpu and mps_running(),
            "requests": a.requests, "prompt_len": a.prompt_len, "output_len": a.output_len,
            "stream_interval": a.stream_interval, "switch_interval": a.switch_interval,
            "client_procs": a.client_procs,
            "verifier_confine": a.verifier_confine,
            "repeat": a.repeat, **kw,
            "command": "python -m benchmarks.bench_serving_overhead "
                       + " ".join(command_flags(vars(a), skip=()))}
    report = markdown(results, meta)
    print(report)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(json.dumps(
            {"meta": meta, "results": [asdict(r) for r in results]}, indent=2))
        a.out.with_suffix(".md").write_text(report)


if __name__ == "__main__":
    main()
