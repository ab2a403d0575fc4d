"""Rollbacks of llm42 at TP=1 (no perturbation) for a GQA group of 4 (8B's) and of 8
(70B's): is the fast path aligned with the lane when 8 query heads share a K/V head?"""
import sys
sys.path.insert(0, "tests")
import torch
from engine_utils import Req, random_prompts, run_engine
from model_helpers import make_random_llama
from detserve.params import SamplingParams
def main():
    group, dev = int(sys.argv[1]), sys.argv[2]
    model = str(make_random_llama(hidden_size=2048, intermediate_size=4096, num_heads=16,
                                  num_kv_heads=16 // group, num_layers=4,
                                  max_position_embeddings=2048))
    prompts = random_prompts(48, [30, 200, 75, 400, 12, 130], seed=3)
    reqs = [Req(p, SamplingParams(max_tokens=96, is_deterministic=i % 2 == 0, temperature=0.7,
                                  seed=i, ignore_eos=True), arrival=i % 12)
            for i, p in enumerate(prompts)]
    for tp in (1, 2):
        _, stats, eng = run_engine(model, reqs, device=dev, dtype="bfloat16", tensor_parallel_size=tp,
                                   max_num_seqs=32)
        eng.close()
        print(f"group {group} tp {tp} on {dev}: rollbacks {stats['rollbacks']} of "
              f"{stats.get('windows', '?')} windows", flush=True)

if __name__ == '__main__':
    main()
