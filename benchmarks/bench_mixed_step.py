"""Time of one eager fast-path step that carries decode rows and prefill rows (a mixed step).

At 10 % deterministic traffic llm42 loses most of its time in these steps (docs/benchmarks/
gpu/README.md, "10 % deterministic traffic, repeated"), and bench_decode_step times
decode-only steps only. This benchmark calls the engine's runner directly with one fixed
batch, ``--decode-rows`` single-token rows at context ``--context`` plus one prefill chunk of
``--prefill-tokens`` tokens, in three variants:

- ``nondeterministic``: the baseline engine's step;
- ``llm42, no lane row``: an llm42 engine (fast path aligned with the lane on CUDA) when
  no decode row of the step belongs to a deterministic request (``align_decode=False``);
- ``llm42, lane rows``: the same step when some do (``align_decode=True``): decode rows'
  products padded to their lane-class bucket and run apart from the prefill rows, except
  the products whose step size the engine's start-up probe found in the lane chunk's
  algorithm (``gemm_classes.single_call_sizes``), which run as one call;
- ``llm42, lane rows, split``: the same without that probe (every product split).

The K/V read is whatever the pool holds (timing only; nothing is sampled from a real
context). ``--profile`` adds the GPU kernel time per step and the top kernels per variant.

    python -m benchmarks.bench_mixed_step --model random:llama3-8b --out mixed.json
    python -m benchmarks.bench_mixed_step --model random:tiny --device cpu --dtype float32
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from benchmarks.bench_decode_step import profile_steps, save_report
from benchmarks.bench_offline import hardware
from detserve.config import EngineConfig
from detserve.engine import LLMEngine
from detserve.executor.attention import RowSegment
from detserve.flags import add_flags, engine_options
from detserve.model.random_init import random_model
from detserve.params import SamplingSpec

BLOCK = 16
VARIANTS: tuple[tuple[str, str, bool, bool], ...] = (  # name, mode, align_decode, probe
    ("nondeterministic", "nondeterministic", False, True),
    ("llm42, no lane row", "llm42", False, True),
    ("llm42, lane rows", "llm42", True, True),
    ("llm42, lane rows, split", "llm42", True, False),
)


def mixed_batch(decode_rows: int, context: int, prefill_tokens: int, block_size: int,
                vocab: int) -> tuple[list[RowSegment], list[SamplingSpec | None], int]:
    """Segments (decode rows first, then the prefill chunk, as the scheduler orders them),
    their sampling specs, and the blocks they use (disjoint tables from block 0)."""
    per_decode = -(-(context + 1) // block_size)
    segs: list[RowSegment] = []
    specs: list[SamplingSpec | None] = []
    for i in range(decode_rows):
        table = tuple(range(i * per_decode, (i + 1) * per_decode))
        segs.append(RowSegment(((7 * i) % (vocab - 3) + 3,), context, table))
        specs.append(SamplingSpec(prompt_len=context))
    first = decode_rows * per_decode
    table = tuple(range(first, first + -(-prefill_tokens // block_size)))
    ids = tuple((11 * j) % (vocab - 3) + 3 for j in range(prefill_tokens))
    segs.append(RowSegment(ids, 0, table))
    specs.append(SamplingSpec(prompt_len=prefill_tokens))
    return segs, specs, first + len(table)


def time_step(step: Callable[[], Any], steps: int, sync: Callable[[], None]) -> float:
    step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="random:llama3-8b", help="random:<shape>")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--decode-rows", type=int, default=85,
                   help="single-token rows (85: the mean of the 8B ShareGPT-like runs)")
    p.add_argument("--context", type=int, default=400, help="context of each decode row")
    p.add_argument("--prefill-tokens", type=int, default=512, help="tokens of the prefill chunk")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--verify-window", "-W", type=int, default=64)
    p.add_argument("--verify-group", "-G", type=int, default=8)
    # 0 runs the step eagerly, not as a step graph (the option as every command names it)
    add_flags(p, {"cuda_graph_step_rows": engine_options()["cuda_graph_step_rows"]})
    p.add_argument("--profile", action="store_true",
                   help="also the GPU kernel time per step and the top kernels (CUDA)")
    p.add_argument("--out", default=None, help="JSON path")
    a = p.parse_args(argv)
    if not a.model.startswith("random:"):
        p.error("--model must be random:<shape> (the step's content does not matter)")
    if a.decode_rows < 1 or a.prefill_tokens < 1:
        p.error("--decode-rows and --prefill-tokens must be >= 1")
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = getattr(torch, a.dtype)
    loaded = random_model(a.model.split(":", 1)[1], dtype, a.device)
    vocab = loaded[0].config.vocab_size
    rows: list[dict[str, Any]] = []
    segs, specs, blocks = mixed_batch(a.decode_rows, a.context, a.prefill_tokens, BLOCK, vocab)
    for name, mode, align, probe in VARIANTS:
        cfg = EngineConfig.create(a.model, mode, device=a.device, dtype=a.dtype,
                                  probe_single_calls=probe,
                                  verify_window=a.verify_window, verify_group=a.verify_group,
                                  max_num_seqs=max(128, a.decode_rows),
                                  max_num_batched_tokens=max(2048, a.decode_rows + a.prefill_tokens),
                                  max_model_len=max(a.context, a.prefill_tokens) + 64,
                                  num_blocks=blocks + 1, block_size=BLOCK,
                                  cuda_graph_step_rows=a.cuda_graph_step_rows)
        t0 = time.perf_counter()
        eng = LLMEngine(cfg, loaded=loaded)
        start_s = time.perf_counter() - t0  # with graph capture and the alignment probes
        try:
            step = partial(eng.runner.run_batch, segs, specs, align_decode=align)
            ms = time_step(step, a.steps, sync)
            single = eng.alignment.single_call if eng.alignment else {}
            m = sum(len(x.input_ids) for x in segs)
            graphed = eng.runner.step_graphs is not None and eng.runner.step_graphs.replays > 0
            row: dict[str, Any] = {"variant": name, "mode": mode, "align_decode": align,
                                   "step_ms": ms, "step_rows": m, "engine_start_s": start_s,
                                   "step_graph": graphed,
                                   "unsplit_products": sorted(f"{n}x{k}" for (n, k), ok in
                                                              single.items() if m in ok)}
            print(f"{name:<24} {ms:8.2f} ms/step ({'graph' if graphed else 'eager'})  products unsplit at {m} rows: "
                  f"{row['unsplit_products'] if align else 'all'} (engine start "
                  f"{start_s:.1f} s)", flush=True)
            if a.profile and cuda:
                row["profile"] = profile_steps(eng, a.steps, step=step)
            rows.append(row)
        finally:
            eng.close()
            del eng
            if cuda:
                torch.cuda.empty_cache()
    base = rows[0]["step_ms"]
    for row in rows:
        row["vs_nondeterministic"] = row["step_ms"] / base
    report = {"meta": {"date": dt.date.today().isoformat(), "hardware": hardware(a.device),
                       "torch": torch.__version__, "args": vars(a)}, "rows": rows}
    print("variant                   ms/step  vs nondeterministic")
    for row in rows:
        print(f"{row['variant']:<24} {row['step_ms']:8.2f}  {row['vs_nondeterministic']:.2f}x")
    save_report(a.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
