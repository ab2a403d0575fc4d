"""Row-position invariance of cuBLAS products at rank 0's TP=4 shard shapes: does a row's
result depend on where in the call it sits? (lane chunk rows vs fast-path bucket rows)"""
import sys, torch
import torch.nn.functional as F
from detserve.model.loader import load_model, read_model_config
from detserve.parallel.layout import TPLayout
from detserve.parallel.shard import RankWeights
spec, dev, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.cuda.set_device(dev)
m, _, _ = load_model(spec, "bfloat16", dev, shard=RankWeights(TPLayout(read_model_config(spec), 4, 0)))
names = ["qkv", "o", "gate_up", "down", "lm_head"]
buckets = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
sizes = buckets + [128, 176, 256, 352, 512, 528]
g = torch.Generator(device="cpu").manual_seed(0)
for name, w in zip(names, m.gemm_weights()):
    x = torch.randn(600, w.shape[1], generator=g).to(dev, w.dtype)
    bad_shift = []
    for M in sizes:
        y = F.linear(x[:M], w)
        for s in sorted({1, 5, 33, M // 2}):
            if s % M == 0: continue
            y2 = torch.roll(F.linear(torch.roll(x[:M], s, 0), w), -s, 0)
            if not torch.equal(y, y2):
                bad_shift.append(M); break
    # the lane-vs-fast property: bucket b's rows placed at the end of a chunk call
    bad_place = []
    for b in buckets:
        ref = F.linear(x[:b], w)
        for j in (0, chunk - b, (chunk - b) // 2):
            xc = x[b:b + chunk].clone(); xc[j:j + b] = x[:b]
            if not torch.equal(F.linear(xc, w)[j:j + b], ref):
                bad_place.append((b, j)); break
    print(f"{spec} {name} {tuple(w.shape)}: position-dependent at M={bad_shift}; "
          f"bucket rows differ inside a {chunk}-row call: {bad_place}", flush=True)
