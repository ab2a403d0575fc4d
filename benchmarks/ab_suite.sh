#!/usr/bin/env bash
# The same GPU measurements on an earlier commit's tree and on this one, interleaved on one
# machine in one call, so that the two compare (a change that must alter neither output nor
# speed). BEFORE: the earlier tree (`git archive <rev> | tar -x -C .ab-before`); SMOLLM2: the
# GGUF path. Stages, each run before then after:
#   det        deterministic outputs, 8B shape (llm42, batch_invariant) and SmolLM2 (llm42),
#              then compared bit for bit (benchmarks/det_outputs.py)
#   decode     the 8B decode step, nondeterministic and llm42 (bench_decode_step)
#   audit | target10 | target100   the gpu_suite.sh stages
#   tests      this tree's GPU tests only
# Results: $OUT/ab.tgz (re-packed after every stage) and $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
before=$(realpath "${BEFORE:?the earlier tree}")
final=${OUT:-results/ab}; mkdir -p "$final"; final=$(realpath "$final")
work=$(mktemp -d)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$work/gpu.txt"
side() {  # SIDE STAGE
  local dir=$root o="$work/$1-$2"
  [ "$1" = before ] && dir=$before
  mkdir -p "$o"
  case "$2" in
    det)
      (cd "$dir" && PYTHONPATH="$dir" python "$root/benchmarks/det_outputs.py" \
         --model random:llama3-8b --modes llm42,batch_invariant --out "$o/det-8b.json"
       PYTHONPATH="$dir" python "$root/benchmarks/det_outputs.py" --model "${SMOLLM2:?}" \
         --modes llm42 --max-tokens 64 --out "$o/det-smollm2.json") ;;
    decode)
      for m in nondeterministic llm42; do
        (cd "$dir" && python -m benchmarks.bench_decode_step --mode $m \
           --out "$o/decode-$m.json" 2>&1 | tail -7)
      done ;;
    tests)
      [ "$1" = after ] && (cd "$dir" && python -m pytest -q -m gpu -p no:cacheprovider tests \
         > "$o/gpu-tests.log" 2>&1; tail -5 "$o/gpu-tests.log") ;;
    *) (cd "$dir" && OUT="$o" SMOLLM2="${SMOLLM2:-smollm2}" bash benchmarks/gpu_suite.sh "$2") ;;
  esac
}
for stage in "$@"; do
  for s in before after; do
    echo "== $s $stage ($(date +%T))"
    side "$s" "$stage" 2>&1 | tail -25 | tee -a "$work/summary.txt"
  done
  if [ "$stage" = det ]; then
    for f in det-8b det-smollm2; do
      python benchmarks/det_outputs.py --compare "$work/before-det/$f.json" \
        "$work/after-det/$f.json" 2>&1 | sed "s/^/$f /" | tee -a "$work/summary.txt"
    done
  fi
  tar czf "$final/ab.tgz" -C "$work" . && cp "$work/summary.txt" "$final/summary.txt"
done
