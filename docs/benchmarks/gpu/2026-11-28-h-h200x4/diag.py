"""Row-position invariance of cuBLAS products at rank 0's TP=4 shard shapes: does a row's
result depend on where in the call it sits? (lane chunk rows vs fast-path bucket rows)

    python diag.py random:llama3-70b cuda:0 176
"""
import sys

import torch
import torch.nn.functional as F

from detserve.model.loader import load_model, read_model_config
from detserve.parallel.layout import TPLayout
from detserve.parallel.shard import RankWeights

NAMES = ["qkv", "o", "gate_up", "down", "lm_head"]
BUCKETS = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
SIZES = [*BUCKETS, 128, 176, 256, 352, 512, 528]


def main() -> None:
    spec, dev, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.cuda.set_device(dev)
    shard = RankWeights(TPLayout(read_model_config(spec), 4, 0))
    m, _, _ = load_model(spec, "bfloat16", dev, shard=shard)
    g = torch.Generator(device="cpu").manual_seed(0)
    for name, w in zip(NAMES, m.gemm_weights(), strict=True):
        x = torch.randn(600, w.shape[1], generator=g).to(dev, w.dtype)
        bad_shift = []
        for rows in SIZES:
            y = F.linear(x[:rows], w)
            for s in sorted({1, 5, 33, rows // 2}):
                if s % rows == 0:
                    continue
                y2 = torch.roll(F.linear(torch.roll(x[:rows], s, 0), w), -s, 0)
                if not torch.equal(y, y2):
                    bad_shift.append(rows)
                    break
        # the lane-vs-fast property: a bucket's rows placed inside a chunk-row call
        bad_place = []
        for b in BUCKETS:
            ref = F.linear(x[:b], w)
            for j in (0, chunk - b, (chunk - b) // 2):
                xc = x[b:b + chunk].clone()
                xc[j:j + b] = x[:b]
                if not torch.equal(F.linear(xc, w)[j:j + b], ref):
                    bad_place.append((b, j))
                    break
        print(f"{spec} {name} {tuple(w.shape)}: position-dependent at M={bad_shift}; "
              f"bucket rows differ inside a {chunk}-row call: {bad_place}", flush=True)


if __name__ == "__main__":
    main()
