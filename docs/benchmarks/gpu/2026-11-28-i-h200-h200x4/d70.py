"""Where do the 70B shape's rollbacks come from? llm42 with the ordinary lane at TP=1 on one
GPU, 100 % deterministic, no perturbation: cuts of the 70B shape, hybrids of the 8B and 70B
shapes, and engine knobs on the 70B cut. Any rollback here is a fast-path/lane mismatch."""
import json
import sys
import time
from dataclasses import replace

sys.path.insert(0, "tests")
import torch
from engine_utils import Req, random_prompts, run_engine

from detserve.model import random_init as ri
from detserve.params import SamplingParams

VOCAB = 30000
S = ri.SHAPES
S["h8k"] = replace(S["llama3-70b"], intermediate_size=14336)            # 70B hidden, 8B MLP
S["i28k"] = replace(S["llama3-8b"], intermediate_size=28672)            # 8B hidden, 70B MLP
S["h8k-kv16"] = replace(S["llama3-70b"], num_kv_heads=16)                # 70B, group 4
S["h8k-h32"] = replace(S["llama3-70b"], num_heads=32, num_kv_heads=8, head_dim=256)

def reqs(n=64, max_tokens=160):
    prompts = random_prompts(n, [30, 200, 75, 400, 12, 130, 900, 60], vocab=VOCAB, seed=3)
    return [Req(p, SamplingParams(max_tokens=max_tokens, is_deterministic=True, temperature=0.7,
                                  seed=i, ignore_eos=True), arrival=i % 16)
            for i, p in enumerate(prompts)]

def one(label, model, dev, patch=None, **kw):
    undo = patch() if patch else None
    t = time.time()
    try:
        _, st, eng = run_engine(model, reqs(), device=dev, dtype="bfloat16", window=64, group=8,
                                max_num_seqs=64, max_model_len=2048, num_blocks=4096, **kw)
        chunk = eng.numerics.lane_gemm_rows
        eng.close()
        keys = {k: st[k] for k in st if any(s in k for s in ("roll", "window", "lane_passes"))}
        print(f"{label:34s} {model:22s} chunk {chunk:4d} {time.time()-t:6.1f}s {json.dumps(keys)}",
              flush=True)
    except Exception as e:  # report and go on
        print(f"{label:34s} {model:22s} FAILED {type(e).__name__}: {e}", flush=True)
    finally:
        if undo:
            undo()
        torch.cuda.empty_cache()

def bi_products():
    import torch.nn.functional as F

    from detserve.kernels.batch_invariant import matmul_bi
    old = F.linear
    F.linear = lambda x, w, b=None: matmul_bi(x, w, b)
    def undo(): F.linear = old
    return undo

def main():
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda:0"
    part = sys.argv[2] if len(sys.argv) > 2 else "all"
    torch.cuda.set_device(dev)
    if part in ("all", "shapes"):
        for m in ("llama3-8b@8", "llama3-70b@8", "llama3-70b@2", "h8k@8", "i28k@8",
                  "h8k-kv16@8", "llama3-70b@40"):
            one("base", "random:" + m, dev)
    if part == "fixed":  # the decode tile resolved at start-up
        for m in ("llama3-70b@8", "llama3-70b@40", "h8k-kv16@8"):
            one("auto (probed)", "random:" + m, dev)
        one("16:2:3 forced", "random:llama3-70b@8", dev, aligned_decode_lane="16:2:3")
    if part in ("all", "knobs"):
        m = "random:llama3-70b@8"
        one("cuda_graphs off", m, dev, cuda_graphs=False)
        one("probe_single_calls off", m, dev, probe_single_calls=False)
        one("lane_one_calls off", m, dev, lane_one_calls=False)
        one("aligned_decode_lane ''", m, dev, aligned_decode_lane="")
        one("fused norms/silu off", m, dev, fused_add_rmsnorm=False, fused_silu_mul=False)
        one("portable_lane", m, dev, portable_lane=True)
        one("products matmul_bi", m, dev, patch=bi_products)
        one("prefix caching off", m, dev, enable_prefix_caching=False)

if __name__ == "__main__":
    main()
