"""Deterministic outputs of fixed requests, saved so that two builds can be compared bit
for bit (tokens, logprob bits, fingerprint).

Targets (greedy and seeded sampling, with logprobs) run as deterministic requests among
random co-runners that arrive over several steps, in ``llm42`` mode (and in
``batch_invariant`` with ``--modes``). Only the engine's public API is used (``EngineConfig``,
``LLMEngine.add_request/step``), so the same script runs against an earlier tree:

    PYTHONPATH=<earlier tree> python benchmarks/det_outputs.py --model random:llama3-8b \
        --device cuda --dtype bfloat16 --out before.json
    python benchmarks/det_outputs.py ... --out after.json
    python benchmarks/det_outputs.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any


def _signature(o: Any) -> dict[str, Any]:
    return {"token_ids": list(o.token_ids),
            "logprobs": [lp.logprob.hex() for lp in o.logprobs or []]}


def run_mode(model: str, mode: str, device: str, dtype: str, max_tokens: int,
             seed: int) -> dict[str, Any]:
    from detserve.config import EngineConfig
    from detserve.engine import LLMEngine
    from detserve.params import SamplingParams

    cfg = EngineConfig.create(model, mode, device=device, dtype=dtype, max_num_seqs=128,
                              max_model_len=4096, num_blocks=8192, seed=seed)
    engine = LLMEngine(cfg)
    vocab = engine.model.config.vocab_size
    rng = random.Random(seed)
    targets = [[rng.randrange(3, vocab) for _ in range(n)] for n in (12, 45, 90, 150, 600)]
    reqs: list[tuple[str, list[int], Any]] = []
    for i, t in enumerate(targets):
        sampled = i % 2 == 1
        reqs.append((f"t{i}", t, SamplingParams(
            max_tokens=max_tokens, temperature=0.8 if sampled else 0.0,
            top_p=0.9 if sampled else 1.0, seed=1000 + i if sampled else None,
            is_deterministic=True, logprobs=1, ignore_eos=True)))
    for j in range(48):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 200))]
        reqs.append((f"o{j}", prompt, SamplingParams(
            max_tokens=rng.randrange(4, 2 * max_tokens), temperature=rng.choice([0.0, 1.0]),
            ignore_eos=True, is_deterministic=rng.random() < 0.3)))
    rng.shuffle(reqs)
    arrivals = sorted(rng.randrange(0, 8) for _ in reqs)
    outputs: dict[str, Any] = {}
    step = 0
    while reqs or engine.has_unfinished_requests():
        while reqs and arrivals[0] <= step:
            rid, prompt, params = reqs.pop()
            arrivals.pop(0)
            engine.add_request(rid, None, params, prompt_token_ids=prompt)
        for o in engine.step():
            if o.finished and o.request_id.startswith("t"):
                outputs[o.request_id] = _signature(o)
        step += 1
    profile = engine.determinism_profile()
    engine.close()
    digest = hashlib.sha256(json.dumps(outputs, sort_keys=True).encode()).hexdigest()[:16]
    return {"outputs": outputs, "digest": digest, "profile": profile}


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    same = True
    for mode in sorted(set(a) | set(b)):
        ra, rb = a.get(mode), b.get(mode)
        if ra is None or rb is None:
            print(f"{mode}: only in one file")
            same = False
            continue
        outs = ra["digest"] == rb["digest"]
        fp = ra["profile"].get("fingerprint") == rb["profile"].get("fingerprint")
        print(f"{mode}: outputs {'identical' if outs else 'DIFFER'} ({ra['digest']} / "
              f"{rb['digest']}); fingerprint {'identical' if fp else 'differs'} "
              f"({ra['profile'].get('fingerprint')} / {rb['profile'].get('fingerprint')})")
        if not fp:
            keys = sorted(set(ra["profile"]) | set(rb["profile"]))
            for k in keys:
                if k != "fingerprint" and ra["profile"].get(k) != rb["profile"].get(k):
                    print(f"  profile[{k}]: {ra['profile'].get(k)!r} -> {rb['profile'].get(k)!r}")
        same = same and outs
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--modes", default="llm42", help="comma-separated engine modes")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help="compare two saved files instead of running")
    a = p.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    result = {m: run_mode(a.model, m, a.device, a.dtype, a.max_tokens, a.seed)
              for m in a.modes.split(",")}
    for m, r in result.items():
        print(f"{m}: digest {r['digest']} fingerprint {r['profile'].get('fingerprint')}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
