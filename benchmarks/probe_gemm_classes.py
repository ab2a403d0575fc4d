"""Which row counts M give cuBLAS the same bits for a model's matrix products (GPU).

    python -m benchmarks.probe_gemm_classes --model random:llama3-8b [--max-rows 512] [--out F]
    python -m benchmarks.probe_gemm_classes --compare A.json B.json   (two GPUs' files)

For every product shape of the model (qkv, o, gate_up, down, lm_head) prints the classes of
M (1..16, then multiples of 8 up to max-rows) whose first row comes out bit-identical, the
joint classes over all products, and the lane GEMM chunk and decode buckets the engine
would choose for several full decode batches and lane sizes. This is what decides how
often the fast path and the lane agree (see ``detserve/executor/gemm_classes.py``).

It also records, for each product and each lane chunk size, a digest of the whole product
(inputs from a seeded CPU generator) and whether cuBLAS gave the bits of this project's
Triton batch-invariant kernel: ``--compare`` then says at which chunk sizes two GPUs (an
H100 and an H200, say) run the lane's products with the same bits.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
from pathlib import Path

import torch

from benchmarks.bench_offline import hardware
from detserve.executor.gemm_classes import (
    decode_buckets,
    equals_portable_kernel,
    joint_classes,
    plan_alignment,
    probe_sizes,
    row_classes,
)
from detserve.model.loader import load_model, resolve_dtype
from detserve.model.random_init import random_model

CHUNKS = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512)  # lane GEMM chunk candidates


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.int16 if t.element_size() == 2
                                              else torch.int32).cpu().numpy().tobytes()
                          ).hexdigest()[:16]


def chunk_bits(w: torch.Tensor, chunks: tuple[int, ...] = CHUNKS, seed: int = 0
               ) -> dict[str, dict[str, object]]:
    """For each chunk size M: the digest of cuBLAS's ``x[:M] @ w.T`` over all M rows (x
    from a seeded CPU generator, so every GPU multiplies the same numbers), and the
    engine's own verdict on whether M gives the Triton batch-invariant kernel's bits
    (``equals_portable_kernel``; None on CPU, where that kernel does not run)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(max(chunks), w.shape[1], generator=gen).to(w.device, w.dtype)
    return {str(m): {"digest": _digest(torch.nn.functional.linear(x[:m], w)),
                     "equals_triton": equals_portable_kernel([w], [None], m, seed)
                     if w.is_cuda else None}
            for m in chunks}


def compare(a: dict, b: dict) -> dict[str, object]:
    """Per product and chunk: do two GPUs' files give the same digest? And the chunks at
    which every product agrees."""
    if a["weights"] != b["weights"]:
        return {"error": "the two runs multiplied different weights"}
    same = {name: [m for m, r in a["chunk_bits"][name].items()
                   if r["digest"] == b["chunk_bits"][name][m]["digest"]]
            for name in a["chunk_bits"]}
    every = sorted(set.intersection(*(set(v) for v in same.values())), key=int)
    return {"a": a["meta"]["hardware"], "b": b["meta"]["hardware"], "same_bits": same,
            "chunks_all_products_agree": every}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-rows", type=int, default=512)
    p.add_argument("--out", default=None)
    p.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help="compare two GPUs' --out files (chunk sizes with the same bits)")
    a = p.parse_args(argv)
    if a.compare:
        verdict = compare(*(json.loads(Path(f).read_text()) for f in a.compare))
        print(json.dumps(verdict, indent=2))
        if a.out:
            Path(a.out).write_text(json.dumps(verdict, indent=2))
        return 0
    dtype = resolve_dtype(a.dtype)
    if a.model.startswith("random:"):
        model = random_model(a.model.split(":", 1)[1], dtype, a.device)[0]
    else:
        model = load_model(a.model, dtype, a.device)[0]
    sizes = probe_sizes(a.max_rows, a.max_rows)
    names = ["qkv", "o", "gate_up", "down", "lm_head"]
    shapes: dict[str, object] = {}
    per_weight = []
    products = dict(zip(names, model.gemm_weights(), strict=True))
    for name, w in products.items():
        classes = row_classes(w, sizes)
        per_weight.append(classes)
        shapes[name] = {"n_k": list(w.shape), "classes": classes}
        print(f"{name:>8} {tuple(w.shape)}: {len(classes)} classes: "
              + "  ".join(f"[{c[0]}..{c[-1]}]({len(c)})" for c in classes), flush=True)
    bits = {name: chunk_bits(w) for name, w in products.items()}
    weights = {name: _digest(w) for name, w in products.items()}
    for name, per in bits.items():
        print(f"{name:>8} chunk -> equals Triton: "
              + " ".join(f"{m}:{r['equals_triton']}" for m, r in per.items()))
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
            "sizes": sizes, "shapes": shapes, "joint": joint, "chunks": chunks,
            "weights": weights, "chunk_bits": bits}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
