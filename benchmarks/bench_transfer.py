"""K/V rows between two processes over ``detserve.distributed`` groups (NCCL on two GPUs,
gloo on CPU): time per transfer for the row counts a lane pass moves, with the 8B shape's
row size (32 layers x K and V x 8 KV heads x 128 x bf16 = 131,072 bytes a row).

    python -m benchmarks.bench_transfer --devices cuda:0,cuda:1 --out results/transfer.json
    python -m benchmarks.bench_transfer --devices cpu,cpu --rows 1,64 --repeat 3   # gloo
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from detserve.distributed import new_group, open_store

# the 8B shape's K/V of one position: [layers, 2, heads, head_dim]
ROW_SHAPE = (32, 2, 8, 128)


def _member(rank: int, port: int, device: str, rows: list[int], repeat: int,
            out: mp.Queue) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = open_store("127.0.0.1", port, server=False)
    group = new_group(store, "bench", rank, 2, dev, timeout_s=60)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    results = {}
    for n in rows:
        buf = torch.ones((ROW_SHAPE[0], ROW_SHAPE[1], n, *ROW_SHAPE[2:]), dtype=torch.bfloat16,
                         device=dev)
        times = []
        for i in range(repeat + 2):  # two warm-ups (connection set-up, allocator)
            group.barrier()
            sync()
            t0 = time.perf_counter()
            work = group.send(buf, 1) if rank == 0 else group.recv(buf, 0)
            group.wait(work)
            sync()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        results[n] = times
    if rank == 1:
        out.put(results)


def run(devices: list[str], rows: list[int], repeat: int) -> dict[str, Any]:
    store = open_store("127.0.0.1", 0, server=True)
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, store.port, devices[r], rows, repeat, out))
             for r in (0, 1)]
    for p in procs:
        p.start()
    results = out.get(timeout=600)
    for p in procs:
        p.join(60)
    row_bytes = 2 * torch.Size(ROW_SHAPE).numel()
    table = []
    for n, times in results.items():
        med = statistics.median(times)
        table.append({"rows": n, "bytes": n * row_bytes, "median_us": med * 1e6,
                      "min_us": min(times) * 1e6, "GB_per_s": n * row_bytes / med / 1e9})
    return {"devices": devices, "row_bytes": row_bytes, "repeat": repeat, "transfers": table}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", default="cuda:0,cuda:1", help="the two members' devices")
    p.add_argument("--rows", default="1,16,64,256,512,2048",
                   help="rows a transfer moves (64: one window of W=64; 512: a pass of 8)")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    devices = a.devices.split(",")
    if len(devices) != 2:
        p.error("--devices takes two devices")
    report = run(devices, [int(x) for x in a.rows.split(",")], a.repeat)
    if devices[0].startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(torch.device(devices[0]))
    for t in report["transfers"]:
        print(f"{t['rows']:>6} rows  {t['bytes'] / 1e6:8.2f} MB  {t['median_us']:9.1f} us "
              f"median  {t['GB_per_s']:7.1f} GB/s", flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
