"""GPU time and lane bits of each matrix product of a model shape, by row count.

For every product shape (N, K) of ``--shape`` (Llama-3-8B by default) and every row count M
of ``--rows``: the time of one ``F.linear`` call (bf16, a CUDA graph of ``--calls`` calls
replayed, so no launch gaps), and whether that one call gives every row the bits that calls
of exactly ``--chunk`` rows (the lane's) give it (``gemm_classes.lane_call_sizes``, the
engine's start-up probe: two inputs). ``--pads B:P,...``: the time of a B-row product
padded to P rows (zero rows appended, the result cut back), against the plain B- and P-row
calls: what padding one product to its class member costs next to padding them all.

    python -m benchmarks.bench_gemm_rows --out docs/benchmarks/gpu/<dir>/gemm-rows.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from detserve.executor.gemm_classes import lane_call_sizes
from detserve.executor.graphs import capture_graph

# (name, N, K) of every product of a Llama layer plus the lm_head
SHAPES = {
    "llama3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                  ("down", 4096, 14336), ("lm_head", 128256, 4096)],
}


def graph_ms(fn: Callable[[], Tensor], calls: int, replays: int = 10) -> float:
    """Milliseconds per ``fn`` call: ``calls`` calls captured in one CUDA graph (as the
    engine captures its graphs)."""
    def repeated() -> Tensor:
        out = fn()
        for _ in range(calls - 1):
            out = fn()
        return out

    g, _ = capture_graph(repeated, torch.cuda.graph_pool_handle())
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (replays * calls)


def padded_linear(x: Tensor, zeros: Tensor, w: Tensor) -> Tensor:
    """``x``'s product run with ``zeros`` appended as rows, cut back to ``x``'s rows."""
    return F.linear(torch.cat([x, zeros]), w)[:x.shape[0]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="64,100,128,136,144,160,176,192,208,224,240,256,272,288,304,320,336,352,528")
    p.add_argument("--chunk", type=int, default=176)
    p.add_argument("--pads", default="128:136")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm_rows needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [int(r) for r in a.rows.split(",")]
    pads = [tuple(int(v) for v in s.split(":")) for s in a.pads.split(",") if s]
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    results: list[dict[str, object]] = []
    for name, n, k in SHAPES[a.shape]:
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dev, torch.bfloat16)
        x = torch.randn(max(rows + [p for _, p in pads]), k, generator=gen).to(dev, torch.bfloat16)
        ms: dict[int, float] = {}
        pad_ms: dict[str, float] = {}
        for m in rows:
            ms[m] = graph_ms(partial(F.linear, x[:m].contiguous(), w), a.calls)
        one_call = lane_call_sizes(w, a.chunk, rows)  # the engine's own probe
        same = {m: m == a.chunk or m in one_call for m in rows}
        for b, padded in pads:
            xb = x[:b].contiguous()
            zeros = x.new_zeros((padded - b, k))
            pad_ms[f"{b}:{padded}"] = graph_ms(partial(padded_linear, xb, zeros, w), a.calls)
        results.append({"product": name, "N": n, "K": k, "ms": ms, "same_as_chunk": same,
                        "pads": pad_ms})
        print(f"{name:>8} {n}x{k}: " + "  ".join(
            f"{m}:{ms[m]:.3f}{'*' if same[m] else ''}" for m in rows)
            + "  pads " + "  ".join(f"{key}:{v:.3f}" for key, v in pad_ms.items()),
            flush=True)
    print("(ms per call; * = one call gives every row the bits of "
          f"{a.chunk}-row calls)")
    out = {"meta": {"date": datetime.date.today().isoformat(),
                    "hardware": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "args": vars(a)},
           "products": results}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
