#!/usr/bin/env bash
# The same GPU measurements on an earlier commit's tree and on this one, interleaved on one
# machine in one call, so that the two compare (a change that must alter neither output nor
# speed). BEFORE: the earlier tree (`git archive <rev> | tar -x -C .ab-before`); SMOLLM2: the
# GGUF path. Stages, each run before then after:
#   det-8b | det-smol  deterministic outputs (8B shape: llm42 and batch_invariant; SmolLM2:
#                      llm42), then compared bit for bit (benchmarks/det_outputs.py)
#   decode             the 8B decode step, nondeterministic and llm42 (bench_decode_step)
#   audit-8b | audit-smol  the determinism audit, ${RUNS:-100} runs (determinism_audit)
#   target10 | target100   the gpu_suite.sh stages
#   tests              this tree's GPU tests only
# Results: $OUT/ab.tgz (re-packed after every stage) and $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
before=$(realpath "${BEFORE:?the earlier tree}")
final=${OUT:-results/ab}; mkdir -p "$final"; final=$(realpath "$final")
work=/tmp/ab; mkdir -p "$work"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$work/gpu.txt"
det() {  # DIR OUTFILE MODEL MODES MAX_TOKENS
  (cd "$1" && PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" python "$root/benchmarks/det_outputs.py" \
     --model "$3" --modes "$4" --max-tokens "$5" --out "$2")
}
audit() {  # DIR OUTFILE MODEL MAX_TOKENS
  (cd "$1" && python -m benchmarks.determinism_audit --model "$3" --device cuda \
     --dtype bfloat16 --runs "${RUNS:-100}" --max-tokens "$4" --out "$2" 2>&1 | tail -8)
}
side() {  # SIDE STAGE
  local dir=$root o="$work/$1-$2"
  [ "$1" = before ] && dir=$before
  mkdir -p "$o"
  case "$2" in
    det-8b) det "$dir" "$o/det.json" random:llama3-8b llm42,batch_invariant 32 ;;
    det-smol) det "$dir" "$o/det.json" "${SMOLLM2:?}" llm42 64 ;;
    decode)
      for m in nondeterministic llm42; do
        (cd "$dir" && python -m benchmarks.bench_decode_step --mode $m \
           --out "$o/decode-$m.json" 2>&1 | tail -7)
      done ;;
    audit-8b) audit "$dir" "$o/audit.json" random:llama3-8b 32 ;;
    audit-smol) audit "$dir" "$o/audit.json" "${SMOLLM2:?}" 64 ;;
    tests)
      # (the modules the device image can import: the serving tests need ray and redis)
      [ "$1" = after ] && (cd "$dir" && python -m pytest -q -m gpu -p no:cacheprovider \
         tests/test_gpu_engine.py tests/test_kernels_*.py tests/test_sampler.py \
         tests/test_gpu_attention_layout.py tests/test_kv_handle.py tests/test_graph_buckets.py \
         > "$o/gpu-tests.log" 2>&1; tail -8 "$o/gpu-tests.log") ;;
    *) (cd "$dir" && OUT="$o" SMOLLM2="${SMOLLM2:-smollm2}" bash benchmarks/gpu_suite.sh "$2") ;;
  esac
}
for stage in "$@"; do
  for s in before after; do
    echo "== $s $stage ($(date +%T))" | tee -a "$work/summary.txt"
    side "$s" "$stage" 2>&1 | tail -25 | tee -a "$work/summary.txt"
  done
  case "$stage" in det-*)
    python benchmarks/det_outputs.py --compare "$work/before-$stage/det.json" \
      "$work/after-$stage/det.json" 2>&1 | tee -a "$work/summary.txt" ;;
  esac
  tar czf "$final/ab.tgz" -C "$work" . && cp "$work/summary.txt" "$final/summary.txt"
done
