#!/usr/bin/env bash
# Tenth session (issue 36) on 2 x H200: the tree's column blocks (76d4550, a5ec563,
# 130c1e6) on a GPU. `j.sh check`: (COLCHECK=1: does a column of a column-parallel
# product keep its bits in a call of fewer columns, colcheck.py), the aligned decode rows
# against the lane per product (posdiag.py), the GPU tests of the TP file and the
# decode tile, the 70B geometry's invariance audit at TP 1 and 2. `j.sh cost`: the
# invariant lane against the ordinary lane (8B shape, TP 1 and 2, 100 %), and the
# invariance audit between them. `j.sh leaf` (after the leaf-major blocks): the GPU tests
# of the tree, then as cost. `j.sh x4` (4 x H200): the 70B geometry's invariance audit at
# TP 1 and 4, and the 8B cost at TP=1. Results go straight to $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
I=docs/benchmarks/gpu/2026-11-28-i-h200-h200x4 J=docs/benchmarks/gpu/2026-11-28-j-h200-h200x2-h200x4
R=$OUT/${1:-check}; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $R/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $R/gpu.txt
off() {  # name model tp extra...
  local name=$1 model=$2 tp=$3; shift 3
  timeout 100 python -m benchmarks.bench_offline --model $model --device cuda:0 \
    --dtype bfloat16 --lengths sharegpt --num-requests 96 --max-num-seqs 64 --num-blocks 8192 \
    --warmup-requests 4 --tensor-parallel-size $tp --modes llm42 --ratios 1.0 \
    --run-seconds 40 "$@" --out $R/$name.json > $R/$name.log 2>&1; echo "$name rc=$?"
  grep -hE "out tok/s|audit|rollback|rror" $R/$name.log | tail -4
}
if [ "${1:-check}" = x4 ]; then  # (4 x H200) the invariance audit at the 70B geometry
  for tp in 1 4; do off inv70-tp$tp random:llama3-70b@8 $tp --tp-invariant-lane; done
  python -m benchmarks.compare_digests $R/inv70-tp1.json $R/inv70-tp4.json | tee $R/invariance70.txt
  off inv8-tp1 random:llama3-8b 1 --tp-invariant-lane; off ord8-tp1 random:llama3-8b 1
elif [ "${1:-check}" = check ]; then
  [ -n "${COLCHECK:-}" ] && { timeout 60 python $I/colcheck.py > $R/colcheck.log 2>&1; cat $R/colcheck.log; }
  timeout 120 python $J/posdiag.py random:llama3-70b@2 1 > $R/posdiag.log 2>&1
  echo "posdiag rc=$?"; grep -E "^N=|chunk=" $R/posdiag.log
  timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_tensor_parallel.py \
    tests/test_kernels_lane_attention.py > $R/gputests.log 2>&1; echo "gpu tests rc=$?"
  tail -5 $R/gputests.log
  for tp in 1 2; do off inv70-tp$tp random:llama3-70b@8 $tp --tp-invariant-lane; done
  python -m benchmarks.compare_digests $R/inv70-tp1.json $R/inv70-tp2.json | tee $R/invariance70.txt
else
  [ "$1" = leaf ] && { timeout 150 python -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gpu_tensor_parallel.py -k "70b_geometry or invariant_lane_dvr" \
    > $R/gputests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/gputests.log; }
  for tp in 1 2; do
    off ord8-tp$tp random:llama3-8b $tp
    off inv8-tp$tp random:llama3-8b $tp --tp-invariant-lane
  done
  python -m benchmarks.compare_digests $R/inv8-tp1.json $R/inv8-tp2.json | tee $R/invariance8.txt
  python -m benchmarks.compare_digests $R/ord8-tp1.json $R/ord8-tp2.json | tee $R/control8.txt
fi
