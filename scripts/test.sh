#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run every check CI runs: ruff, mypy, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
PY=${PYTHON:-python3}
echo "== ruff"
$PY -m ruff check .
echo "== mypy"
$PY -m mypy detserve
echo "== pytest"
# pytest, then its exit status without CPython's final teardown (scripts/run_pytest.py)
$PY -X faulthandler -m scripts.run_pytest -q -p no:cacheprovider --timeout=900 "$@"
