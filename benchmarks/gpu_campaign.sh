#!/usr/bin/env bash
# Issue 37 on a lent GPU, one part per device call (each inside ~10 minutes):
#   campaign  the 8B-shape online matrix through `detserve serve` (ShareGPT; Figure 11,
#             Table 5, saturation, both latency targets), inside BUDGET_S (default 480 s,
#             server starts included): benchmarks/online_campaign.py run --profile 8b.
#             The whole matrix in one call leaves ~9 s windows (2026-11-28): split it over
#             calls with the same absolute rates, e.g. EXTRA="--series nondeterministic@0,
#             llm42@0.1 --rates sharegpt=8,14,18,22" then the other series
#   arxiv     the ArXiv-like trace, nondeterministic and llm42 at 10 % (BUDGET_S, 480)
#   audit     the served determinism audit on SmolLM2 (real weights), RUNS rounds (default
#             1000) under load, with the non-deterministic control; no round starts after
#             AUDIT_S seconds (default 420): benchmarks/served_audit.py
#   bits      the same deterministic requests on this GPU (8B shape with seeded random
#             weights, and SmolLM2), with the device and the determinism profile, into
#             $OUT/bits-<gpu>.json; compare two GPUs' files with
#             python benchmarks/det_outputs.py --compare A.json B.json --report cross.json
#             (EXTRA="--lane-gemm-rows 512": the lane chunk at which an H100 and an H200
#             agree, 2026-11-28)
# Needs (docs/benchmarks/online-campaign.md): the bundles unstaged in /tmp/stage and
# /tmp/site (wheels: ray[serve] 2.60.0, redis, fastapi, uvicorn, sse-starlette, gguf,
# protobuf 7.36.2; files: redis-bookworm-*.tar.gz, SmolLM2-135M-Instruct.Q4_1.gguf), and
# for campaign/arxiv the traces of `online_campaign prepare --profile 8b` in
# $TRACES (default results/campaign-traces, carried with the call).
# Results: $OUT (default results/gpu-campaign), at most 3 files a part, since the device
# returns at most 8 files, 2 folders down: <part>.tgz (everything: runs, report, plots, server
# logs), <part>-report.md (campaign and arxiv) and <part>.log. The work folder is
# /tmp/gpu-campaign/<part>.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
final=${OUT:-results/gpu-campaign}; mkdir -p "$final"
out=/tmp/gpu-campaign; mkdir -p "$out"
# a fresh work folder: a part run again on a warm machine must not pick up the last run's
# files (2026-11-28: a second campaign call packed the first one's runs and server log)
[ -n "$part" ] && rm -rf "${out:?}/$part"
pack() {  # the part's folder as one tarball (with Ray Serve's own logs, which say why a
          # deployment failed), its report and log beside it
  [ -d "$out/$part" ] && cp -r /tmp/ray/session_latest/logs/serve "$out/$part/ray-serve-logs" 2>/dev/null
  [ -d "$out/$part" ] && tar czf "$final/$part.tgz" -C "$out" "$part"
  [ -f "$out/$part/report.md" ] && cp "$out/$part/report.md" "$final/$part-report.md"
  [ -f "$out/$part.log" ] && cp "$out/$part.log" "$final/$part.log"
  ls -la "$final"
}
trap pack EXIT
traces=${TRACES:-results/campaign-traces}
smol=${SMOLLM2:-${STAGE:-/tmp/stage}/SmolLM2-135M-Instruct.Q4_1.gguf}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '-')
case "$part" in
  campaign|arxiv)
    . benchmarks/gpu_env.sh serve || exit 1
    # (PROFILE=cpu-smoke DATASETS=random TRACES=... runs this part on a CPU, as a dry run)
    [ "$part" = arxiv ] && pick=(--datasets arxiv-like --series nondeterministic@0,llm42@0.1) \
                        || pick=(--datasets "${DATASETS:-sharegpt}")
    # the driver keeps inside its budget; timeout only guards against a hang
    timeout -k 20 $(( ${BUDGET_S:-480} + 60 )) python3 -m benchmarks.online_campaign run \
      --profile "${PROFILE:-8b}" --traces "$traces" --budget-s "${BUDGET_S:-480}" "${pick[@]}" ${EXTRA:-} \
      --out "$out/$part" 2>&1 | tee "$out/$part.log" | grep -v "^\s*$" | tail -40 ;;
  audit)
    . benchmarks/gpu_env.sh serve || exit 1
    [ -f "$smol" ] || { echo "no $smol (stage the GGUF)"; exit 1; }
    timeout -k 20 $(( ${AUDIT_S:-420} + 120 )) python3 -m benchmarks.served_audit \
      --model "$smol" --device cuda --dtype bfloat16 --runs "${RUNS:-1000}" \
      --max-seconds "${AUDIT_S:-420}" ${EXTRA:-} --out "$out/audit/served-audit-smollm2.json" \
      2>&1 | tee "$out/audit.log" | tail -30
    cp "$out/audit/served-audit-smollm2.json" "$final/" 2>/dev/null ;;
  bits)
    . benchmarks/gpu_env.sh
    models=random:llama3-8b
    [ -f "$smol" ] && models="$models,$smol" || echo "no $smol: the 8B shape only"
    timeout -k 20 500 python3 benchmarks/det_outputs.py --models "$models" --device cuda \
      --dtype bfloat16 --modes "${MODES:-llm42}" --max-tokens 32 ${EXTRA:-} --out "$final/bits-$gpu.json" \
      2>&1 | tee "$out/bits.log" | tail -10 ;;
  *) trap - EXIT; sed -n 2,22p "$0"; exit 2 ;;
esac
