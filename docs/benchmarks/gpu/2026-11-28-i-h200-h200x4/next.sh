#!/usr/bin/env bash
# Not yet run. The next session's first call on 4 x H200 (issue 36), after the tree's
# column blocks (76d4550, a5ec563, 130c1e6): does a column-parallel product's column keep
# its bits in a call of fewer columns? The GPU tests of the tree and the decode tile; the
# invariance audit at the 70B geometry (invariant lane, TP 1/2/4) and what the column
# blocks cost (the invariant lane against the ordinary lane, 8B shape, TP 1 and 4).
# Results go straight to $OUT. Two calls (a call may run 10 minutes): `next.sh 70b`, then
# `next.sh 8b`.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
H=docs/benchmarks/gpu/2026-11-28-i-h200-h200x4
R=$OUT/next; mkdir -p $R
part=${1:-70b}
off() {  # name model tp extra...
  local name=$1 model=$2 tp=$3; shift 3
  timeout 90 python -m benchmarks.bench_offline --model $model --device cuda:0 \
    --dtype bfloat16 --lengths sharegpt --num-requests 96 --max-num-seqs 64 --num-blocks 8192 \
    --warmup-requests 4 --tensor-parallel-size $tp --modes llm42 --ratios 1.0 \
    --run-seconds 40 "$@" --out $R/$name.json > $R/$name.log 2>&1; echo "$name rc=$?"
  grep -hE "out tok/s|audit|rror" $R/$name.log | tail -3
}
if [ "$part" = 70b ]; then
timeout 40 python $H/colcheck.py > $R/colcheck.log 2>&1; cat $R/colcheck.log
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu_tensor_parallel.py \
  tests/test_kernels_lane_attention.py -k "70b_geometry or invariant_lane_dvr or decode_tile" \
  > $R/gputests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/gputests.log
for tp in 1 2 4; do off inv70-tp$tp random:llama3-70b@8 $tp --tp-invariant-lane; done
python -m benchmarks.compare_digests $R/inv70-tp1.json $R/inv70-tp2.json $R/inv70-tp4.json \
  | tee $R/invariance70.txt
else
for tp in 1 4; do
  off ord8-tp$tp random:llama3-8b $tp
  off inv8-tp$tp random:llama3-8b $tp --tp-invariant-lane
done
python -m benchmarks.compare_digests $R/inv8-tp1.json $R/inv8-tp4.json | tee $R/invariance8.txt
fi
