#!/usr/bin/env bash
# 4 x H200 (issue 36), after the shared invariant-lane chunk: the GPU TP tests that cover
# it, and the TP-invariance audit at the 70B geometry again (invariant lane, TP 1/2/4; the
# control, the ordinary lane at TP 1 and 4, ran in call 4 with the same arguments).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/r/i3; rm -rf $R; mkdir -p $R
trap 'tar czf $OUT/i3.tgz -C /tmp/r i3' EXIT
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu_tensor_parallel.py \
  -k "70b_geometry or invariant_lane_dvr" > $R/gputests.log 2>&1; echo "gpu tests rc=$?"
tail -3 $R/gputests.log
off() {  # name tp extra...
  local name=$1 tp=$2; shift 2
  timeout 90 python -m benchmarks.bench_offline --model random:llama3-70b@8 --device cuda:0 \
    --dtype bfloat16 --lengths sharegpt --num-requests 96 --max-num-seqs 64 --num-blocks 8192 \
    --warmup-requests 4 --tensor-parallel-size $tp --modes llm42 --ratios 1.0 \
    --run-seconds 40 "$@" --out $R/$name.json > $R/$name.log 2>&1; echo "$name rc=$?"
  grep -hE "out tok/s|audit|rror|probed" $R/$name.log | tail -4
}
off inv-tp1 1 --tp-invariant-lane
off inv-tp2 2 --tp-invariant-lane
off inv-tp4 4 --tp-invariant-lane
python -m benchmarks.compare_digests $R/inv-tp1.json $R/inv-tp2.json $R/inv-tp4.json | tee $R/invariance.txt
