"""Fast-path GEMMs beside a lane confined to a green context (8B shapes, CUDA only).

    python -m benchmarks.bench_sm_carveout --lane-sms 32 --out carveout.json

For each BLAS library (torch's preferred one) and cuBLAS SM carveout (none, and
``--lane-sms``): the four 8B layer GEMMs (qkv, o, gate_up, down) at ``--batch`` rows,
``--layers`` times, timed alone and beside a background of ``--lane-rows``-row gate_up
GEMMs queued on a stream of a green context of ``--lane-sms`` SMs (the lane's setting).
``slowdown`` = beside / alone: 1 means the decode GEMMs did not wait for the lane's SMs.
Also the name of the kernel each decode GEMM ran and whether its output bits changed with
the carveout (another kernel, other bits).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_offline import hardware

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def green_stream(num_sms: int) -> tuple[Any, Any]:
    from torch.cuda.green_contexts import GreenContext

    ctx: Any = GreenContext.create(num_sms=num_sms, device_id=torch.cuda.current_device())
    return ctx, ctx.Stream()


def decode_layers(xs: dict[str, torch.Tensor], ws: dict[str, torch.Tensor], layers: int) -> None:
    for _ in range(layers):
        for name, w in ws.items():
            torch.mm(xs[name], w)


def time_decode(xs: dict[str, torch.Tensor], ws: dict[str, torch.Tensor], layers: int,
                background: tuple[Any, torch.Tensor, torch.Tensor, int] | None) -> float:
    """GPU ms per layer of the decode GEMMs (events on the current stream), with the
    background queued first on its green stream when given."""
    if background is not None:
        stream, a, b, n = background
        with torch.cuda.stream(stream):
            for _ in range(n):
                torch.mm(a, b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    decode_layers(xs, ws, layers)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / layers


def kernel_names(xs: dict[str, torch.Tensor], ws: dict[str, torch.Tensor]) -> dict[str, str]:
    from torch.profiler import ProfilerActivity, profile

    names: dict[str, str] = {}
    for name, w in ws.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.mm(xs[name], w)
            torch.cuda.synchronize()
        kernels = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA"]
        names[name] = " + ".join(sorted(kernels))[:200]
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=128, help="decode rows of each GEMM")
    p.add_argument("--lane-sms", type=int, default=32)
    p.add_argument("--lane-rows", type=int, default=512)
    p.add_argument("--layers", type=int, default=200)
    p.add_argument("--libraries", default="cublas,cublaslt")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_sm_carveout needs a CUDA device")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * 0.02).to(torch.bfloat16)

    ws = {n: rand(k, m) for n, (k, m) in SHAPES.items()}
    xs = {n: rand(a.batch, k) for n, (k, _) in SHAPES.items()}
    _ctx, stream = green_stream(a.lane_sms)
    lane_a, lane_b = rand(a.lane_rows, 4096), ws["gate_up"]
    # enough background to outlast the decode layers several times over
    torch.mm(lane_a, lane_b)
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        t0.record()
        torch.mm(lane_a, lane_b)
        t1.record()
    torch.cuda.synchronize()
    lane_ms = t0.elapsed_time(t1)
    rows: list[dict[str, Any]] = []
    reference: dict[str, torch.Tensor] = {}
    for lib in a.libraries.split(","):
        for carve in (None, a.lane_sms):
            torch.backends.cuda.preferred_blas_library(lib)
            torch._C._set_sm_carveout_experimental(carve)
            decode_layers(xs, ws, 3)  # warm-up
            alone = time_decode(xs, ws, a.layers, None)
            n_bg = max(4, int(4 * alone * a.layers / max(lane_ms, 1e-3)))
            beside = time_decode(xs, ws, a.layers, (stream, lane_a, lane_b, n_bg))
            outs = {n: torch.mm(xs[n], w) for n, w in ws.items()}
            if carve is None:
                reference = outs
            same = {n: bool(torch.equal(outs[n], reference[n])) for n in outs}
            row = {"library": lib, "carveout": carve, "alone_ms_per_layer": alone,
                   "beside_ms_per_layer": beside, "slowdown": beside / alone,
                   "same_bits_as_no_carveout": same, "kernels": kernel_names(xs, ws)}
            rows.append(row)
            print(f"{lib:>9} carveout {carve!s:>4}: {alone:.3f} ms/layer alone, "
                  f"{beside:.3f} beside the lane ({beside / alone:.2f}x); bits unchanged: "
                  f"{same}", flush=True)
            for n, k in row["kernels"].items():
                print(f"    {n:>8}: {k}", flush=True)
    torch._C._set_sm_carveout_experimental(None)
    torch.backends.cuda.preferred_blas_library("default")
    print(f"lane background: one {a.lane_rows}-row gate_up on {a.lane_sms} SMs {lane_ms:.2f} ms")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({
            "meta": {"date": dt.date.today().isoformat(), "hardware": hardware("cuda"),
                     "torch": torch.__version__, "args": vars(a)},
            "lane_gemm_ms": lane_ms, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
