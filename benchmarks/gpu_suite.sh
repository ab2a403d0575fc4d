#!/usr/bin/env bash
# Everything the GPU issue measures, in stages that each fit one device call.
#   benchmarks/gpu_suite.sh smoke   # GPU tests (kernels + engine), kernel benchmark
#   benchmarks/gpu_suite.sh audit   # determinism audits: SmolLM2 (real weights) and 8B shape
#   benchmarks/gpu_suite.sh perf    # offline throughput + decode step vs roofline
# Results go to ${OUT:-results/gpu}; the SmolLM2 GGUF path comes from $SMOLLM2 (default:
# the local cache, fetched once).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
smol=${SMOLLM2:-smollm2}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
case "${1:-}" in
  smoke)
    python -m pytest -q -m gpu tests/test_gpu_engine.py tests/test_kernels_*.py -x 2>&1 | tee "$out/gpu_tests.log" | tail -25
    timeout 240 python -m benchmarks.bench_kernels --out "$out/kernels.json" 2>&1 | tail -40 ;;
  audit)
    python -m benchmarks.determinism_audit --model "$smol" --device cuda --dtype bfloat16 \
      --runs 100 --max-tokens 64 --out "$out/audit-smollm2.json" 2>&1 | tail -8
    python -m benchmarks.determinism_audit --model random:llama3-8b --device cuda \
      --dtype bfloat16 --runs 100 --max-tokens 32 --out "$out/audit-llama8b.json" 2>&1 | tail -8 ;;
  perf)
    python -m benchmarks.bench_decode_step --out "$out/decode-step.json" 2>&1 | tail -12
    python -m benchmarks.bench_offline --model random:llama3-8b --device cuda --dtype bfloat16 \
      --lengths sharegpt --num-requests "${NREQ:-1024}" --max-num-seqs 128 --num-blocks 16384 \
      --ratios 0.02,0.05,0.1,0.2,0.5,1.0 --out "$out/offline-llama8b.json" 2>&1 | tail -12 ;;
  *) sed -n 2,7p "$0"; exit 2 ;;
esac
