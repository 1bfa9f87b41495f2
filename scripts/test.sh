#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on the CPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${KVC_VENV:-.venv}"
. "$VENV/bin/activate"
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
python -m pytest -q -p no:cacheprovider tests "$@"
