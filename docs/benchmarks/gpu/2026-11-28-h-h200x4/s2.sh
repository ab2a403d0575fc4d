#!/usr/bin/env bash
# 4 x H200: (1) row-position invariance at the 70B and 8B TP=4 shard shapes (why 70B rolls
# back); (2) the TP verifier on GPUs: TP=2 decoder (GPUs 0,1, invariant lane), verifier at
# TP=2 (GPUs 2,3) against a TP=1 verifier (GPU 2) and the decoder's own lane.
set -u
export PYTHONUNBUFFERED=1
ROOT=$PWD; R=/tmp/r/s2; rm -rf $R; mkdir -p $R
trap 'tar czf $OUT/s2.tgz -C /tmp/r s2' EXIT
PYTHONPATH=$ROOT timeout 60 python .devrun/diag.py random:llama3-70b cuda:0 176 > $R/diag70.log 2>&1 &
PYTHONPATH=$ROOT timeout 60 python .devrun/diag.py random:llama3-8b cuda:1 256 > $R/diag8.log 2>&1 &
wait; cat $R/diag70.log $R/diag8.log | grep -v Warn
mkdir -p /tmp/stage && cp .bundlemini/* /tmp/stage/ && bash /tmp/stage/unstage.sh > /dev/null
. benchmarks/gpu_env.sh "" && gpu_env_redis || exit 1
common=(--model random:llama3-8b --device cuda:0 --dtype bfloat16 --lengths sharegpt
        --num-requests 192 --max-num-seqs 128 --num-blocks 8192 --warmup-requests 16
        --tensor-parallel-size 2 --tp-invariant-lane --ratios 0.1,1.0 --dedicated-verifier-device cuda:2)
timeout 250 python -m benchmarks.bench_offline "${common[@]}" --modes llm42,llm42-dedicated \
  --dedicated-verifier-tp 2 --out $R/tpv2.json > $R/tpv2.log 2>&1; echo "tpv2 rc=$?"
grep -hE "audit|out tok/s|transfer:|rror" $R/tpv2.log | tail -12
timeout 200 python -m benchmarks.bench_offline "${common[@]}" --modes nondeterministic,llm42-dedicated \
  --out $R/tpv1.json > $R/tpv1.log 2>&1; echo "tpv1 rc=$?"
grep -hE "audit|out tok/s|transfer:|rror" $R/tpv1.log | tail -12
