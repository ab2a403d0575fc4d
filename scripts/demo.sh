#!/usr/bin/env bash
# Set up, start the cluster on the real SmolLM2 model (local Ray, embedded Redis, one
# router, decoder and verifier), show that a deterministic request reproduces exactly
# while other traffic runs beside it, then keep serving until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
PY=${PYTHON:-python3}
PORT=${PORT:-8000}
$PY -m services.console serve --model smollm2 --port "$PORT" "$@" &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null' EXIT INT TERM
echo "== waiting for http://127.0.0.1:$PORT/health"
for _ in $(seq 1 300); do
  curl -fs "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 $server 2>/dev/null || { echo "server exited"; exit 1; }
  sleep 1
done
$PY - "$PORT" <<'PYEOF'
import concurrent.futures as cf, json, sys
from openai import OpenAI
client = OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="none")
ask = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
def det():
    r = client.chat.completions.create(model="smollm2", messages=ask, max_tokens=48,
        temperature=0.7, seed=42, extra_body={"is_deterministic": True})
    return r.choices[0].message.content, r.model_extra.get("determinism")
def other(i):
    return client.completions.create(model="smollm2", prompt=f"Story {i}: once upon a time",
                                     max_tokens=24 + 8 * i).choices[0].text
first, fp = det()
with cf.ThreadPoolExecutor(6) as pool:
    noise = [pool.submit(other, i) for i in range(5)]
    second, _ = pool.submit(det).result()
    [f.result() for f in noise]
print("deterministic answer, alone      :", first)
print("deterministic answer, under load :", second)
print("identical:", first == second)
print("determinism profile:", json.dumps(fp))
PYEOF
echo "== serving on http://127.0.0.1:$PORT/v1 (OpenAI API) and :9000 (gRPC); Ctrl-C to stop"
wait $server
