#!/usr/bin/env bash
# 4 x H200, last minutes (issue 36): does a column-parallel product's column keep its bits
# in a call of fewer columns? Then the invariance audit at the 70B geometry with the tree's
# column blocks (invariant lane, TP 1 and 4). Results go straight to $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=$OUT/i4; mkdir -p $R
timeout 40 python docs/benchmarks/gpu/2026-11-28-i-h200-h200x4/colcheck.py > $R/colcheck.log 2>&1; cat $R/colcheck.log
off() {  # name tp extra...
  local name=$1 tp=$2; shift 2
  timeout 70 python -m benchmarks.bench_offline --model random:llama3-70b@8 --device cuda:0 \
    --dtype bfloat16 --lengths sharegpt --num-requests 48 --max-num-seqs 48 --num-blocks 8192 \
    --warmup-requests 2 --tensor-parallel-size $tp --modes llm42 --ratios 1.0 \
    --run-seconds 20 "$@" --out $R/$name.json > $R/$name.log 2>&1; echo "$name rc=$?"
  grep -hE "out tok/s|audit|rror" $R/$name.log | tail -3
}
off inv-tp4 4 --tp-invariant-lane
off inv-tp1 1 --tp-invariant-lane
python -m benchmarks.compare_digests $R/inv-tp1.json $R/inv-tp4.json | tee $R/invariance.txt
