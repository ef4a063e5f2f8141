#!/usr/bin/env bash
# Run the Mooncake hypothesis on a GPU machine and print its report. Installs vLLM and the
# Mooncake transfer engine into the project environment first.
#   BTB_GPU_MODEL=Qwen/Qwen2.5-0.5B-Instruct scripts/gpu_check.sh   (or a local model folder)
# MOONCAKE_PKG picks the transfer-engine wheel: mooncake-transfer-engine-cuda13 for vLLM's
# default CUDA 13 build, mooncake-transfer-engine for CUDA 12.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${VENV:-.venv}/bin/python"
: "${BTB_GPU_MODEL:?set BTB_GPU_MODEL to a small public model name or local path}"
export BTB_GPU_MODEL
MOONCAKE_PKG="${MOONCAKE_PKG:-mooncake-transfer-engine-cuda13}"

if ! "$PY" -c "import vllm" 2>/dev/null; then
    "$PY" -m pip install --quiet vllm
fi
if ! "$PY" -c "import mooncake.engine" 2>/dev/null; then
    "$PY" -m pip install --quiet "$MOONCAKE_PKG"
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader

out="results/mooncake-gpu/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)"
"${VENV:-.venv}/bin/btb-lab" run hypotheses/mooncake-gpu.yaml --out "$out" --no-progress
cat "$out/report.md"
