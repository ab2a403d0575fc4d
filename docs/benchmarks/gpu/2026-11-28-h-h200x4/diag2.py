"""Rollbacks of llm42 without perturbation for a GQA group of 4 (the 8B shape's) and of 8
(the 70B shape's), at TP 1 and 2: is the fast path aligned with the lane when 8 query heads
share a K/V head? Run from the repository root: ``python diag2.py 8 cuda:0``."""
import sys

sys.path.insert(0, "tests")

from engine_utils import Req, random_prompts, run_engine  # noqa: E402
from model_helpers import make_random_llama  # noqa: E402

from detserve.params import SamplingParams  # noqa: E402


def main() -> None:
    group, dev = int(sys.argv[1]), sys.argv[2]
    model = str(make_random_llama(hidden_size=2048, intermediate_size=4096, num_heads=16,
                                  num_kv_heads=16 // group, num_layers=4,
                                  max_position_embeddings=2048))
    prompts = random_prompts(48, [30, 200, 75, 400, 12, 130], seed=3)
    reqs = [Req(p, SamplingParams(max_tokens=96, is_deterministic=i % 2 == 0,
                                  temperature=0.7, seed=i, ignore_eos=True), arrival=i % 12)
            for i, p in enumerate(prompts)]
    for tp in (1, 2):
        _, stats, eng = run_engine(model, reqs, device=dev, dtype="bfloat16",
                                   tensor_parallel_size=tp, max_num_seqs=32)
        eng.close()
        print(f"group {group} tp {tp} on {dev}: rollbacks {stats['rollbacks']} of "
              f"{stats.get('windows', '?')} windows", flush=True)


if __name__ == "__main__":
    main()
