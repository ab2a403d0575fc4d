"""Benchmark the Triton kernels on a GPU against cuBLAS / torch SDPA.

    python benchmarks/bench_kernels.py --out results/bench_kernels.json [--quick] [--sweep matmul,decode,prefill,lane]

- matmul_bi (persistent, no split-K, one tile config) vs torch.matmul (cuBLAS), bf16, TFLOP/s
  over M for the Llama-3.1-8B layer shapes, plus how many distinct values row 0 takes over M
  (1 means batch-invariant);
- decode / prefill / lane attention (paged, bf16, Llama-3.1-8B heads: 32 q, 8 kv, dim 128)
  vs scaled_dot_product_attention on contiguous K/V;
- rmsnorm_bi vs torch.nn.functional.rms_norm.
Times are GPU times of CUDA-graph replays with L2 flushed between calls. Prints a table and
writes everything as JSON. Needs CUDA; takes a few minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing

from detserve.kernels.batch_invariant import matmul_bi, rmsnorm_bi
from detserve.kernels.config import (
    KERNEL_VERSION,
    TABLE,
    DecodeConfig,
    LaneConfig,
    MatmulConfig,
    PrefillConfig,
)
from detserve.kernels.decode_attention import choose_num_splits, decode_attention
from detserve.kernels.lane_attention import lane_attention, lane_spans
from detserve.kernels.prefill_attention import prefill_attention

MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
            "down": (4096, 14336)}
H, HKV, D, PAGE = 32, 8, 128, 16
MATMUL_SWEEP = [  # (block_m, block_n, block_k, group_m, num_warps, num_stages)
    MatmulConfig(128, 128, 64, 8, 8, 3),
    MatmulConfig(128, 128, 64, 8, 4, 4),
    MatmulConfig(128, 128, 64, 8, 4, 3),
    MatmulConfig(128, 256, 64, 8, 8, 3),
    MatmulConfig(128, 256, 64, 8, 8, 4),
    MatmulConfig(128, 128, 128, 8, 8, 3),
    MatmulConfig(64, 128, 64, 8, 4, 4),
    MatmulConfig(64, 128, 128, 8, 4, 3),
    MatmulConfig(64, 256, 64, 8, 4, 4),
]
DECODE_SWEEP = [
    DecodeConfig(block_n=64, num_stages=2, min_tokens_per_split=256),
    DecodeConfig(block_n=64, num_stages=3, min_tokens_per_split=256),
    DecodeConfig(block_n=64, num_stages=2, min_tokens_per_split=128, programs_per_sm=4),
    DecodeConfig(block_n=32, num_stages=3, min_tokens_per_split=128, programs_per_sm=4),
    DecodeConfig(block_n=128, num_warps=8, num_stages=2, min_tokens_per_split=256),
    DecodeConfig(block_n=64, num_stages=4, min_tokens_per_split=128, programs_per_sm=4),
    DecodeConfig(block_n=32, num_stages=4, min_tokens_per_split=64, programs_per_sm=8),
]
PREFILL_SWEEP = [  # (block_m, block_n, num_warps, num_stages)
    PrefillConfig(64, 64, 4, 2),
    PrefillConfig(64, 64, 4, 3),
    PrefillConfig(128, 64, 8, 2),
    PrefillConfig(128, 64, 8, 3),
    PrefillConfig(128, 128, 8, 2),
    PrefillConfig(64, 128, 4, 2),
    PrefillConfig(128, 32, 4, 3),
]
LANE_SWEEP = [
    LaneConfig(tile=32, block_m=64, num_warps=4, num_stages=2),
    LaneConfig(tile=64, block_m=64, num_warps=4, num_stages=2),
    LaneConfig(tile=32, block_m=64, num_warps=4, num_stages=3),
    LaneConfig(tile=64, block_m=64, num_warps=4, num_stages=3),
    LaneConfig(tile=32, block_m=32, num_warps=4, num_stages=2),
    LaneConfig(tile=64, block_m=128, num_warps=8, num_stages=2),
    LaneConfig(tile=16, block_m=64, num_warps=4, num_stages=3),
    LaneConfig(tile=64, block_m=64, num_warps=4, num_stages=1),
    LaneConfig(tile=64, block_m=64, num_warps=4, num_stages=4),
    # a query tile as small as split-KV decode's (16 slots): a decode row fills 4 of them
    # instead of 4 of 64 (other bits than the default's, which a lane change would pay for)
    LaneConfig(tile=64, block_m=16, num_warps=4, num_stages=2),
    LaneConfig(tile=64, block_m=16, num_warps=1, num_stages=2),
    LaneConfig(tile=64, block_m=32, num_warps=4, num_stages=2),
    # 16 query slots a warp, as the default's 64 over 4 warps and 16:1 above, both of
    # which keep its bits. On an H100 (2026-11-25) 32:2 did not, and the ones that did were
    # slower than the default (docs/benchmarks/gpu/README.md)
    LaneConfig(tile=64, block_m=32, num_warps=2, num_stages=2),
    LaneConfig(tile=64, block_m=32, num_warps=2, num_stages=3),
    LaneConfig(tile=64, block_m=16, num_warps=1, num_stages=3),
    LaneConfig(tile=64, block_m=16, num_warps=1, num_stages=4),
    LaneConfig(tile=64, block_m=128, num_warps=8, num_stages=3),
    # every tile masked (full_tiles off): the default's bits, slower
    LaneConfig(tile=64, block_m=64, num_warps=4, num_stages=3, full_tiles=False),
    LaneConfig(tile=64, block_m=16, num_warps=1, num_stages=2, full_tiles=False),
]


_FLUSH: list[torch.Tensor] = []


def _time_graph(g: torch.cuda.CUDAGraph, tries: int) -> float:
    times = []
    for _ in range(tries):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench(fn: Callable[[], Any], quick: bool) -> float:
    """Median GPU milliseconds of fn, replayed from a CUDA graph with L2 flushed before each call.

    Graphs take the CPU launch cost out (the engine replays graphs too), so small kernels are
    timed on the GPU rather than in Python; flushing L2 makes weights and KV come from HBM, as
    they do in a model. The flushes are timed alone and subtracted.
    """
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.int8, device="cuda"))
    flush, reps, tries = _FLUSH[0], (10 if quick else 30), (5 if quick else 11)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = []
    try:
        for with_fn in (True, False):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(reps):
                    flush.zero_()
                    if with_fn:
                        fn()
            graphs.append(g)
    except RuntimeError as e:  # not capturable: time it eagerly (launch cost included)
        print(f"  (no CUDA graph for {getattr(fn, '__name__', fn)}: {str(e)[:80]}; eager timing)")
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, return_mode="median"))
    _time_graph(graphs[0], 1)
    both, alone = _time_graph(graphs[0], tries), _time_graph(graphs[1], tries)
    return max(both - alone, 1e-6) / reps


def bench_matmul(quick: bool, ms: list[int]) -> tuple[list[dict], dict]:
    rows, invariance = [], {}
    for name, (n, k) in LLAMA_8B.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        x = torch.randn(max(ms), k, device="cuda", dtype=torch.bfloat16)
        row0_bi, row0_cublas = set(), set()
        for m in ms:
            xm = x[:m].contiguous()
            t_bi = bench(functools.partial(matmul_bi, xm, w), quick)
            t_cb = bench(functools.partial(torch.matmul, xm, w.T), quick)
            flop = 2.0 * m * n * k
            rows.append({"shape": name, "M": m, "N": n, "K": k, "ms_bi": t_bi, "ms_cublas": t_cb,
                         "tflops_bi": flop / t_bi / 1e9, "tflops_cublas": flop / t_cb / 1e9})
            row0_bi.add(matmul_bi(xm, w)[0].view(torch.int16).cpu().numpy().tobytes())
            row0_cublas.add(torch.matmul(xm, w.T)[0].view(torch.int16).cpu().numpy().tobytes())
        invariance[name] = {"distinct_row0_bi": len(row0_bi), "distinct_row0_cublas": len(row0_cublas)}
        del w, x
    return rows, invariance


def sweep(quick: bool, what: set[str]) -> list[dict]:
    """Time candidate tile configs (speed only: a matmul or lane change also moves bits)."""
    out: list[dict] = []
    for name, (n, k) in LLAMA_8B.items() if "matmul" in what else ():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        for m in (1, 16, 128, 1024, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for cfg in MATMUL_SWEEP:
                t = bench(functools.partial(matmul_bi, x, w, cfg=cfg), quick)
                out.append({"what": "matmul", "cfg": dataclasses.asdict(cfg),
                            "case": f"{name} M={m}", "value": 2.0 * m * n * k / t / 1e9,
                            "unit": "TFLOP/s"})
    for b, n in [(1, 1024), (1, 8192), (8, 2048), (32, 2048), (128, 1024)]:
        if "decode" not in what:
            break
        kv = make_cache([n] * b)
        q = torch.randn(b, H, D, device="cuda", dtype=torch.bfloat16)
        for dcfg in DECODE_SWEEP:
            t = bench(functools.partial(decode_attention, q, kv.k_cache, kv.v_cache,
                                        kv.block_tables, kv.context_lens, max_context_len=n,
                                        cfg=dcfg), quick)
            out.append({"what": "decode", "cfg": dataclasses.asdict(dcfg),
                        "case": f"B={b} ctx={n}", "value": t * 1e3, "unit": "us"})
    for case, chunks in [("prefill 1x4096", [(4096, 4096)]), ("prefill 8x1024", [(1024, 1024)] * 8),
                         ("extend 4x512 on 4096", [(4608, 512)] * 4)]:
        if "prefill" not in what:
            break
        kv = make_cache([c for c, _ in chunks])
        q_lens = [qn for _, qn in chunks]
        cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
        q = torch.randn(sum(q_lens), H, D, device="cuda", dtype=torch.bfloat16)
        for pcfg in PREFILL_SWEEP:
            t = bench(functools.partial(prefill_attention, q, kv.k_cache, kv.v_cache,
                                        kv.block_tables, cu, kv.context_lens,
                                        max_q_len=max(q_lens), cfg=pcfg), quick)
            out.append({"what": "prefill", "cfg": dataclasses.asdict(pcfg), "case": case,
                        "value": t * 1e3, "unit": "us"})
    # (case, (context, rows) per sequence, rows_per_program: 1 as the fast path's decode
    # rows call it, None: chosen from M as a lane pass does)
    for case, chunks, rpp in [("decode 64 rows ctx 520", [(520, 1)] * 64, 1),
                              ("decode-like 32 rows ctx 2048", [(2048, 1)] * 32, None),
                              ("verify 8x64 on 600", [(600, 64)] * 8, None),
                              ("chunk 1x2048", [(2048, 2048)], None)]:
        if "lane" not in what:
            break
        kv = make_cache([c for c, _ in chunks])
        seq = torch.cat([torch.full((qn,), i) for i, (_, qn) in enumerate(chunks)])
        pos = torch.cat([torch.arange(c - qn, c) for c, qn in chunks])
        seq, pos = seq.to(torch.int32).cuda(), pos.to(torch.int32).cuda()
        q = torch.randn(len(seq), H, D, device="cuda", dtype=torch.bfloat16)
        call = functools.partial(lane_attention, q, kv.k_cache, kv.v_cache, kv.block_tables,
                                 seq, pos, rows_per_program=rpp)
        ref = call(cfg=TABLE.lane)
        split_kv = None
        if rpp == 1:  # decode rows: what nondeterministic mode runs instead (split-KV, one
            # split at this batch), the time the aligned fast path pays over it
            one = functools.partial(decode_attention, q, kv.k_cache, kv.v_cache,
                                    kv.block_tables, kv.context_lens, num_splits=1)
            split_kv = one()
            out.append({"what": "lane", "cfg": {"kernel": "decode_attention", "num_splits": 1},
                        "case": case, "value": bench(one, quick) * 1e3, "unit": "us",
                        "same_bits": bool(torch.equal(split_kv, ref))})
        for lcfg in LANE_SWEEP:
            t = bench(functools.partial(call, cfg=lcfg), quick)
            got = call(cfg=lcfg)
            # the lane's bits are part of the determinism profile: whether this config
            # keeps them (tile, block_m and num_warps are documented to move them)
            row = {"what": "lane", "cfg": dataclasses.asdict(lcfg), "case": case,
                   "value": t * 1e3, "unit": "us", "same_bits": bool(torch.equal(got, ref))}
            if split_kv is not None:  # a lane config whose decode rows split-KV could give
                row["same_bits_as_decode_attention"] = bool(torch.equal(got, split_kv))
            out.append(row)
    return out


@dataclasses.dataclass
class PagedKV:
    """A paged K/V cache and the block tables and lengths that address it."""

    k_cache: torch.Tensor  # [num_blocks, PAGE, HKV, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    context_lens: torch.Tensor  # int32 [num_seqs]


def make_cache(lens: list[int]) -> PagedKV:
    """Random bf16 paged cache made on the GPU, each sequence in shuffled blocks."""
    need = [-(-n // PAGE) for n in lens]
    perm = torch.randperm(sum(need), device="cuda").to(torch.int32)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32, device="cuda")
    for i, (lo, nb) in enumerate(zip([0, *itertools.accumulate(need)], need, strict=False)):
        tables[i, :nb] = perm[lo : lo + nb]
    shape = (sum(need), PAGE, HKV, D)
    return PagedKV(torch.randn(shape, device="cuda", dtype=torch.bfloat16),
                   torch.randn(shape, device="cuda", dtype=torch.bfloat16), tables,
                   torch.tensor(lens, dtype=torch.int32, device="cuda"))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> Callable[[], Any]:
    """SDPA call with native GQA where this torch supports it, else with K/V expanded first."""
    try:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    except (TypeError, RuntimeError):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sdpa_ms(q_lens: list[int], lens: list[int], quick: bool) -> float:
    """SDPA over contiguous K/V: batched when all lengths agree, else one call per sequence."""
    from torch.nn.attention.bias import causal_lower_right

    def inputs(b: int, qn: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        q = torch.randn(b, H, qn, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, HKV, n, D, device="cuda", dtype=torch.bfloat16)
        return q, k, torch.randn_like(k), None if qn == 1 else causal_lower_right(qn, n)

    if len(set(lens)) == 1 and len(set(q_lens)) == 1:
        return bench(sdpa(*inputs(len(lens), q_lens[0], lens[0])), quick)
    calls = [sdpa(*inputs(1, qn, n)) for qn, n in zip(q_lens, lens, strict=True)]

    def run() -> None:
        for call in calls:
            call()
    return bench(run, quick)


def decode_case(b: int, n: int, quick: bool) -> dict:
    kv = make_cache([n] * b)
    q = torch.randn(b, H, D, device="cuda", dtype=torch.bfloat16)
    seq = torch.arange(b, dtype=torch.int32, device="cuda")
    pos = kv.context_lens - 1
    t = bench(lambda: decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                       kv.context_lens, max_context_len=n), quick)
    t_lane = bench(lambda: lane_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq, pos),
                   quick)
    # the aligned fast path's call (one row a program, the spans the context needs), and
    # the same with the spans of a 16,384-token table launched (idle programs: what a
    # decode graph without a one-span variant would pay)
    spans = lane_spans(n)
    t_aligned = bench(lambda: lane_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq,
                                             pos, rows_per_program=1, max_spans=spans), quick)
    t_idle = bench(lambda: lane_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq, pos,
                                          rows_per_program=1,
                                          max_spans=max(spans, lane_spans(16384))), quick)
    t_sdpa = sdpa_ms([1] * b, [n] * b, quick)
    gbytes = 2.0 * b * n * HKV * D * 2 / 1e9
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {"kernel": "decode", "case": f"B={b} ctx={n}",
            "splits": choose_num_splits(b, HKV, n, sms), "spans": spans, "ms": t,
            "ms_lane": t_lane, "ms_aligned": t_aligned, "ms_aligned_idle_spans": t_idle,
            "ms_sdpa": t_sdpa, "kv_GBps": gbytes / t * 1e3,
            "kv_GBps_lane": gbytes / t_lane * 1e3, "kv_GBps_sdpa": gbytes / t_sdpa * 1e3}


def prefill_case(name: str, chunks: list[tuple[int, int]], quick: bool) -> dict:
    """chunks: (context_len, q_len) per sequence; also times the same rows as one lane pass."""
    lens, q_lens = [c for c, _ in chunks], [qn for _, qn in chunks]
    kv = make_cache(lens)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    q = torch.randn(sum(q_lens), H, D, device="cuda", dtype=torch.bfloat16)
    seq = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(q_lens))
    pos = torch.cat([torch.arange(c - qn, c) for c, qn in chunks])
    seq, pos = seq.to(torch.int32).cuda(), pos.to(torch.int32).cuda()
    t = bench(lambda: prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu,
                                        kv.context_lens, max_q_len=max(q_lens)), quick)
    t_lane = bench(lambda: lane_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq, pos),
                   quick)
    t_idle = bench(lambda: lane_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq, pos,
                                          max_spans=max(lane_spans(max(lens)),
                                                        lane_spans(16384))), quick)
    t_sdpa = sdpa_ms(q_lens, lens, quick)
    flop = 4.0 * H * D * float((pos.long() + 1).sum())
    return {"kernel": "prefill", "case": name, "ms": t, "ms_lane": t_lane,
            "ms_lane_idle_spans": t_idle, "ms_sdpa": t_sdpa,
            "tflops": flop / t / 1e9, "tflops_lane": flop / t_lane / 1e9,
            "tflops_sdpa": flop / t_sdpa / 1e9}


def bench_attention(quick: bool) -> list[dict]:
    rows = [decode_case(b, n, quick) for b, n in
            [(1, 1024), (1, 8192), (1, 15000), (8, 2048), (8, 12000), (32, 2048), (64, 4096),
             (128, 1024), (256, 512)]]
    for name, chunks in [("prefill 1x4096", [(4096, 4096)]), ("prefill 8x1024", [(1024, 1024)] * 8),
                         ("extend 4x512 on 4096", [(4608, 512)] * 4),
                         ("verify 8x16 on 2048", [(2048, 16)] * 8),
                         ("mixed", [(3000, 2048), (700, 700), (8192, 256), (100, 100)])]:
        rows.append(prefill_case(name, chunks, quick))
    return rows


def bench_rmsnorm(quick: bool) -> list[dict]:
    rows = []
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    for m in (1, 64, 1024, 4096):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        t = bench(functools.partial(rmsnorm_bi, x, w, 1e-5), quick)
        t_ref = bench(functools.partial(F.rms_norm, x, (4096,), w, 1e-5), quick)
        rows.append({"M": m, "ms_bi": t, "ms_torch": t_ref})
    return rows


def print_tables(res: dict) -> None:
    print(f"\n{res['device']}  torch {res['torch']}  triton {res['triton']}  {res['date']}")
    if "matmul" in res:
        print("\nmatmul bf16 TFLOP/s: matmul_bi / cuBLAS")
        shapes = list(LLAMA_8B)
        print(f"{'M':>6} " + " ".join(f"{s:>17}" for s in shapes))
        by = {(r["shape"], r["M"]): r for r in res["matmul"]}
        for m in sorted({r["M"] for r in res["matmul"]}):
            cells = [f"{by[s, m]['tflops_bi']:7.1f} /{by[s, m]['tflops_cublas']:7.1f}  " for s in shapes]
            print(f"{m:>6} " + " ".join(cells))
        print("distinct values of row 0 over M (1 = batch-invariant):",
              {s: (v["distinct_row0_bi"], v["distinct_row0_cublas"]) for s, v in res["matmul_invariance"].items()})
    if "attention" in res:
        print("\nattention (ms): ours / lane / SDPA")
        for r in res["attention"]:
            extra = (f"KV GB/s {r['kv_GBps']:.0f} / {r['kv_GBps_lane']:.0f} / {r['kv_GBps_sdpa']:.0f}"
                     f"  splits={r['splits']}  aligned {r['ms_aligned']:.3f} ms"
                     f" ({r['spans']} spans; {r['ms_aligned_idle_spans']:.3f} with idle ones)"
                     if r["kernel"] == "decode" else
                     f"TFLOP/s {r['tflops']:.0f} / {r['tflops_lane']:.0f} / {r['tflops_sdpa']:.0f}"
                     f"  lane with idle spans {r['ms_lane_idle_spans']:.3f} ms")
            print(f"{r['kernel']:>8} {r['case']:<22} {r['ms']:8.3f} / {r['ms_lane']:8.3f} / "
                  f"{r['ms_sdpa']:8.3f}   {extra}")
    if "rmsnorm" in res:
        print("\nrmsnorm [M, 4096] bf16 (ms): rmsnorm_bi / F.rms_norm")
        for r in res["rmsnorm"]:
            print(f"{r['M']:>6} {r['ms_bi']:.4f} / {r['ms_torch']:.4f}")
    if res.get("sweep"):
        print("\nconfig sweep")
        for r in res["sweep"]:
            cfg = " ".join(f"{k}={v}" for k, v in r["cfg"].items())
            bits = {True: "  same bits", False: "  other bits"}.get(r.get("same_bits"), "")
            if r.get("same_bits_as_decode_attention"):
                bits += " (= decode_attention's)"
            print(f"  {r['what']:>6} {r['case']:<28} {r['value']:9.1f} {r['unit']:<8} {cfg}{bits}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON output path")
    ap.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    ap.add_argument("--sweep", default="", metavar="KINDS",
                    help="also time candidate configs of these kernels: comma list of "
                         "matmul,decode,prefill,lane")
    ap.add_argument("--sweep-only", action="store_true",
                    help="time only the --sweep configs, not the kernel comparisons")
    ap.add_argument("--attention-only", action="store_true",
                    help="time only the attention kernels")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA device")
    torch.manual_seed(0)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kernel_version": KERNEL_VERSION, "table": dataclasses.asdict(TABLE),
    }
    if args.attention_only:
        res["attention"] = bench_attention(args.quick)
    elif not args.sweep_only:
        res["matmul"], res["matmul_invariance"] = bench_matmul(args.quick, MS)
        res["attention"] = bench_attention(args.quick)
        res["rmsnorm"] = bench_rmsnorm(args.quick)
    if args.sweep:
        res["sweep"] = sweep(args.quick, set(args.sweep.split(",")))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print_tables(res)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
