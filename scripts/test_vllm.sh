#!/usr/bin/env bash
# The real-vLLM test tier (make test-vllm): install vLLM's CPU build and NIXL into the
# project environment, make the tiny local model, run the tests marked `vllm`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${VENV:-.venv}/bin/python"

bash scripts/install_vllm.sh

# A private temp folder: pytest's shared default (/tmp/pytest-of-$USER) keeps only its three
# newest runs, so a test run elsewhere on the machine would delete the live instance logs
# and KV folders of this one.
tmp="$(mktemp -d -t btb-vllm-tests-XXXXXX)"
if "$PY" -m pytest -q -m vllm tests/e2e --basetemp "$tmp" "$@"; then
    rm -rf "$tmp"
else
    status=$?
    echo "test-vllm: failed; instance logs and run folders kept in $tmp" >&2
    exit "$status"
fi
