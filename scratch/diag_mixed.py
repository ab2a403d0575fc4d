import cProfile, pstats, io, sys, time
from functools import partial
import torch
from benchmarks.bench_mixed_step import mixed_batch, time_step, BLOCK
from detserve.config import EngineConfig
from detserve.engine import LLMEngine
from detserve.model.random_init import random_model

model = sys.argv[1] if len(sys.argv) > 1 else "random:llama3-8b"
dev = sys.argv[2] if len(sys.argv) > 2 else "cuda"
loaded = random_model(model.split(":", 1)[1], torch.bfloat16 if dev == "cuda" else torch.float32, dev)
vocab = loaded[0].config.vocab_size
segs, specs, blocks = mixed_batch(85, 400, 512, BLOCK, vocab)
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
for name, mode, extra in [("llm42", "llm42", {}), ("nondet", "nondeterministic", {}),
                          ("llm42-nothread", "llm42", {}),
                          ("llm42-noalign", "llm42", {"align_fast_path": False})]:
    try:
        cfg = EngineConfig.create(model, mode, device=dev, dtype="bfloat16" if dev == "cuda" else "float32", verify_window=64, verify_group=8,
                              max_num_seqs=128, max_num_batched_tokens=2048, max_model_len=600,
                              num_blocks=blocks + 1, block_size=BLOCK, **extra)
    except Exception as e:
        print(name, "config error", e); continue
    eng = LLMEngine(cfg, loaded=loaded)
    print(name, "lane_sms", cfg.lane_sms, "align", cfg.align_fast_path, "buckets", eng.runner.decode_buckets,
          "lane_gemm_rows", eng.runner.lane_gemm_rows, "graphs", eng.runner.decode_graphs is not None, flush=True)
    if name == "llm42-nothread":
        eng.verifier.close()
    step = partial(eng.runner.run_batch, segs, specs, align_decode=False)
    ms = time_step(step, 20, sync)
    # host enqueue time of forward only
    print(f"{name}: {ms:.2f} ms/step; mem alloc {(torch.cuda.memory_allocated() if dev=='cuda' else 0)/2**30:.1f} GiB reserved {(torch.cuda.memory_reserved() if dev=='cuda' else 0)/2**30:.1f}", flush=True)
    if dev == "cuda": torch.cuda.set_sync_debug_mode("warn")
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        step(); sync()
    if dev == "cuda": torch.cuda.set_sync_debug_mode(0)
    print("  sync warnings:", len(w), set(str(x.message)[:100] for x in w))
    for x in w[:5]:
        print("   at", x.filename, x.lineno)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        step()
    sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    print("\n".join(s.getvalue().splitlines()[6:30]))
    eng.close(); del eng
