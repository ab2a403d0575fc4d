"""Tensor parallelism at TP 1/2/4: decode step time against each rank's memory roofline,
and the TP-invariance audit (issue 36).

One process per rank (``torch.multiprocessing.spawn``), joined by a run-time group of
``detserve.distributed`` (NCCL on CUDA, gloo on CPU). Every rank loads its shard of the model
(``load_model(shard=)``; random weights of a real shape are drawn from a fixed seed, so
all ranks cut the same whole model) and runs ``ModelRunner`` on it in
lockstep with the others, without the engine: the step is the runner's eager fast path
(no CUDA graphs yet), B decode rows at ``--context`` positions. Roofline: the bytes one
rank must read in a step (its weights and its K/V) over the device-to-device copy
bandwidth.

The audit runs one fixed lane pass (prompt rows of ``--audit-rows`` tokens, greedy, top-5
logprobs sampled at every row) at each TP size, with the TP-invariant tree and with the
ordinary lane's sum (the partials in rank order), and hashes its tokens and logprob bits:
the tree must give one hash across TP sizes; the ordinary lane (the control) is expected
to give one a size.

    python -m benchmarks.tp_bench --model random:llama3-8b --tp 1 2 4 --batch 1 64 \\
        --out tp_bench.json
    # CPU smoke run (gloo, a tiny checkpoint folder):
    python -m benchmarks.tp_bench --device cpu --model <folder> --tp 1 2 --batch 1 4 \\
        --context 64 --steps 3

Skips (exit 0, a note on stdout) without CUDA or with fewer GPUs than the largest TP.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from detserve.distributed import Group, new_group, open_store
from detserve.executor.attention import RowSegment
from detserve.executor.kv_pool import KVPool
from detserve.executor.runner import ModelRunner
from detserve.flags import add_flags, engine_options
from detserve.lane import LanePass, LaneSegment
from detserve.model.loader import load_model, read_model_config
from detserve.numerics import LaneNumerics
from detserve.parallel.layout import TPLayout
from detserve.parallel.shard import RankWeights, shard_model
from detserve.sampler import SamplingSpec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sync(device: str, group: Group | None) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    if group is not None:
        group.barrier()


def _audit(runner: ModelRunner, rows: int, vocab: int, block_size: int) -> str:
    """sha256 of one fixed lane pass's tokens and logprob bits."""
    gen = torch.Generator().manual_seed(1234)
    ids = tuple(int(t) for t in torch.randint(3, vocab, (rows,), generator=gen))
    table = tuple(range(1, 1 + -(-rows // block_size)))
    spec = SamplingSpec(logprobs=5, prompt_len=rows)
    seg = LaneSegment("audit", "prefill", 0, ids, table, (), tuple(range(rows)), spec)
    result = runner.run_lane(LanePass(0, runner.lane_rows, (seg,)))
    h = hashlib.sha256()
    for d in result.decisions:
        h.update(repr(d.tokens).encode())
        for lp in d.logprobs:
            if lp is not None:
                h.update(float(lp.logprob).hex().encode())
                h.update(repr(sorted((t, float(v).hex()) for t, v in lp.top.items())).encode())
    return h.hexdigest()[:16]


def run_rank(rank: int, a: argparse.Namespace, tp: int, port: int, out: str) -> None:
    device = f"cuda:{rank}" if a.device == "cuda" else "cpu"
    if a.device == "cuda":
        torch.cuda.set_device(rank)
    store = open_store("127.0.0.1", port, server=rank == 0, timeout_s=300)
    group = new_group(store, f"tp-bench-{tp}", rank, tp, device, timeout_s=300) if tp > 1 else None
    layout = TPLayout(read_model_config(a.model), tp, rank)
    mine, _, _ = load_model(a.model, dtype=a.dtype, device=device, shard=RankWeights(layout))
    model = shard_model(mine, layout, group, tree=True)
    mc = model.config
    per_seq = -(-(a.context + 1) // a.block_size)
    lane_rows = a.verify_window * a.verify_group
    blocks = max(max(a.batch) * per_seq, -(-a.audit_rows // a.block_size)) + 1
    pool = KVPool(mc.num_layers, blocks, a.block_size, mc.num_kv_heads, mc.head_dim,
                  model.dtype, device)
    geometry = {"verify_window": a.verify_window, "verify_group": a.verify_group, "block_size": a.block_size,
                "tensor_parallel_size": tp}
    runner = ModelRunner(model, pool, LaneNumerics(**geometry, tp_invariant_lane=True))
    elem = torch.tensor([], dtype=model.dtype).element_size()
    weight_bytes = sum(p.numel() * elem for p in model.parameters())
    bandwidth = None
    if a.device == "cuda":
        from benchmarks.bench_decode_step import copy_bandwidth

        bandwidth = copy_bandwidth(device)
    steps = []
    for b in a.batch:
        segs = [RowSegment((7,), a.context, tuple(range(1 + i * per_seq, 1 + (i + 1) * per_seq)))
                for i in range(b)]
        specs: list[SamplingSpec | None] = [SamplingSpec()] * b
        for _ in range(3):
            runner.run_batch(segs, specs)
        _sync(device, group)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            runner.run_batch(segs, specs)
        _sync(device, group)
        ms = (time.perf_counter() - t0) / a.steps * 1e3
        kv_bytes = b * a.context * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * elem
        roof = (weight_bytes + kv_bytes) / bandwidth * 1e3 if bandwidth else None
        steps.append({"batch": b, "step_ms": round(ms, 3),
                      "roofline_ms": round(roof, 3) if roof else None,
                      "rank_weight_gb": round(weight_bytes / 1e9, 3)})
    audit_rows = min(a.audit_rows, lane_rows)
    tree = _audit(runner, audit_rows, mc.vocab_size, a.block_size)
    plain_runner = ModelRunner(model, pool, LaneNumerics(**geometry))
    plain = _audit(plain_runner, audit_rows, mc.vocab_size, a.block_size)
    if rank == 0:
        Path(out).write_text(json.dumps({"tp": tp, "steps": steps, "audit_tree": tree,
                                         "audit_plain": plain, "kv_heads_rank0": mc.num_kv_heads}))
    if group is not None:
        group.barrier()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # the engine's own flags for what decides the shapes and the lane's bits
    engine = engine_options()
    add_flags(p, {k: engine[k] for k in ("model", "device", "dtype", "block_size",
                                         "verify_window", "verify_group")},
              defaults={"model": "random:llama3-8b", "device": "cuda", "dtype": "auto"})
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--audit-rows", type=int, default=64)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.device not in ("cuda", "cpu"):
        p.error("--device: cuda (one GPU a rank) or cpu")
    if a.dtype == "auto":
        a.dtype = "bfloat16" if a.device == "cuda" else "float32"
    if a.device == "cuda" and (not torch.cuda.is_available()
                               or torch.cuda.device_count() < max(a.tp)):
        print(json.dumps({"skipped": f"needs {max(a.tp)} CUDA devices"}))
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp in a.tp:
            out = str(Path(tmp) / f"tp{tp}.json")
            mp.spawn(run_rank, args=(a, tp, _free_port(), out), nprocs=tp, join=True)
            results.append(json.loads(Path(out).read_text()))
            print(json.dumps(results[-1]), flush=True)
    from benchmarks.bench_offline import hardware

    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hardware": hardware("cuda:0" if a.device == "cuda" else "cpu"),
        "args": vars(a), "results": results,
        "tree_unique_outputs": len({r["audit_tree"] for r in results}),
        "plain_unique_outputs": len({r["audit_plain"] for r in results}),
    }
    print(json.dumps({k: report[k] for k in ("tree_unique_outputs", "plain_unique_outputs")}))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
