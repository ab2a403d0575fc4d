#!/usr/bin/env bash
# 4 x H200 (issue 36), after the decode tile probe and the plain-"cuda" fix: the GPU tests
# that failed on plain "cuda" and the probe's; the TP-invariance audit at the 70B shape's GQA
# group of 8 (its first 8 layers at TP 1, 2, 4 with the invariant lane; control: the
# ordinary lane at TP 1 and 4).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/r/i2; rm -rf $R; mkdir -p $R
trap 'tar czf $OUT/i2.tgz -C /tmp/r i2' EXIT
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_kernels_lane_attention.py \
  tests/test_gpu_engine.py tests/test_gpu_tensor_parallel.py \
  -k "decode_tile or aligned_decode_lane or alone_verifies or nondeterministic_follows" \
  > $R/gputests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/gputests.log
off() {  # name tp extra...
  local name=$1 tp=$2; shift 2
  timeout 100 python -m benchmarks.bench_offline --model random:llama3-70b@8 --device cuda:0 \
    --dtype bfloat16 --lengths sharegpt --num-requests 96 --max-num-seqs 64 --num-blocks 8192 \
    --warmup-requests 4 --tensor-parallel-size $tp --modes llm42 --ratios 1.0 \
    --run-seconds 40 "$@" --out $R/$name.json > $R/$name.log 2>&1; echo "$name rc=$?"
  grep -hE "out tok/s|audit|rror" $R/$name.log | tail -3
}
off inv-tp1 1 --tp-invariant-lane
off inv-tp2 2 --tp-invariant-lane
off inv-tp4 4 --tp-invariant-lane
off ord-tp1 1
off ord-tp4 4
python -m benchmarks.compare_digests $R/inv-tp1.json $R/inv-tp2.json $R/inv-tp4.json | tee $R/invariance.txt
python -m benchmarks.compare_digests $R/ord-tp1.json $R/ord-tp4.json | tee $R/control.txt
