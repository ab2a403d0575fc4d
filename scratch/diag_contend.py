import sys, time, threading
from functools import partial
import torch
from benchmarks.bench_mixed_step import mixed_batch, time_step, BLOCK
from detserve.config import EngineConfig
from detserve.engine import LLMEngine
from detserve.lane import LanePass, LaneSegment
from detserve.model.random_init import random_model
from detserve.params import SamplingSpec

model = sys.argv[1]; dev = sys.argv[2]
cuda = dev == "cuda"
dt = torch.bfloat16 if cuda else torch.float32
loaded = random_model(model.split(":", 1)[1], dt, dev)
vocab = loaded[0].config.vocab_size
W, G = (64, 8) if cuda else (16, 4)
segs, specs, blocks = mixed_batch(85 if cuda else 8, 400 if cuda else 40, 512 if cuda else 64, BLOCK, vocab)
sync = torch.cuda.synchronize if cuda else (lambda: None)
nwin = 5 if cuda else 2
ctx = 300 if cuda else 30
per = -(-(ctx + W + 1) // BLOCK)
lsegs = []
for i in range(nwin):
    table = tuple(range(blocks + i * per, blocks + (i + 1) * per))
    ids = tuple((13 * j + i) % (vocab - 3) + 3 for j in range(W + 1))
    lsegs.append(LaneSegment(f"r{i}", "window", ctx, ids, table, ids[1:], tuple(range(W + 1)),
                             SamplingSpec(prompt_len=ctx)))
total_blocks = blocks + nwin * per + 1

def run(mode, lane_graph=True, busy=False, steps=20, tag=""):
    cfg = EngineConfig.create(model, mode, device=dev, dtype=str(dt).split(".")[1], verify_window=W, verify_group=G,
                              max_num_seqs=128, max_num_batched_tokens=2048, max_model_len=min(1024, (total_blocks - 1) * BLOCK),
                              num_blocks=total_blocks, block_size=BLOCK)
    eng = LLMEngine(cfg, loaded=loaded)
    if not lane_graph:
        eng.runner.lane_graph = None
    step = partial(eng.runner.run_batch, segs, specs, align_decode=False)
    stop = threading.Event(); passes = [0]; pass_t = []
    def lane_loop():
        i = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            eng.verifier.submit(LanePass(i, G * W, tuple(lsegs))); i += 1
            eng.verifier.poll(wait=True)
            pass_t.append(time.perf_counter() - t0)
            passes[0] += 1
    try:
        if mode == "llm42":  # warm the lane (graph capture)
            eng.verifier.submit(LanePass(-1, G * W, tuple(lsegs))); eng.verifier.poll(wait=True)
            t0 = time.perf_counter()
            for i in range(5):
                eng.verifier.submit(LanePass(-1, G * W, tuple(lsegs))); eng.verifier.poll(wait=True)
            alone = (time.perf_counter() - t0) / 5 * 1e3
        else:
            alone = float("nan")
        th = None
        if busy:
            th = threading.Thread(target=lane_loop, daemon=True); th.start(); time.sleep(0.2)
            passes[0] = 0; pass_t.clear()
        t0 = time.perf_counter()
        ms = time_step(step, steps, sync)
        el = time.perf_counter() - t0
        if th:
            stop.set(); th.join()
        pt = sum(pass_t) / len(pass_t) * 1e3 if pass_t else float("nan")
        print(f"{tag:<28} mixed {ms:7.2f} ms/step | lane pass alone {alone:6.2f} ms | passes during {passes[0]/el:5.1f}/s at {pt:6.2f} ms", flush=True)
    finally:
        eng.close(); del eng
        if cuda: torch.cuda.empty_cache()

run("nondeterministic", tag="nondet")
run("llm42", tag="llm42 idle lane")
run("llm42", busy=True, tag="llm42 busy lane (graph)")
run("llm42", busy=True, lane_graph=False, tag="llm42 busy lane (eager)")
run("nondeterministic", tag="nondet again")
run("llm42", tag="llm42 idle lane again")
run("llm42", busy=True, tag="llm42 busy lane again")
