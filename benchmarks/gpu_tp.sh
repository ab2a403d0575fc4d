#!/usr/bin/env bash
# Tensor parallelism on a machine with two or four GPUs (issue 36), one part per device call:
#   tests    the engine at TP=2 (and 4 with four GPUs) over NCCL with CUDA graphs
#            (tests/test_gpu_tensor_parallel.py)
#   step     8B shape: the engine's decode step (CUDA graphs holding the collectives) at
#            batch 1 and 64 for each TP size against each rank's memory roofline
#            (bench_decode_step); the runner's eager step and the runner-level
#            TP-invariance audit (tp_bench: one lane pass, the tree's bits at every TP
#            size, the ordinary sum's control)
#   audit    8B shape through the engine: the determinism audit at each TP size above 1
#            (RUNS, default 20); the TP-invariance audit (the invariant lane at every TP
#            size, and the ordinary lane at TP 1 as the control against the TP>1 audits):
#            deterministic outputs compared by hash (det_sha.txt)
#   offline  8B shape, ShareGPT-like lengths, NREQ requests (default 384), at each TP size:
#            nondeterministic, llm42 at 10 % and 100 %, batch_invariant, and llm42 at 100 %
#            with the TP-invariant lane (its cost)
# TPS: the TP sizes (default "1 2"; "1 2 4" on four GPUs). offline takes about 4-5 minutes a
# TP size on H200s: one or two sizes a device call. Needs nothing staged but the
# repository. Results in $OUT (default results/gpu-tp).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu-tp}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$out/gpu.txt"
model=random:llama3-8b

audit() {  # name, extra flags...
  local name=$1; shift
  timeout "${AUDIT_TIMEOUT:-150}" python -m benchmarks.determinism_audit --model $model \
    --device cuda:0 --dtype bfloat16 --runs "${RUNS:-20}" --max-tokens 48 "$@" \
    --out "$out/audit-$name.json" > "$out/audit-$name.log" 2>&1
  tail -2 "$out/audit-$name.log"
  python - "$out/audit-$name.json" "$name" >> "$out/det_sha.txt" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[2], r["passed"], r["control_drift_seen"],
      " ".join(str(t["deterministic_sha"]) for t in r["targets"]))
EOF
}

case "${1:-}" in
  tests)
    timeout 400 python -m pytest -q -p no:cacheprovider -rs tests/test_gpu_tensor_parallel.py \
      2>&1 | tee "$out/tests.log" | tail -15 ;;
  step)
    for tp in ${TPS:-1 2}; do
      timeout 200 python -m benchmarks.bench_decode_step --model $model --batches 1,64 \
        --tensor-parallel-size "$tp" --out "$out/decode-step-tp$tp.json" 2>&1 \
        | tee "$out/decode-step-tp$tp.log" | grep -E "^batch"
    done
    timeout 300 python -m benchmarks.tp_bench --model $model --tp ${TPS:-1 2} --batch 1 64 \
      --out "$out/tp-bench.json" 2>&1 | tee "$out/tp-bench.log" | tail -6 ;;
  audit)
    for tp in ${TPS:-1 2}; do
      [ "$tp" = 1 ] || audit "tp$tp" --tensor-parallel-size "$tp"
      audit "inv-tp$tp" --tp-invariant-lane --tensor-parallel-size "$tp" --runs 5
    done
    audit ord-tp1 --runs 5
    cat "$out/det_sha.txt" ;;
  offline)
    for tp in ${TPS:-1 2}; do
      common=(--model $model --device cuda:0 --dtype bfloat16 --lengths sharegpt
              --num-requests "${NREQ:-384}" --max-num-seqs 128 --num-blocks 8192
              --warmup-requests 64 --tensor-parallel-size "$tp")
      timeout "${OFFLINE_TIMEOUT:-330}" python -m benchmarks.bench_offline "${common[@]}" \
        --modes nondeterministic,llm42,batch_invariant --ratios 0.1,1.0 \
        --out "$out/offline-tp$tp.json" > "$out/offline-tp$tp.log" 2>&1
      echo "TP=$tp"; grep -E "audit|out tok/s" "$out/offline-tp$tp.log"
      timeout 200 python -m benchmarks.bench_offline "${common[@]}" --modes llm42 --ratios 1.0 \
        --tp-invariant-lane --out "$out/offline-tp$tp-inv.json" > "$out/offline-tp$tp-inv.log" 2>&1
      grep -E "audit|out tok/s" "$out/offline-tp$tp-inv.log"
    done ;;
  *) sed -n 2,17p "$0"; exit 2 ;;
esac
