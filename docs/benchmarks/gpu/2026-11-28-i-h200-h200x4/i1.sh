#!/usr/bin/env bash
# 4 x H200 (issue 36): the decode tile probe. GPU tests of the probe; the 70B shape's cuts
# at TP=1 (ordinary lane, 100 % deterministic) with the tile now resolved at start-up; the
# 70B shape at TP=4 offline, llm42 against nondeterministic (the run that rolled back 65 %).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/r/i1; rm -rf $R; mkdir -p $R
trap 'tar czf $OUT/i1.tgz -C /tmp/r i1' EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/gpu.txt
python -c "import torch; print(torch.__version__)" >> $R/gpu.txt; cat $R/gpu.txt
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_kernels_lane_attention.py \
  tests/test_gpu_engine.py -k "decode_tile or aligned_decode_lane or alone_verifies" \
  > $R/gputests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/gputests.log
timeout 100 python docs/benchmarks/gpu/2026-11-28-i-h200-h200x4/d70.py cuda:0 fixed > $R/d70.log 2>&1; echo "d70 rc=$?"; grep -v Warn $R/d70.log | tail -4
timeout 300 python -m benchmarks.bench_offline --model random:llama3-70b --device cuda:0 \
  --dtype bfloat16 --lengths sharegpt --num-requests 128 --max-num-seqs 64 --num-blocks 8192 \
  --warmup-requests 8 --tensor-parallel-size 4 --modes nondeterministic,llm42 \
  --ratios 0.1,1.0 --run-seconds 45 --out $R/off70-tp4.json > $R/off70-tp4.log 2>&1; echo "offline rc=$?"
grep -hE "audit|out tok/s|rollback|rror" $R/off70-tp4.log | tail -12
