"""Which decode query tiles give the lane kernel's bits, per GQA group? (bf16, head_dim 128)"""
import dataclasses
import sys

sys.path.insert(0, "tests")
import kernel_helpers as kt
import torch

from detserve.kernels.config import LaneConfig
from detserve.kernels.lane_attention import lane_attention, lane_rows


def main():
    dev, d, page, tile = "cuda", 128, 16, 64
    lens = [3 * tile + 5, 40, 2 * tile, 2 * tile + 2, 700, 2500]
    tiles = [(16, 1), (16, 2), (16, 4), (32, 2), (32, 4), (64, 4), (128, 8)]
    for h, hkv in [(32, 8), (16, 4), (64, 8), (16, 2), (8, 1), (128, 8), (32, 2), (48, 8)]:
        kv = kt.make_paged_kv(lens, hkv, d, page, dtype=torch.bfloat16, device=dev, seed=41)
        pairs = [(s, p) for s, n in enumerate(lens) for p in range(max(0, n - 9), n)]
        pairs += [(s, p) for s, n in enumerate(lens) for p in range(0, n, 11)]
        seq = torch.tensor([x[0] for x in pairs], dtype=torch.int32, device=dev)
        pos = torch.tensor([x[1] for x in pairs], dtype=torch.int32, device=dev)
        q = kt.randn(len(pairs), h, d, dtype=torch.bfloat16, device=dev, seed=42)
        def call(cfg, rpp, q=q, kv=kv, seq=seq, pos=pos):
            return lane_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq, pos, cfg=cfg,
                                  rows_per_program=rpp)
        base = LaneConfig()
        ref = call(base, None)
        out = []
        for rpp in sorted({1, 2, lane_rows(h // hkv, base)}):
            if rpp <= lane_rows(h // hkv, base):
                y = call(base, rpp)
                out.append(f"lane rpp{rpp}:{'ok' if torch.equal(y, ref) else 'DIFF'}")
        for bm, w in tiles:
            for st in (2, 3):
                cfg = dataclasses.replace(base, block_m=bm, num_warps=w, num_stages=st)
                y = call(cfg, 1)
                bad = (y != ref).any(-1).any(-1).sum().item()
                out.append(f"{bm}:{w}:{st}:{'ok' if bad == 0 else f'DIFF{bad}'}")
        print(f"h {h:3d} hkv {hkv} group {h // hkv:2d}: " + " ".join(out), flush=True)

if __name__ == "__main__":
    main()
