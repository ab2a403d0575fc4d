"""Does a column-parallel product's column get the same bits when the call has fewer
columns (a TP rank's block) at the lane's row counts? 70B and 8B shapes, bf16."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
dev = "cuda:0"
for name, hidden, cols in [("70b", 8192, {"q": 8192, "kv": 1024, "gate_up": 57344, "lm_head": 128256}),
                           ("8b", 4096, {"q": 4096, "kv": 1024, "gate_up": 28672, "lm_head": 128256})]:
    for what, n in cols.items():
        w = torch.randn(n, hidden, device=dev, dtype=torch.bfloat16)
        x = torch.randn(528, hidden, device=dev, dtype=torch.bfloat16)
        out = []
        for m in (176, 256, 512):
            full = F.linear(x[:m], w)
            res = []
            for tp in (2, 4):
                blk = n // tp
                same = torch.equal(full[:, :blk], F.linear(x[:m], w[:blk]))
                res.append(f"tp{tp}:{'=' if same else 'DIFF'}")
            out.append(f"M{m} " + " ".join(res))
        print(f"{name} {what:8s} N={n:6d}: " + " | ".join(out), flush=True)
        del w
