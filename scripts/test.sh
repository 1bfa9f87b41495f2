#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on the CPU, then run the tests marked `compat` again
# against transformers 5.17, the oldest release kvcompress supports. Extra arguments go to both pytest runs.
# The tests run in one worker process per core (pytest-xdist; KVC_TEST_WORKERS=N sets the count, 0 runs
# them in this process), each with one torch thread: on the 2-core CI box the suite takes 9 minutes this
# way, against 15 in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${KVC_VENV:-.venv}"
. "$VENV/bin/activate"
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
WORKERS="${KVC_TEST_WORKERS:-$(nproc)}"
if [ "$WORKERS" -gt 8 ]; then WORKERS=8; fi  # each worker loads SmolLM2 once; more barely helps
if [ "$WORKERS" -gt 1 ]; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # workers x threads = cores, not their square
fi
python -m pytest -q -p no:cacheprovider -n "$WORKERS" tests "$@"

# transformers 5.17 lives in its own folder, put first on PYTHONPATH for the compat run only. Installed
# without dependencies (the environment's torch, tokenizers, safetensors serve both releases), plus the
# two that 5.17 imports and the main environment lacks: httpx, and huggingface_hub < 2.
TF517="$VENV/tf517"
if ! PYTHONPATH="$TF517" python -c 'import sys, transformers; sys.exit(not transformers.__version__.startswith("5.17."))' 2>/dev/null; then
  python -m pip install -q --upgrade --no-deps --target "$TF517" \
    transformers==5.17.0 huggingface_hub==1.33.0 httpx==0.28.1 httpcore==1.0.9
fi
# KVC_EXPECT_TRANSFORMERS makes a test fail if this run imported another transformers.
KVC_EXPECT_TRANSFORMERS=5.17 PYTHONPATH="$TF517" \
  python -m pytest -q -p no:cacheprovider -n "$WORKERS" -m compat tests "$@"
