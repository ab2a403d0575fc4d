#!/usr/bin/env bash
# 4 x H200: (1) llm42 rollbacks at GQA group 4 vs 8, TP 1 and 2 (the 70B shape's rollbacks);
# (2) TP ranks on cuda:2,3 (the fix of the join thread's device); (3) the TP verifier rerun.
set -u
export PYTHONUNBUFFERED=1
ROOT=$PWD; R=/tmp/r/s3; rm -rf $R; mkdir -p $R
trap 'tar czf $OUT/s3.tgz -C /tmp/r s3' EXIT
for g in 4 8; do PYTHONPATH=$ROOT timeout 100 python docs/benchmarks/gpu/2026-11-28-h-h200x4/diag2.py $g cuda:0 2>&1 | grep -E "^group|Error" | tee -a $R/diag2.log; done
PYTHONPATH=$ROOT timeout 120 python -m pytest -q -p no:cacheprovider tests/test_gpu_tensor_parallel.py -k later > $R/later.log 2>&1; echo "later test rc=$?"; tail -3 $R/later.log
# redis-server for the verifier's registry: the redis wheel and Debian redis-server, staged as
# ../shared/device/README.md describes (here in one small bundle, .bundlemini)
mkdir -p /tmp/stage && cp .bundlemini/* /tmp/stage/ && bash /tmp/stage/unstage.sh > /dev/null
. benchmarks/gpu_env.sh "" && gpu_env_redis || exit 1
common=(--model random:llama3-8b --device cuda:0 --dtype bfloat16 --lengths sharegpt
        --num-requests 192 --max-num-seqs 128 --num-blocks 8192 --warmup-requests 16
        --tensor-parallel-size 2 --tp-invariant-lane --ratios 0.1,1.0 --dedicated-verifier-device cuda:2)
timeout 230 python -m benchmarks.bench_offline "${common[@]}" --modes llm42,llm42-dedicated \
  --dedicated-verifier-tp 2 --out $R/tpv2.json > $R/tpv2.log 2>&1; echo "tpv2 rc=$?"
grep -hE "audit|out tok/s|transfer:|rror|unavailable" $R/tpv2.log | tail -12
