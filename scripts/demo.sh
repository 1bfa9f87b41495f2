#!/usr/bin/env bash
# Set up (if needed) and run the main job on the embedded default model (SmolLM2-135M-Instruct):
# calibrate a nuq4 config on the shipped calibration text, then evaluate it against the presets and the
# uncompressed cache on the (different) evaluation text: one table, a JSON file and a plot in out/.
# Extra arguments go to `kvcompress eval`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${KVC_VENV:-.venv}"
. "$VENV/bin/activate"
mkdir -p out
kvcompress generate smollm2-135m "Explain in two sentences why the sky is blue." --preset nuq4 -n 48
kvcompress calibrate smollm2-135m --out out/smollm2-nuq4.safetensors --samples 16 --seq-len 1024
kvcompress inspect out/smollm2-nuq4.safetensors
kvcompress eval smollm2-135m --config out/smollm2-nuq4.safetensors -p nuq4 -p fp8 -p int4 \
  --context 1024 --passkey-lengths 1024 --json out/eval.json --plot out/eval.png "$@"
