"""Fast-path decode step time vs the memory roofline (the GPU issue's step benchmark).

For each batch size, B sequences with a ``--context``-token prompt are prefilled, then
``--steps`` decode steps of ``nondeterministic`` mode (``--mode llm42``: llm42 with no
deterministic request, its steps replaying the decode graphs aligned with the lane, as a
step with a deterministic decode row does; ``--plain-decode-graphs``: the plain ones, as
such a step does in serving) are timed. Roofline: bytes that one
step must read (all weights + every sequence's K/V) over the measured device-to-device
copy bandwidth (bytes read + written per second).

    python -m benchmarks.bench_decode_step --model random:llama3-8b --out decode.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from benchmarks.bench_offline import hardware
from benchmarks.stream_profile import kernel_key
from detserve.config import EngineConfig
from detserve.engine import LLMEngine
from detserve.flags import add_flags, engine_kwargs, engine_options
from detserve.model.random_init import random_model
from detserve.parallel.shard import rank_weights
from detserve.params import SamplingParams


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (time.perf_counter() - t0)


def forward_ms(eng: LLMEngine, steps: int) -> float | None:
    """Time of the decode graph the last step replayed, replayed back to back with no engine
    work in between (the forward alone: weights, K/V, kernels and their gaps). None without
    CUDA graphs. The replays rewrite the K/V of the last position, as the next step would."""
    # the set the steps replayed (llm42 with ``plain_decode_graphs``: the plain one)
    sets = [g for g in (eng.runner.plain_graphs, eng.runner.decode_graphs)
            if g is not None and g.last is not None]
    if not sets:
        return None
    graph = sets[0].last
    assert graph is not None
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def profile_steps(eng: LLMEngine, steps: int, top: int = 12,
                  step: Callable[[], object] | None = None) -> dict[str, object]:
    """Kernel time of ``steps`` engine steps (or calls of ``step``): GPU busy ms per step
    and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            (step or eng.step)()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(kernel_key(ev.name), [0.0, 0])
            k[0] += ev.device_time / 1e3  # us -> ms
            k[1] += 1
    busy = sum(t for t, _ in kernels.values()) / steps
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    print(f"    GPU kernel time {busy:.2f} ms/step", flush=True)
    for name, (t, n) in ranked:
        print(f"    {t / steps:7.3f} ms/step {n / steps:6.1f} calls  {name[:160]}", flush=True)
    return {"gpu_busy_ms_per_step": busy,
            "top_kernels": [{"name": n, "ms_per_step": t / steps, "calls_per_step": c / steps}
                            for n, (t, c) in ranked]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1,8,32,64,128")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--mode", default="nondeterministic", choices=("nondeterministic", "llm42"))
    # the engine options this benchmark varies, as every command names them; the requests
    # here are not deterministic, so by default the steps replay the aligned graphs (those
    # a step with a deterministic decode row replays), --plain-decode-graphs the plain ones
    opts = engine_options()
    add_flags(p, {k: opts[k] for k in ("cuda_graphs", "align_fast_path", "lane_full_tiles",
                                       "aligned_decode_lane", "fused_silu_mul",
                                       "fused_add_rmsnorm", "plain_decode_graphs",
                                       "async_scheduling", "tensor_parallel_size", "tp_peer_sums")},
              defaults={"plain_decode_graphs": False})
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile the steps: GPU kernel time per step and the "
                        "kernels that take it (shows launch gaps and the slowest kernels)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    tp = a.tensor_parallel_size
    # rank 0's weights: the whole model at TP=1, its shard at TP=N (the engines share them)
    loaded = random_model(a.model.split(":", 1)[1], torch.bfloat16, a.device,
                          shard=rank_weights(a.model, tp))
    model = loaded[0]
    cfg_m = model.config  # (a shard's: its heads and MLP columns)
    # the bytes rank 0 reads a step: its weights (its heads, MLP columns and vocabulary
    # rows; the norms, replicated, are negligible) and its K/V heads
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    kv_per_token = 2 * cfg_m.num_layers * cfg_m.num_kv_heads * cfg_m.head_dim * 2
    bw = copy_bandwidth(a.device)
    rows = []
    budget = max(2048, a.context)  # prefill tokens per step
    for bsz in (int(x) for x in a.batches.split(",")):
        # sequences prefilled early decode while the others prefill: room for those tokens
        # too, so that no sequence finishes and the batch stays ``bsz`` in every timed step
        gen = a.steps * (2 if a.profile else 1) + -(-bsz * a.context // budget) + 8
        cfg = EngineConfig.create(a.model, a.mode, device=a.device, dtype="bfloat16",
                                  max_num_seqs=bsz, max_model_len=a.context + gen + 8,
                                  num_blocks=bsz * (a.context + gen + 32) // 16 + 64,
                                  max_num_batched_tokens=budget,
                                  **engine_kwargs(a, skip=("model", "mode", "device")))
        eng = LLMEngine(cfg, loaded=loaded)
        for i in range(bsz):
            eng.add_request(str(i), None, SamplingParams(max_tokens=gen + 4, ignore_eos=True,
                                                         output_kind="final_only"),
                            prompt_token_ids=[(7 * i + j) % 1000 + 3 for j in range(a.context)])
        while any(s.num_computed < s.num_prompt for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()
        eng.step()  # first decode step (warm-up)
        torch.cuda.synchronize()
        running = eng.scheduler.running
        ctx0 = sum(s.num_tokens for s in running)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            eng.step()
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t0) / a.steps * 1e3
        if len(running) != bsz:
            raise RuntimeError(f"batch changed during timing: {len(running)} of {bsz} left")
        # K/V every step reads: each sequence's context, averaged over the timed steps
        kv_bytes = (ctx0 + sum(s.num_tokens for s in running)) / 2 * kv_per_token
        roof_ms = (weight_bytes + kv_bytes) / bw * 1e3  # bytes that must be read once
        graphs = eng.runner.decode_graphs
        row = {"batch": bsz, "step_ms": step_ms, "roofline_ms": roof_ms,
               "ratio_to_roofline": step_ms / roof_ms,
               "padded_to": graphs.bucket(bsz) if graphs is not None else bsz}
        # (rank 0's graph alone would wait for ever for its peers' collectives)
        fwd = forward_ms(eng, a.steps) if tp == 1 else None
        if fwd is not None:  # the GPU's share: the step's graph replayed back to back
            row.update(forward_ms=fwd, forward_ratio_to_roofline=fwd / roof_ms)
        print(f"batch {bsz:>4} (padded to {row['padded_to']}): {step_ms:7.2f} ms/step  roofline {roof_ms:6.2f} ms  "
              f"({step_ms / roof_ms:.2f}x)" + (f"  forward alone {fwd:6.2f} ms "
                                              f"({fwd / roof_ms:.2f}x)" if fwd else ""),
              flush=True)
        if a.profile:
            row["profile"] = profile_steps(eng, a.steps)
        rows.append(row)
        eng.close()
        del eng
        torch.cuda.empty_cache()
    report = {"meta": {"date": dt.date.today().isoformat(), "hardware": hardware(a.device),
                       "torch": torch.__version__, "args": vars(a), "copy_bandwidth_Bps": bw,
                       "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token},
              "rows": rows}
    save_report(a.out, report)
    return 0


def save_report(out: str | None, report: Mapping[str, object]) -> None:
    """``report`` as JSON at ``out`` (nothing when None)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
