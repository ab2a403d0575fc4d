#!/usr/bin/env bash
# The verifier on a GPU of its own (issue 35), on a machine with two GPUs: decoder on GPU 0,
# verifier replica on GPU 1, K/V over NCCL (benchmarks/dedicated.py, bench_offline's
# llm42-dedicated mode).
#
# Runs after the staged bundles (../shared/device/stage.sh: ray, redis, fastapi, uvicorn,
# sse-starlette and gguf wheels, protobuf 7.36.2, redis-bookworm-7.0.15.tar.gz from
# benchmarks/stage_redis.sh, the SmolLM2 GGUF):
#   cp .bundleN/* /tmp/stage/ && bash .bundleN/unstage.sh && bash benchmarks/gpu_dedicated.sh check
#   bash benchmarks/gpu_dedicated.sh perf
#   bash benchmarks/gpu_dedicated.sh served
# check: nvidia-smi topology; the CPU (gloo) tests of the transfer on this image; NCCL
#        transfer times for a lane pass's row counts (bench_transfer); SmolLM2 and the 8B
#        shape verified co-located and dedicated, sampled with logprobs: the audit line
#        says whether every deterministic request got one output across all of them.
# perf:  8B shape (random weights), ShareGPT-like lengths, offline throughput of
#        nondeterministic, co-located llm42 and llm42-dedicated at 10 %, 50 % and 100 %
#        deterministic traffic in one process (same GPU 0 for every decoder); K/V bytes and
#        wait per pass, the verifier's busy fraction. NREQ (default 768) requests a run.
# served: the served path (`detserve serve`, as a user starts it) at one Poisson request
#        rate, FRACTIONS (default 0.6) of nondeterministic's measured capacity: the P99
#        inter-token latency of non-deterministic requests at 50 % deterministic traffic
#        with a dedicated verifier, against co-located and nondeterministic at the same
#        rate (benchmarks/online_campaign.py; traces of `online_campaign prepare --profile
#        8b` carried in $TRACES, default results/campaign-traces; BUDGET_S default 420).
# Results in $OUT (default results/gpu-dedicated).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu-dedicated}; mkdir -p "$out"
stage=${STAGE:-/tmp/stage}
smol=$stage/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
. benchmarks/gpu_env.sh "" && gpu_env_redis || exit 1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"

audits() {  # SmolLM2 and the 8B shape, co-located and dedicated (logs kept in $out)
  for spec in "$smol" random:llama3-8b; do
    name=$([ "$spec" = "$smol" ] && echo smollm2 || echo llama8b)
    timeout "${AUDIT_TIMEOUT:-200}" python -m benchmarks.bench_offline --model "$spec" \
      --device cuda:0 --dtype bfloat16 --num-requests 64 --input-len 200 --output-len 96 \
      --modes llm42,llm42-dedicated --ratios 0.5,1.0 --temperature 0.8 --logprobs 1 \
      --warmup-requests 4 --dedicated-verifier-device cuda:1 \
      --out "$out/audit-$name.json" > "$out/audit-$name.log" 2>&1
    grep -E "audit|out tok/s|transfer:" "$out/audit-$name.log"
  done
}

case "${1:-}" in
  check)
    nvidia-smi topo -m | tee "$out/topo.txt"
    timeout 200 python -m pytest -q -p no:cacheprovider tests/test_distributed.py \
      tests/test_dedicated_verifier.py 2>&1 | tee "$out/cpu-tests.log" | tail -3
    timeout 120 python -m benchmarks.bench_transfer --devices cuda:0,cuda:1 \
      --out "$out/transfer-nccl.json" 2>&1 | tail -7
    audits ;;
  audits)
    audits ;;
  perf)
    timeout 590 python -m benchmarks.bench_offline --model random:llama3-8b --device cuda:0 \
      --dtype bfloat16 --lengths sharegpt --num-requests "${NREQ:-768}" --max-num-seqs 128 \
      --num-blocks 16384 --warmup-requests 128 \
      --modes nondeterministic,llm42,llm42-dedicated --ratios 0.1,0.5,1.0 \
      --dedicated-verifier-device cuda:1 --out "$out/offline-8b.json" 2>&1 \
      | tee "$out/offline-8b.log" | grep -E "audit|out tok/s|transfer:|lane:" ;;
  served)
    . benchmarks/gpu_env.sh serve || exit 1
    timeout -k 20 $(( ${BUDGET_S:-420} + 60 )) python -m benchmarks.online_campaign run \
      --profile 8b --traces "${TRACES:-results/campaign-traces}" --datasets sharegpt \
      --series nondeterministic@0,llm42@0.5,llm42-dedicated@0.5 \
      --fractions "${FRACTIONS:-0.6}" --budget-s "${BUDGET_S:-420}" --out "$out/served" \
      > "$out/served.log" 2>&1
    # Ray Serve's logs of the last server (the dedicated one): a verifier's stall or failover
    cp -r /tmp/ray/session_latest/logs/serve "$out/served/ray-serve-logs" 2>/dev/null
    # packed too: the device's $OUT does not bring back folders nested this deep
    tar -czf "$out/served.tgz" -C "$out" served
    tail -30 "$out/served.log"; cp "$out/served/report.md" "$out/served-report.md" 2>/dev/null ;;
  *) sed -n 2,27p "$0"; exit 2 ;;
esac
