#!/usr/bin/env bash
# The Ray tier (make test-ray): install the Ray extra, vLLM's CPU build and the tiny model,
# then run the tests marked `ray` — the sweep executor on Ray, and instances launched as
# Ray actors on a real multi-node Ray cluster that the tests start on this machine (head
# plus worker nodes) under a private folder. Whatever happens, every Ray process of that
# folder is stopped on exit; other Ray instances on the machine are left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${VENV:-.venv}/bin/python"

"$PY" -m pip install --quiet -e '.[dev,ray]'
bash scripts/install_vllm.sh

# Short: Ray's socket paths under it must stay below the 107-byte limit of a Unix socket.
tmp="$(mktemp -d /tmp/btbray-XXXXXX)"
export BTB_RAY_TEMP_DIR="$tmp/ray"
cleanup() {
    "$PY" tests/e2e/local_ray.py stop "$BTB_RAY_TEMP_DIR" || true
}
trap cleanup EXIT
if "$PY" -m pytest -q -m ray tests --basetemp "$tmp/pytest" "$@"; then
    cleanup
    rm -rf "$tmp"
else
    status=$?
    echo "test-ray: failed; instance logs, run folders and Ray's logs kept in $tmp" >&2
    exit "$status"
fi
