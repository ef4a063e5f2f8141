#!/usr/bin/env bash
# Run the GPU KV-transfer hypothesis once per connector on a GPU machine and print each
# report: Mooncake (MooncakeConnector) and NIXL (vLLM's NixlConnector, KV staged in GPU
# memory: kv_buffer_device cuda). Installs vLLM, the Mooncake transfer engine and NIXL into
# the project environment first.
#   BTB_GPU_MODEL=Qwen/Qwen2.5-0.5B-Instruct scripts/gpu_check.sh   (or a local model folder)
#   CONNECTORS="nixl" scripts/gpu_check.sh                          (one of them only)
# MOONCAKE_PKG picks the transfer-engine wheel: mooncake-transfer-engine-cuda13 for vLLM's
# default CUDA 13 build, mooncake-transfer-engine for CUDA 12. NIXL_PKG likewise: `nixl`
# (its meta package loads the build matching torch's CUDA), or nixl-cu12 / nixl-cu13.
# UCX picks its own transports on a GPU host (cuda_copy, cuda_ipc, rc, tcp); set UCX_TLS to
# narrow them (it is passed through to the instances).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${VENV:-.venv}/bin/python"
: "${BTB_GPU_MODEL:?set BTB_GPU_MODEL to a small public model name or local path}"
export BTB_GPU_MODEL
MOONCAKE_PKG="${MOONCAKE_PKG:-mooncake-transfer-engine-cuda13}"
NIXL_PKG="${NIXL_PKG:-nixl}"
CONNECTORS="${CONNECTORS:-mooncake nixl}"

if ! "$PY" -c "import vllm" 2>/dev/null; then
    "$PY" -m pip install --quiet vllm
fi
for connector in $CONNECTORS; do
    case "$connector" in
        mooncake)
            "$PY" -c "import mooncake.engine" 2>/dev/null || "$PY" -m pip install --quiet "$MOONCAKE_PKG" ;;
        nixl)
            "$PY" -c "import nixl._api" 2>/dev/null || "$PY" -m pip install --quiet "$NIXL_PKG" ;;
        *)
            echo "gpu_check: unknown connector $connector (mooncake, nixl)" >&2; exit 2 ;;
    esac
done
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader

stamp="$(date -u +%Y%m%dT%H%M%SZ)"
status=0
for connector in $CONNECTORS; do
    out="results/mooncake-gpu/gpu-check-${stamp}-${connector}"
    echo "== connector ${connector}: ${out}"
    # The same hypothesis and workload; only the connector moving the offloaded KV differs.
    if "${VENV:-.venv}/bin/btb-lab" run hypotheses/mooncake-gpu.yaml --out "$out" --no-progress \
        --set "cluster.kv_connector.type=${connector}"; then
        cat "$out/report.md"
    else
        echo "gpu_check: the ${connector} run failed; instance logs in ${out}/instances" >&2
        status=1
    fi
done
exit "$status"
