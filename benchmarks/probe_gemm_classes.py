"""Which row counts M give cuBLAS the same bits for a model's matrix products (GPU).

    python -m benchmarks.probe_gemm_classes --model random:llama3-8b [--max-rows 512] [--out F]

For every product shape of the model (qkv, o, gate_up, down, lm_head) prints the classes of
M (1..16, then multiples of 8 up to max-rows) whose first row comes out bit-identical, the
joint classes over all products, and the lane GEMM chunk and decode buckets the engine
would choose for several full decode batches and lane sizes. This is what decides how
often the fast path and the lane agree (see ``detserve/executor/gemm_classes.py``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import torch

from benchmarks.bench_offline import hardware
from detserve.executor.gemm_classes import (
    decode_buckets,
    joint_classes,
    plan_alignment,
    probe_sizes,
    row_classes,
)
from detserve.model.loader import load_model, resolve_dtype
from detserve.model.random_init import random_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-rows", type=int, default=512)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    dtype = resolve_dtype(a.dtype)
    if a.model.startswith("random:"):
        model = random_model(a.model.split(":", 1)[1], dtype, a.device)[0]
    else:
        model = load_model(a.model, dtype, a.device)[0]
    sizes = probe_sizes(a.max_rows, a.max_rows)
    names = ["qkv", "o", "gate_up", "down", "lm_head"]
    shapes: dict[str, object] = {}
    per_weight = []
    for name, w in zip(names, model.gemm_weights(), strict=True):
        classes = row_classes(w, sizes)
        per_weight.append(classes)
        shapes[name] = {"n_k": list(w.shape), "classes": classes}
        print(f"{name:>8} {tuple(w.shape)}: {len(classes)} classes: "
              + "  ".join(f"[{c[0]}..{c[-1]}]({len(c)})" for c in classes), flush=True)
    joint = joint_classes(per_weight)
    print("joint classes:", "  ".join(f"[{c[0]}..{c[-1]}]({len(c)})" for c in joint))
    chunks = {}
    for full in (16, 32, 64, 128, 256):
        for lane_rows in (64, 256, 512):
            al = plan_alignment(joint, full, lane_rows, decode_buckets(full))
            chunks[f"{full}/{lane_rows}"] = {"chunk": al.chunk, "buckets": list(al.buckets)}
    print("lane GEMM chunk and decode buckets for (full decode batch / lane rows):")
    for k, v in chunks.items():
        print(f"  {k:>8}: chunk {v['chunk']:>4}, buckets {v['buckets']}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({
            "meta": {"date": dt.date.today().isoformat(), "hardware": hardware(a.device),
                     "torch": torch.__version__, "args": vars(a)},
            "sizes": sizes, "shapes": shapes, "joint": joint, "chunks": chunks}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
