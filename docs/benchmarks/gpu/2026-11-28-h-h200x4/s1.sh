#!/usr/bin/env bash
# 4 x H200: rank-local loading (issue 36). Rank 0's peak memory loading the 8B whole vs its
# TP=4 shard and the 70B shape's TP=4 shard; the GPU TP tests; the 70B shape at TP=4:
# decode step, and offline llm42 against nondeterministic and batch_invariant.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/r/s1; rm -rf $R; mkdir -p $R
trap 'tar czf $OUT/s1.tgz -C /tmp/r s1' EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/gpu.txt
python -c "import torch; print(torch.__version__)" >> $R/gpu.txt; cat $R/gpu.txt
timeout 90 python - > $R/mem.log 2>&1 <<'PY'
import time, torch
from detserve.model.loader import load_model, read_model_config
from detserve.parallel.layout import TPLayout
from detserve.parallel.shard import RankWeights
for i, (spec, tp) in enumerate([("random:llama3-8b", 1), ("random:llama3-8b", 4), ("random:llama3-70b", 4)]):
    dev = f"cuda:{i}"
    torch.cuda.set_device(dev)
    shard = RankWeights(TPLayout(read_model_config(spec), tp, 0)) if tp > 1 else None
    t0 = time.perf_counter()
    m, _, _ = load_model(spec, "bfloat16", dev, shard=shard)
    torch.cuda.synchronize(dev)
    held = sum(p.numel() * p.element_size() for p in m.parameters())
    print(f"{spec} tp={tp} rank0: held {held / 2**30:.2f} GiB, peak {torch.cuda.max_memory_allocated(dev) / 2**30:.2f} GiB, {time.perf_counter() - t0:.1f} s")
PY
cat $R/mem.log
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gpu_tensor_parallel.py > $R/gputests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/gputests.log
timeout 120 python -m benchmarks.bench_decode_step --model random:llama3-70b --batches 1,64 \
  --tensor-parallel-size 4 --out $R/step70-tp4.json > $R/step70-tp4.log 2>&1; echo "step rc=$?"
grep -E "^batch|rror" $R/step70-tp4.log | tail -4
timeout 270 python -m benchmarks.bench_offline --model random:llama3-70b --device cuda:0 \
  --dtype bfloat16 --lengths sharegpt --num-requests 128 --max-num-seqs 64 --num-blocks 8192 \
  --warmup-requests 8 --tensor-parallel-size 4 --modes nondeterministic,llm42,batch_invariant \
  --ratios 0.1,1.0 --run-seconds 45 --out $R/off70-tp4.json > $R/off70-tp4.log 2>&1; echo "offline rc=$?"
grep -hE "audit|out tok/s|rror" $R/off70-tp4.log | tail -12
