#!/usr/bin/env bash
# Everything the GPU issue measures, in stages that each fit one device call.
#   benchmarks/gpu_suite.sh smoke   # GPU tests (kernels + engine), decode step vs roofline
#   benchmarks/gpu_suite.sh kernels # kernel benchmark
#   benchmarks/gpu_suite.sh audit   # determinism audits: SmolLM2 (real weights) and 8B shape
#   benchmarks/gpu_suite.sh audit-bi # the same audits in batch_invariant mode
#   benchmarks/gpu_suite.sh perf    # offline throughput, 8B shape (Figure 10 analogue)
#   benchmarks/gpu_suite.sh table4  # SmolLM2 rollbacks per ratio, W x G sweep (needs $TRACE)
#   benchmarks/gpu_suite.sh align   # fast-path/lane alignment: cuBLAS row classes (8B), GPU engine tests
#   benchmarks/gpu_suite.sh align-step # decode step aligned vs split-KV, contexts 512 and 2048
#   benchmarks/gpu_suite.sh align-smol # SmolLM2 rollbacks aligned vs not, per ratio (needs $TRACE;
#                                      # $SWEEP, e.g. 16,32,64,128x1,4,8,16, adds a W x G sweep)
#   benchmarks/gpu_suite.sh target10  # the 10 % target: nondeterministic vs llm42, interleaved x2
#   benchmarks/gpu_suite.sh target100 # the 100 % target: batch_invariant vs llm42
#   benchmarks/gpu_suite.sh sampled   # seeded sampling of many rows (bench_sampler), and the
#                                     # 10 % workload at temperature ${TEMP:-1.0}
#     (both: $EXTRA goes to bench_offline as more flags, e.g. EXTRA="--lane-max-wait-steps 32")
#   benchmarks/gpu_suite.sh logprobs  # logprobs of many rows in one pass (kernels.logprobs,
#                                     # sampler.LOGPROB_KERNEL, off by default): its GPU tests,
#                                     # bench_sampler greedy and sampled with 5 logprobs
#   benchmarks/gpu_suite.sh mixed     # one eager mixed step per variant, profiled (p512, p128)
#   benchmarks/gpu_suite.sh profile10 # the 10 % workload with steps ${STEPS:-600:800} profiled:
#                                     # GPU time per stream (lane vs fast path), overlap
#   benchmarks/gpu_suite.sh decode-lane # the fast path's decode rows on another lane-kernel
#                                     # config (CFG=${CFG:-16:1:2}): lane sweep (same bits?),
#                                     # llm42 decode step, 10 % target without/with
#   benchmarks/gpu_suite.sh full-tiles # the lane kernel with whole tiles unmasked: GPU tests,
#                                     # lane sweep, llm42 decode step, 10 % target without/with
#   benchmarks/gpu_suite.sh fused     # the fused SiLU-and-multiply and residual add + RMSNorm (on by default)
#                                     # (EngineConfig.fused_silu_mul / fused_add_rmsnorm): GPU
#                                     # tests (the unfused bits?), decode steps per fusion, the
#                                     # 10 % workload without/with both
# Results go to ${OUT:-results/gpu}; the SmolLM2 GGUF path comes from $SMOLLM2 (default:
# the local cache, fetched once).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
smol=${SMOLLM2:-smollm2}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
lane_sweep() {  # the lane kernel's configs at the fast path's decode-row shapes
  timeout 200 python -m benchmarks.bench_kernels --quick --sweep lane --sweep-only \
    --out "$out/lane-sweep.json" 2>&1 | grep "lane decode"
}
offline10() {  # VARIANTS NAME: the 10 % workload, nondeterministic and llm42 per variant
  python -m benchmarks.bench_offline --model random:llama3-8b --device cuda --dtype bfloat16 \
    --lengths sharegpt --num-requests "${NREQ:-1024}" --max-num-seqs 128 --num-blocks 16384 \
    --warmup-requests 256 --modes nondeterministic,llm42 --ratios 0.1 \
    --repeat "${REPEAT:-1}" --variants "$1" --out "$out/offline-$2.json" 2>&1 | tail -16
}
case "${1:-}" in
  smoke)
    python -m pytest -q -m gpu tests/test_gpu_engine.py tests/test_kernels_*.py 2>&1 | tee "$out/gpu_tests.log" | tail -25
    python -m benchmarks.bench_decode_step --out "$out/decode-step.json" 2>&1 | tail -6
    python -m benchmarks.bench_decode_step --no-cuda-graphs --batches 1,64 --steps 10 \
      --out "$out/decode-step-eager.json" 2>&1 | tail -3 ;;
  kernels)
    timeout 240 python -m benchmarks.bench_kernels --out "$out/kernels.json" 2>&1 | tail -40 ;;
  audit)
    python -m benchmarks.determinism_audit --model "$smol" --device cuda --dtype bfloat16 \
      --runs 100 --max-tokens 64 --out "$out/audit-smollm2.json" 2>&1 | tail -8
    python -m benchmarks.determinism_audit --model random:llama3-8b --device cuda \
      --dtype bfloat16 --runs 100 --max-tokens 32 --out "$out/audit-llama8b.json" 2>&1 | tail -8 ;;
  audit-bi)
    # batch_invariant mode: every request deterministic (the same audit, that mode)
    python -m benchmarks.determinism_audit --model "$smol" --mode batch_invariant --device cuda \
      --dtype bfloat16 --runs 100 --max-tokens 64 --out "$out/audit-smollm2-bi.json" 2>&1 | tail -8
    python -m benchmarks.determinism_audit --model random:llama3-8b --mode batch_invariant \
      --device cuda --dtype bfloat16 --runs 100 --max-tokens 32 --out "$out/audit-llama8b-bi.json" \
      2>&1 | tail -8 ;;
  perf)
    python -m benchmarks.bench_offline --model random:llama3-8b --device cuda --dtype bfloat16 \
      --lengths sharegpt --num-requests "${NREQ:-1024}" --max-num-seqs 128 --num-blocks 16384 --warmup-requests 256 \
      --ratios 0.02,0.05,0.1,0.2,0.5,1.0 --out "$out/offline-llama8b.json" 2>&1 | tail -12 ;;
  table4)
    python -m benchmarks.bench_offline --model "$smol" --device cuda --dtype bfloat16 \
      --trace "${TRACE:?a loadgen ShareGPT trace}" --num-requests "${NREQ:-512}" --max-num-seqs 128 --num-blocks 16384 \
      --modes nondeterministic,llm42 --ratios 0.02,0.05,0.1,0.2,0.5,1.0 \
      --sweep 16,32,64,128x1,4,8,16 --out "$out/table4-smollm2.json" 2>&1 | tail -30 ;;
  align)
    python -m benchmarks.probe_gemm_classes --model random:llama3-8b --out "$out/gemm-classes-llama8b.json" 2>&1 | tail -8
    python -m pytest -q -m gpu tests/test_gpu_engine.py 2>&1 | tee "$out/gpu_engine_tests.log" | tail -8 ;;
  align-step)
    python -m benchmarks.bench_decode_step --out "$out/decode-step.json" 2>&1 | tail -6
    python -m benchmarks.bench_decode_step --no-align-fast-path --batches 1,64 --out "$out/decode-step-split.json" 2>&1 | tail -3
    python -m benchmarks.bench_decode_step --context 2048 --batches 1,8,64 --out "$out/decode-step-ctx2048.json" 2>&1 | tail -4 ;;
  align-smol)
    python -m benchmarks.probe_gemm_classes --model "$smol" --out "$out/gemm-classes-smollm2.json" 2>&1 | tail -8
    common=(--model "$smol" --device cuda --dtype bfloat16 --trace "${TRACE:?a loadgen ShareGPT trace}"
            --num-requests "${NREQ:-512}" --max-num-seqs 128 --num-blocks 16384)
    python -m benchmarks.bench_offline "${common[@]}" --modes llm42 --ratios 1.0 --no-align-fast-path \
      --out "$out/table4-smollm2-unaligned.json" 2>&1 | tail -3
    python -m benchmarks.bench_offline "${common[@]}" --modes nondeterministic,llm42 \
      --ratios 0.02,0.05,0.1,0.2,0.5,1.0 --out "$out/table4-smollm2.json" 2>&1 | tail -9
    [ -z "${SWEEP:-}" ] || python -m benchmarks.bench_offline "${common[@]}" --num-requests 256 \
      --modes nondeterministic --ratios 1.0 --sweep "$SWEEP" --out "$out/sweep-smollm2.json" 2>&1 | tail -18 ;;
  target10|target100)
    [ "$1" = target10 ] && pick=(--modes nondeterministic,llm42 --ratios 0.1 --repeat "${REPEAT:-2}") \
                        || pick=(--modes batch_invariant,llm42 --ratios 1.0)
    python -m benchmarks.bench_offline --model random:llama3-8b --device cuda --dtype bfloat16 \
      --lengths sharegpt --num-requests "${NREQ:-1024}" --max-num-seqs 128 --num-blocks 16384 \
      --warmup-requests 256 "${pick[@]}" ${EXTRA:-} --out "$out/offline-$1.json" 2>&1 | tail -12 ;;
  sampled)
    python -m benchmarks.bench_sampler --rows 1,8,64,128,512 --out "$out/sampler.json" 2>&1 | tail -15
    python -m benchmarks.bench_offline --model random:llama3-8b --device cuda --dtype bfloat16 \
      --lengths sharegpt --num-requests "${NREQ:-1024}" --max-num-seqs 128 --num-blocks 16384 \
      --warmup-requests 256 --modes nondeterministic,llm42 --ratios 0.1 \
      --temperature "${TEMP:-1.0}" ${EXTRA:-} --out "$out/offline10-sampled.json" 2>&1 | tail -12 ;;
  logprobs)
    python -m pytest -q -m gpu tests/test_kernels_logprobs.py tests/test_sampler.py \
      tests/test_gpu_engine.py -k "logprob" 2>&1 | tee "$out/logprobs-tests.log" | tail -5
    for t in 0 1.0; do
      python -m benchmarks.bench_sampler --rows 1,8,64,128,512 --temperature $t --logprobs 5 \
        --paths row,kernel,lpk --out "$out/sampler-lp5-t$t.json" 2>&1 | tail -15
    done ;;
  mixed)
    for p in 512 128; do
      python -m benchmarks.bench_mixed_step --model random:llama3-8b --prefill-tokens $p --profile \
        --out "$out/mixed-p$p.json" 2>&1 | grep -v Warning | tail -6
    done ;;
  profile10)
    python -m benchmarks.bench_offline --model random:llama3-8b --device cuda --dtype bfloat16 \
      --lengths sharegpt --num-requests "${NREQ:-1024}" --max-num-seqs 128 --num-blocks 16384 \
      --warmup-requests 256 --modes nondeterministic,llm42 --ratios 0.1 \
      --profile-steps "${STEPS:-600:800}" --out "$out/offline-profile10.json" 2>&1 | tail -24 ;;
  decode-lane)
    c=${CFG:-16:1:2}
    lane_sweep
    for x in "" "$c"; do
      python -m benchmarks.bench_decode_step --mode llm42 --batches 64,128 --aligned-decode-lane "$x" \
        --out "$out/decode-step-llm42-$(echo "${x:-lane}" | tr : -).json" 2>&1 | grep batch
    done
    offline10 ";aligned_decode_lane=$c" decode-lane ;;
  full-tiles)
    # the lane kernel with whole KV tiles unmasked: same bits? faster? (LaneConfig.full_tiles)
    python -m pytest -q -m gpu tests/test_kernels_lane_attention.py tests/test_gpu_engine.py \
      -k "full_tiles or masked_tiles or dvr_equals or aligned_fast_path_alone" 2>&1 | tee "$out/full_tiles_tests.log" | tail -3
    lane_sweep
    for x in --no-lane-full-tiles --lane-full-tiles; do
      python -m benchmarks.bench_decode_step --mode llm42 --batches 64,128 $x \
        --out "$out/decode-step-llm42${x%%-lane-full-tiles}.json" 2>&1 | grep batch
    done
    offline10 "lane_full_tiles=0;lane_full_tiles=1" full-tiles ;;
  fused)
    python -m pytest -q -m gpu tests/test_kernels_silu_mul.py tests/test_kernels_batch_invariant.py \
      tests/test_gpu_engine.py -k "silu or rmsnorm or fused or dvr_equals" 2>&1 \
      | tee "$out/fused_tests.log" | tail -3
    none=(--no-fused-silu-mul --no-fused-add-rmsnorm)
    both=(--fused-silu-mul --fused-add-rmsnorm)
    step() {  # MODE NAME FLAGS...
      python -m benchmarks.bench_decode_step --mode "$1" --batches 8,64,128 "${@:3}" \
        --out "$out/decode-step-$1-$2.json" 2>&1 | grep batch | sed "s/^/$1 $2: /"
    }
    step nondeterministic none "${none[@]}"
    step nondeterministic silu --fused-silu-mul --no-fused-add-rmsnorm
    step nondeterministic addnorm --no-fused-silu-mul --fused-add-rmsnorm
    step nondeterministic both "${both[@]}"
    step llm42 none "${none[@]}"
    step llm42 both "${both[@]}"
    for v in none both; do
      [ $v = none ] && flags=("${none[@]}") || flags=("${both[@]}")
      python -m benchmarks.bench_offline --model random:llama3-8b --device cuda --dtype bfloat16 \
        --lengths sharegpt --num-requests "${NREQ:-1024}" --max-num-seqs 128 --num-blocks 16384 \
        --warmup-requests 256 --modes nondeterministic,llm42 --ratios 0.1 "${flags[@]}" \
        --out "$out/offline-10pct-$v.json" 2>&1 | grep "tok/s" | sed "s/^/$v: /"
    done ;;
  *) sed -n 2,29p "$0"; exit 2 ;;
esac
