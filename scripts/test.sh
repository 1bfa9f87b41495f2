#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on the CPU, then run the tests marked `compat` again
# against transformers 5.17, the oldest release kvcompress supports. Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${KVC_VENV:-.venv}"
. "$VENV/bin/activate"
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
python -m pytest -q -p no:cacheprovider tests "$@"

# transformers 5.17 lives in its own folder, put first on PYTHONPATH for the compat run only. Installed
# without dependencies (the environment's torch, tokenizers, safetensors serve both releases), plus the
# two that 5.17 imports and the main environment lacks: httpx, and huggingface_hub < 2.
TF517="$VENV/tf517"
if ! PYTHONPATH="$TF517" python -c 'import sys, transformers; sys.exit(not transformers.__version__.startswith("5.17."))' 2>/dev/null; then
  python -m pip install -q --upgrade --no-deps --target "$TF517" \
    transformers==5.17.0 huggingface_hub==1.33.0 httpx==0.28.1 httpcore==1.0.9
fi
# KVC_EXPECT_TRANSFORMERS makes a test fail if this run imported another transformers.
KVC_EXPECT_TRANSFORMERS=5.17 PYTHONPATH="$TF517" python -m pytest -q -p no:cacheprovider -m compat tests "$@"
