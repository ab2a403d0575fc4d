"""Seeded sampling of many rows: picked together (``sampler.gumbel_rows``: one Triton pass,
or torch's kernels) against row by row, as the fast path's steps and the lane's passes
sample them.

    python -m benchmarks.bench_sampler --device cuda --rows 1,8,64,128,512 --out sampler.json

For each row count: ``launch_rows`` over that many rows of fp32 logits of ``--vocab``
columns (temperature 1.0, a top-k on every other row, 63-bit seeds), timed on the host
(the launch: what the engine's thread spends) and to the tokens on the host (launch +
device + copy back), medians of ``--iters`` after a warm-up. Paths (``SamplerConfig``s):
"row" (row by row, ``gumbel_chunk_rows`` 0, the path before), "torch" (torch's kernels, 64
rows at a time), "kernel" (``kernels.gumbel``, the CUDA default), "lpk" (also
``logprob_kernel``: rows with
``--logprobs`` take the many-row paths, their logprobs from ``kernels.logprobs``). Each
path's tokens, and the ids of their top logprobs, must equal row by row's, or the run
stops. ``--temperature 0`` times greedy rows.

    python -m benchmarks.bench_sampler --device cuda --logprobs 5 --paths row,kernel,lpk
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_offline import hardware
from detserve import sampler
from detserve.config import SamplerConfig
from detserve.params import SamplingSpec


def _specs(n: int, temperature: float, logprobs: int | None
           ) -> tuple[list[SamplingSpec], list[int]]:
    specs = [SamplingSpec(temperature=temperature, top_k=(0, 50)[i % 2], logprobs=logprobs,
                          seed=(i * 0x9E3779B97F4A7C15) % (1 << 63)) for i in range(n)]
    return specs, [300 + i for i in range(n)]


PATHS = {"row": SamplerConfig(0, False), "torch": SamplerConfig(64, False),
         "kernel": SamplerConfig(64, True), "lpk": SamplerConfig(64, True, True)}
Picked = list[tuple[int, list[int] | None]]  # per row: token, ids of its top logprobs


def _time(logits: torch.Tensor, specs: list[SamplingSpec], positions: list[int], path: str,
          iters: int, sync: bool) -> tuple[float, float, Picked]:
    """(median launch ms, median ms to the tokens on the host, what was picked)."""
    launch, total = [], []
    picked: Picked = []
    for i in range(iters + 2):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        rows = sampler.launch_rows(logits, specs, positions, cfg=PATHS[path])
        t1 = time.perf_counter()
        picked = [(t, None if lp is None else list(lp.top)) for t, lp in rows.result()]
        t2 = time.perf_counter()
        if i >= 2:  # (warm-up)
            launch.append((t1 - t0) * 1e3)
            total.append((t2 - t0) * 1e3)
    return statistics.median(launch), statistics.median(total), picked


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--vocab", type=int, default=128256, help="columns (Llama 3's vocabulary)")
    p.add_argument("--rows", default="1,8,64,128,512")
    p.add_argument("--paths", default="row,torch,kernel",
                   help=f"of {', '.join(PATHS)}; row (row by row) is the reference")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy rows")
    p.add_argument("--logprobs", type=int, default=None, help="top logprobs every row asks for")
    p.add_argument("--out", default=None, help="JSON path (markdown written beside it)")
    a = p.parse_args(argv)
    paths = a.paths.split(",")
    if "row" not in paths or not set(paths) <= set(PATHS):
        p.error(f"--paths: some of {', '.join(PATHS)}, row (the reference) among them")
    if not a.device.startswith("cuda"):
        print("note: on CPU launch_rows keeps every sampled row on the row-by-row path")
    sync = a.device.startswith("cuda")
    torch.manual_seed(0)
    results = []
    for n in (int(r) for r in a.rows.split(",")):
        logits = torch.randn(n, a.vocab, device=a.device) * 4
        specs, positions = _specs(n, a.temperature, a.logprobs)
        ref: Picked | None = None
        for path in sorted(paths, key=lambda x: x != "row"):
            launch, total, picked = _time(logits, specs, positions, path, a.iters, sync)
            if path == "row":
                ref = picked
            elif picked != ref:
                raise SystemExit(f"rows {n}, path {path}: tokens or top ids differ from row "
                                 "by row")
            results.append({"rows": n, "path": path, "launch_ms": launch, "total_ms": total})
            print(f"rows {n:4d}  {path:>6}  launch {launch:8.2f} ms  to tokens {total:8.2f} ms",
                  flush=True)
    if a.out:
        meta = {"date": dt.date.today().isoformat(), "hardware": hardware(a.device),
                "torch": torch.__version__, "args": vars(a)}
        Path(a.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        lines = [f"# Sampling many rows ({meta['hardware']}, torch {meta['torch']}, "
                 f"{meta['date']}; vocab {a.vocab}, temperature {a.temperature}, "
                 f"logprobs {a.logprobs})", "",
                 "| rows | path | launch ms | ms to tokens |", "|---|---|---|---|"]
        lines += [f"| {r['rows']} | {r['path']} | {r['launch_ms']:.2f} | {r['total_ms']:.2f} |"
                  for r in results]
        Path(a.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
