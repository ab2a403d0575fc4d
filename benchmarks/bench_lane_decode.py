"""The fast path's decode rows on the lane attention kernel: per-layer times and bits.

For decode-row shapes of the 8B model (32 query heads, 8 kv heads, dim 128, bf16): the
generic lane kernel with plain sums (``LaneConfig.dot_sums=False``, the kernel set before
``kernels-3``) and with dot sums, the one-row kernel (``_lane_decode_kernel``, taken with
dot sums where a program holds one row) at several query tiles, and split-KV
``decode_attention`` with one split (what nondeterministic mode runs). Each lane line says
whether its output equals the generic dot-sums kernel's bit for bit. Times from
``triton.testing.do_bench`` (us per call, one layer).

    python -m benchmarks.bench_lane_decode --out results/lane-decode.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
from pathlib import Path

import torch
import triton.testing

from benchmarks.bench_kernels import H, make_cache
from detserve.kernels.config import TABLE
from detserve.kernels.decode_attention import decode_attention
from detserve.kernels.lane_attention import lane_attention

# (case, context of each decode row)
CASES = [("decode 128 rows mixed ctx", [300, 520, 700, 1100, 1500, 2000, 90, 64] * 16),
         ("decode 64 rows ctx 520", [520] * 64),
         ("decode 128 rows ctx 1024", [1024] * 128)]
# one-row kernel tiles, BLOCK_M:NUM_WARPS:NUM_STAGES
TILES = [(16, 4, 2), (16, 4, 3), (16, 2, 2), (16, 2, 3), (16, 1, 2), (16, 8, 2), (64, 4, 3)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="JSON output path")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_lane_decode needs a CUDA device")
    dot = dataclasses.replace(TABLE.lane, dot_sums=True)
    plain = dataclasses.replace(TABLE.lane, dot_sums=False)
    # (label, config, rows_per_program): 2 rows a program keeps the generic kernel
    cfgs = [("generic, plain sums", plain, 2), ("generic, dot sums", dot, 2)] + [
        (f"one-row, dot sums {m}:{w}:{s}",
         dataclasses.replace(dot, block_m=m, num_warps=w, num_stages=s), 1)
        for m, w, s in TILES]
    rows = []
    for i, (case, lens) in enumerate(CASES):
        torch.manual_seed(i)
        kv = make_cache(lens)
        seq = torch.arange(len(lens), dtype=torch.int32, device="cuda")
        q = torch.randn(len(lens), H, kv.k_cache.shape[-1], device="cuda", dtype=torch.bfloat16)
        lane = functools.partial(lane_attention, q, kv.k_cache, kv.v_cache, kv.block_tables,
                                 seq, kv.context_lens - 1)
        ref = lane(rows_per_program=2, cfg=dot)
        for label, cfg, rpp in cfgs:
            call = functools.partial(lane, rows_per_program=rpp, cfg=cfg)
            same = bool(torch.equal(call(), ref))
            t = triton.testing.do_bench(call, warmup=50, rep=300) * 1e3
            rows.append({"case": case, "kernel": label, "us": t, "same_bits_as_dot": same})
            print(f"{case:<26} {label:<28} {t:8.1f} us  same bits as generic dot sums: {same}",
                  flush=True)
        split_kv = functools.partial(decode_attention, q, kv.k_cache, kv.v_cache,
                                     kv.block_tables, kv.context_lens, num_splits=1)
        t = triton.testing.do_bench(split_kv, warmup=50, rep=300) * 1e3
        rows.append({"case": case, "kernel": "split-KV, 1 split", "us": t})
        print(f"{case:<26} {'split-KV, 1 split':<28} {t:8.1f} us", flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({
            "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
