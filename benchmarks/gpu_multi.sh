#!/usr/bin/env bash
# Issue 35 on four GPUs: three decoders sharing one dedicated verifier (on GPU 3) against
# four independent engines, throughput per GPU (benchmarks/multi_decoder.py). 8B shape
# (random weights), ShareGPT-like lengths, one set of NREQ (default 1536) requests dealt out
# among the engines, in this order:
#   dedicated@0.1  3 llm42 decoders (GPUs 0-2, a process each) + the verifier replica, 10 %
#   dedicated@1.0  the same at 100 % deterministic traffic (the replica started once)
#   replicas:nondeterministic, replicas:batch_invariant   4 engines (GPUs 0-3, a process each)
# Each engine warms up and queues its share; all start together. Per run: output tok/s per
# engine, in total and per GPU (total / 4), rollbacks; the determinism audit of the two
# dedicated runs (a request deterministic in both got one output).
#
# Runs after the staged bundles (redis-server and the serving wheels, as for
# benchmarks/gpu_dedicated.sh: the verifier replica registers in an embedded Redis):
#   cp .bundleN/* /tmp/stage/ && bash .bundleN/unstage.sh && bash benchmarks/gpu_multi.sh
# About 500 s (TIMEOUT_S, default 540, bounds the benchmark). Results in $OUT (default
# results/gpu-multi): gpu.txt, multi-8b.log, multi-8b.json.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu-multi}; mkdir -p "$out"
. benchmarks/gpu_env.sh "" && gpu_env_redis || exit 1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
gpus=$(nvidia-smi -L | wc -l)
[ "$gpus" -ge 4 ] || { echo "gpu_multi: needs 4 GPUs, found $gpus"; exit 1; }
timeout -k 20 "${TIMEOUT_S:-540}" python -m benchmarks.multi_decoder --model random:llama3-8b \
  --dtype bfloat16 --devices cuda:0,cuda:1,cuda:2,cuda:3 --lengths sharegpt \
  --num-requests "${NREQ:-1536}" --max-num-seqs 128 --num-blocks 16384 --warmup-requests 32 \
  --runs dedicated@0.1,dedicated@1.0,replicas:nondeterministic,replicas:batch_invariant \
  --start-timeout-s 240 --run-timeout-s 150 --out "$out/multi-8b.json" 2>&1 \
  | tee "$out/multi-8b.log" | grep -E "out tok/s|audit|multi_decoder:"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "gpu_multi: the benchmark exited $rc (see $out/multi-8b.log)"; tail -20 "$out/multi-8b.log"; }
exit "$rc"
