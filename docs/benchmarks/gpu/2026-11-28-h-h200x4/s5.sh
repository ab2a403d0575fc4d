#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1
ROOT=$PWD; R=/tmp/r/s5; rm -rf $R; mkdir -p $R
trap 'tar czf $OUT/s5.tgz -C /tmp/r s5' EXIT
PYTHONPATH=$ROOT timeout 100 python -m pytest -q -p no:cacheprovider tests/test_gpu_tensor_parallel.py -k later > $R/later.log 2>&1; echo "later test rc=$?"; tail -2 $R/later.log
for rows in 256 0; do
PYTHONPATH=$ROOT timeout 150 python -m benchmarks.bench_offline --model random:llama3-70b --device cuda:0 \
  --dtype bfloat16 --lengths sharegpt --num-requests 64 --max-num-seqs 64 --num-blocks 4096 \
  --warmup-requests 4 --tensor-parallel-size 4 --modes llm42 --lane-gemm-rows $rows \
  --ratios 1.0 --run-seconds 20 --out $R/r70-$rows.json > $R/r70-$rows.log 2>&1; echo "rows $rows rc=$?"
grep -hE "out tok/s|rror" $R/r70-$rows.log | tail -3
done
