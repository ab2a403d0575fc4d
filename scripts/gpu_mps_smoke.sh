#!/usr/bin/env bash
# GPU machine: `detserve serve --mps` end to end. Starts the server on CUDA (random:tiny, the
# MPS daemon started by the server), waits for /health, sends the same deterministic request
# twice (the two texts must be equal), stops the server with SIGINT and checks that the
# daemon it started is gone. Needs the staged wheels in /tmp/site and a redis-server in
# /tmp/stage/redis (benchmarks/gpu_serving.sh's staging); writes $OUT/serve.log.
set -u
OUT=${OUT:-/tmp}
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/stage/redis:/tmp/site/bin:$PATH RAY_USAGE_STATS_ENABLED=0
python3 -m services.console serve --device cuda --dtype bfloat16 --model random:tiny --mps --port 18000 --grpc-port 19000 > $OUT/serve.log 2>&1 &
pid=$!
for i in $(seq 90); do curl -sf localhost:18000/health >/dev/null && break; sleep 1; done
echo "health after ${i}s: $(curl -s -o /dev/null -w '%{http_code}' localhost:18000/health)"
echo "mps daemon: $(pgrep -c -f nvidia-cuda-mps-control)"
for k in 1 2; do
curl -s localhost:18000/v1/completions -H 'content-type: application/json' -d '{"model":"random:tiny","prompt":"hello there","max_tokens":12,"is_deterministic":true,"seed":3,"logprobs":1}' | python3 -c 'import json,sys; d=json.load(sys.stdin); print("choice", repr(d["choices"][0]["text"]), sorted(d.get("determinism") or {})[:4])' 2>&1 | tail -1
done
kill -INT $pid; wait $pid; echo "serve exit $?"
sleep 1; echo "mps daemon after: $(pgrep -c -f nvidia-cuda-mps-control)"
grep -E "detserve:|MPS|Error|error" $OUT/serve.log | head -8
