#!/usr/bin/env bash
# The real-vLLM test tier (make test-vllm): install vLLM's CPU build into the project
# environment, make the tiny local model, run the tests marked `vllm`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${VENV:-.venv}/bin/python"

bash scripts/install_vllm.sh

exec "$PY" -m pytest -q -m vllm tests/e2e "$@"
