"""Can the lane read each weight once per pass and keep its chunk's bits?

The lane runs every product in calls of exactly ``--chunk`` rows (the fast path's decode
class, see ``gemm_classes``), so a pass of k chunks reads every weight k times. One call
over all k*chunk rows reads it once, but cuBLAS picks another algorithm there (other
bits). This probes a third way: one strided-batched product, k batches of ``chunk`` rows
against the same weight (batch stride 0), for each product shape of the model:

- bits: does every batch give the rows the chunked calls' bits?
- time: the k chunked calls, the batched call, and one call over all rows (us; each from
  ``bench_kernels.bench``: CUDA-graph replays with L2 flushed, median).

    python -m benchmarks.bench_lane_bmm --model random:llama3-8b --out lane-bmm.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.bench_kernels import bench
from benchmarks.bench_offline import hardware
from detserve.executor.ops import run_in_row_chunks
from detserve.model.loader import load_model


def batched_linear(x: Tensor, weight: Tensor, chunk: int) -> Tensor:
    """``x`` [k*chunk, K] times ``weight.T`` as one batched product of k batches."""
    k = x.shape[0] // chunk
    wt = weight.t().unsqueeze(0).expand(k, -1, -1)  # batch stride 0: one weight
    return torch.bmm(x.view(k, chunk, -1), wt).view(k * chunk, -1)


def _probe(w: Tensor, x: Tensor, chunk: int, quick: bool) -> dict[str, object]:
    def chunked() -> Tensor:
        return run_in_row_chunks(lambda c: F.linear(c, w), x, chunk)

    ref = chunked()
    return {"batched_same_bits": bool(torch.equal(ref, batched_linear(x, w, chunk))),
            "one_call_same_bits": bool(torch.equal(ref, F.linear(x, w))),
            "chunked_us": 1000 * bench(chunked, quick),
            "batched_us": 1000 * bench(lambda: batched_linear(x, w, chunk), quick),
            "one_call_us": 1000 * bench(lambda: F.linear(x, w), quick)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--chunks", default="2,4")
    p.add_argument("--quick", action="store_true", help="fewer timed replays")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    model, _, _ = load_model(a.model, dtype=torch.bfloat16, device="cuda")
    shapes: dict[tuple[int, int], Tensor] = {}
    for w in model.gemm_weights():
        shapes.setdefault((int(w.shape[0]), int(w.shape[1])), w)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for (n, k_dim), w in shapes.items():
        for k in (int(s) for s in a.chunks.split(",")):
            m = k * a.chunk
            x = torch.randn(m, k_dim, generator=gen).to("cuda", torch.bfloat16)
            row = {"N": n, "K": k_dim, "chunks": k, "rows": m, **_probe(w, x, a.chunk, a.quick)}
            rows.append(row)
            print(f"N={n:>6} K={k_dim:>6} {k} x {a.chunk}: batched bits "
                  f"{'same' if row['batched_same_bits'] else 'OTHER'}, one call "
                  f"{'same' if row['one_call_same_bits'] else 'other'}; chunked "
                  f"{row['chunked_us']:.1f} us, batched {row['batched_us']:.1f}, one call "
                  f"{row['one_call_us']:.1f}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            meta = {"hardware": hardware("cuda"), "torch": torch.__version__, "args": vars(a)}
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
