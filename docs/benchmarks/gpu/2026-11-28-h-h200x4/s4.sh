#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1
ROOT=$PWD; R=/tmp/r/s4; rm -rf $R; mkdir -p $R
trap 'tar czf $OUT/s4.tgz -C /tmp/r s4' EXIT
PYTHONPATH=$ROOT timeout 120 python -m pytest -q -p no:cacheprovider tests/test_gpu_tensor_parallel.py -k later > $R/later.log 2>&1; echo "later test rc=$?"; tail -2 $R/later.log
PYTHONPATH=$ROOT timeout 100 python .devrun/diag2.py 8 cuda:0 2>&1 | grep -E "^group|Error" | tee -a $R/diag2.log
PYTHONPATH=$ROOT timeout 100 python .devrun/diag2.py 4 cuda:0 2>&1 | grep -E "^group|Error" | tee -a $R/diag2.log
