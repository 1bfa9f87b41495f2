#!/usr/bin/env bash
# Set up (if needed) and run the main job on the embedded default model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${KVC_VENV:-.venv}"
. "$VENV/bin/activate"
kvcompress generate smollm2-135m "Explain in two sentences why the sky is blue." --preset nuq4 "$@"
