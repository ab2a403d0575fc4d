"""Lane pass cost on the GPU: alone, and next to fast-path decoding (8B shape by default).

    python -m benchmarks.bench_lane_pass --model random:llama3-8b --out lane-pass.json

Cases, each a pass of the lane's G x W rows:
- ``windows``: G verify windows of W rows at context ``--context``;
- ``half``: G/2 windows (the rest padding; only the GEMM chunks the rows fill run);
- ``prefill``: one prompt chunk of G x W rows from position 0.
Each is timed with the lane graph and eagerly (``--iters`` passes, the pass's own host work
and sampling included). Then the overlap: ``--steps`` fast-path decode steps of
``--batch`` sequences alone, ``--passes`` window passes alone on the lane's thread and
stream, and both at once; ``overlap`` = (decode alone + lane alone) / together (1: the
two serialise, 2: perfect overlap). ``--profile`` adds the top CUDA kernels of one eager
window pass.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_offline import hardware
from detserve.config import EngineConfig
from detserve.engine import LLMEngine
from detserve.executor.attention import RowSegment
from detserve.executor.runner import ModelRunner
from detserve.lane import LanePass, LaneSegment
from detserve.model.random_init import random_model
from detserve.params import SamplingSpec
from detserve.verifier import ThreadedVerifier

GREEDY = SamplingSpec()


class Tables:
    """Block tables straight from the engine's block manager (no scheduler involved)."""

    def __init__(self, eng: LLMEngine) -> None:
        self.blocks = eng.blocks

    def new(self, num_tokens: int) -> tuple[int, ...]:
        table: list[int] = []
        if not self.blocks.grow(table, num_tokens):
            raise RuntimeError("KV pool too small for the benchmark")
        return tuple(table)


def window_pass(runner: ModelRunner, tables: list[tuple[int, ...]], ctx: int, w: int,
                pass_id: int = 0) -> LanePass:
    segs = [LaneSegment(f"w{i}", "window", ctx, tuple(range(3, 3 + w)), t, tuple(range(4, 3 + w)),
                        tuple(range(w)), GREEDY) for i, t in enumerate(tables)]
    return LanePass(pass_id, runner.lane_rows, tuple(segs))


def prefill_pass(runner: ModelRunner, table: tuple[int, ...], start: int, n: int) -> LanePass:
    seg = LaneSegment("p", "prefill", start, tuple((7 * j) % 1000 + 3 for j in range(n)), table,
                      (), (n - 1,), GREEDY)
    return LanePass(0, runner.lane_rows, (seg,))


def fill(runner: ModelRunner, table: tuple[int, ...], ctx: int) -> None:
    """Write real K/V for positions 0..ctx-1 (lane prefill passes)."""
    for start in range(0, ctx, runner.lane_rows):
        runner.run_lane(prefill_pass(runner, table, start, min(runner.lane_rows, ctx - start)))


def time_passes(runner: ModelRunner, lane_pass: LanePass, iters: int) -> float:
    runner.run_lane(lane_pass)  # warm-up (captures the graph of this size)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        runner.run_lane(lane_pass)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def decode_steps(runner: ModelRunner, segs: list[RowSegment], steps: int) -> float:
    specs: list[SamplingSpec | None] = [GREEDY] * len(segs)
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.run_batch(segs, specs)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def lane_thread(runner: ModelRunner, passes: list[LanePass], decode: list[RowSegment] | None,
                steps: int) -> tuple[float, float]:
    """Seconds until every pass is back (and the decode steps done, if any); and the
    seconds the passes' own clocks report."""
    verifier = ThreadedVerifier(runner)
    try:
        t0 = time.perf_counter()
        for p in passes:
            verifier.submit(p)
        if decode:
            decode_steps(runner, decode, steps)
        got: list[Any] = []
        while len(got) < len(passes):
            got += verifier.poll(wait=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, sum(r.elapsed_s for r in got)
    finally:
        verifier.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--window", "-W", type=int, default=64)
    p.add_argument("--group", "-G", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=64, help="decode batch of the overlap test")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--passes", type=int, default=10)
    p.add_argument("--lane-gemm-rows", type=int, default=0)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    loaded = random_model(a.model.split(":", 1)[1], torch.bfloat16, a.device)
    ctx, w, g = a.context, a.window, a.group
    max_len = ctx + 2 * g * w + 64
    cfg = EngineConfig.create(a.model, "llm42", device=a.device, dtype="bfloat16",
                              verify_window=w, verify_group=g, max_num_seqs=max(128, a.batch),
                              max_model_len=max_len,
                              num_blocks=(a.batch + 2 * g + 2) * (max_len // 16 + 2),
                              lane_gemm_rows=a.lane_gemm_rows, cuda_graphs=True)
    eng = LLMEngine(cfg, loaded=loaded)
    eng.verifier.close()  # the benchmark drives the runner itself
    runner = eng.runner
    tables = Tables(eng)
    win_tables = [tables.new(ctx + w + 1) for _ in range(g)]
    for t in win_tables:
        fill(runner, t, ctx)
    pre_table = tables.new(g * w + 1)
    cases = {"windows": window_pass(runner, win_tables, ctx, w),
             "half": window_pass(runner, win_tables[: max(1, g // 2)], ctx, w),
             "prefill": prefill_pass(runner, pre_table, 0, g * w)}
    report: dict[str, Any] = {"lane_gemm_rows": runner.lane_gemm_rows,
                              "lane_sizes": runner.lane_sizes(),
                              "decode_buckets": list(runner.decode_buckets or ()), "cases": {}}
    print(f"lane {runner.lane_rows} rows, GEMM chunk {runner.lane_gemm_rows}, runs at "
          f"{runner.lane_sizes()}; decode buckets {report['decode_buckets']}", flush=True)
    graph = runner.lane_graph
    for name, lp in cases.items():
        row: dict[str, Any] = {"used_rows": lp.used_rows, "run_rows": runner.lane_run_rows(lp.used_rows)}
        for label, lg in (("graph_ms", graph), ("eager_ms", None)):
            runner.lane_graph = lg
            row[label] = time_passes(runner, lp, a.iters)
        runner.lane_graph = graph
        report["cases"][name] = row
        print(f"{name:>8}: {lp.used_rows} rows used, runs {row['run_rows']}: graph "
              f"{row['graph_ms']:.2f} ms, eager {row['eager_ms']:.2f} ms", flush=True)

    dec_tables = [tables.new(ctx + 2) for _ in range(a.batch)]
    for t in dec_tables:
        fill(runner, t, ctx)
    dec = [RowSegment((5,), ctx, t) for t in dec_tables]
    decode_steps(runner, dec, 3)  # warm-up
    t_dec = decode_steps(runner, dec, a.steps)
    passes = [window_pass(runner, win_tables, ctx, w, i) for i in range(a.passes)]
    t_lane, _ = lane_thread(runner, passes, None, 0)
    t_both, lane_clock = lane_thread(runner, passes, dec, a.steps)
    overlap = {"decode_alone_s": t_dec, "decode_step_ms": t_dec / a.steps * 1e3,
               "lane_alone_s": t_lane, "lane_pass_ms_alone": t_lane / a.passes * 1e3,
               "together_s": t_both, "lane_pass_ms_together": lane_clock / a.passes * 1e3,
               "overlap": (t_dec + t_lane) / t_both}
    report["overlap"] = overlap
    print(f"overlap: {a.steps} decode steps (batch {a.batch}) {t_dec:.3f} s alone, "
          f"{a.passes} window passes {t_lane:.3f} s alone, {t_both:.3f} s together "
          f"-> overlap {overlap['overlap']:.2f} (lane pass {overlap['lane_pass_ms_together']:.1f} "
          f"ms on its clock, together)", flush=True)

    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        runner.lane_graph = None
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.run_lane(cases["windows"])
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
        print(table)
        report["profile"] = table
    eng.close()
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({
            "meta": {"date": dt.date.today().isoformat(), "hardware": hardware(a.device),
                     "torch": torch.__version__, "args": vars(a)}, **report}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
