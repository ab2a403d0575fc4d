"""Do the fast path's aligned decode rows get the lane's bits from every product of the
TP-invariant tree (its column blocks included)? For each product shape the engine probed
(``gemm_weights``), with the engine's own plan (chunk, buckets, pads, one calls): rows of
a full lane pass in the lane's calls against the same rows, drawn at random positions,
in a decode call of each bucket (padded as the plan pads it). Also: does a row's lane
result depend on its position in the pass (the pass's rows permuted)? Prints mismatching
rows per shape and bucket. Usage: posdiag.py SPEC [TP-INVARIANT 0/1] [DEVICE]."""
import sys

import torch
import torch.nn.functional as F

from detserve.engine import LLMEngine
from detserve.executor.ops import linear_in_row_chunks, pad_rows

spec = sys.argv[1]
invariant = sys.argv[2] != "0" if len(sys.argv) > 2 else True
device = sys.argv[3] if len(sys.argv) > 3 else "cuda:0"
eng = LLMEngine.from_args(spec, "llm42", tp_invariant_lane=invariant, device=device,
                          dtype="bfloat16", max_model_len=1024, num_blocks=2048,
                          verify_window=64, verify_group=8)
r = eng.runner
chunk, one, buckets, pads = r.lane_chunk, r.lane_one_call, r.decode_buckets or [], r.decode_pads
rows = eng.config.scheduler.lane_rows
print(f"{spec} invariant={invariant} chunk={chunk} lane_rows={rows} buckets={buckets}")
print(f"pads={dict(pads)} one_call={ {k: sorted(v) for k, v in one.items()} }")
gen = torch.Generator(device="cpu").manual_seed(1)
seen = set()
for w, b in zip(eng.model.gemm_weights(), eng.model.gemm_biases(), strict=True):
    key = (int(w.shape[0]), int(w.shape[1]))
    if key in seen:
        continue
    seen.add(key)
    bad = []
    for kind in ("plain", "wide"):
        x = torch.randn(rows, key[1], generator=gen)
        if kind == "wide":
            x = x * torch.exp(2 * torch.randn(rows, 1, generator=gen))
        x = x.to(w.device, w.dtype)
        lane = linear_in_row_chunks(x, w, b, chunk, one)
        perm = torch.randperm(rows, generator=gen).to(w.device)
        moved = linear_in_row_chunks(x[perm], w, b, chunk, one)
        pos = int((moved != lane[perm]).any(1).sum())
        out = [f"{kind}: lane-position {pos}/{rows}"]
        for bk in buckets:
            idx = torch.randperm(rows, generator=gen)[:bk].to(w.device)
            padded = pads.get(key, {}).get(bk, bk)
            y = F.linear(pad_rows(x[idx], padded), w, b)[:bk]
            n = int((y != lane[idx]).any(1).sum())
            if n:
                out.append(f"b{bk}(pad {padded}) {n}/{bk}")
        bad.append(" ".join(out))
    print(f"N={key[0]:6d} K={key[1]:5d} bias={b is not None}: " + " | ".join(bad), flush=True)
eng.close()
