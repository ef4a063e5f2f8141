"""Real KV handoff through vLLM's ExampleConnector (make test-vllm), end to end through
`btb-lab run`, and an interrupted run: cpu-h6 with `kv_connector.type: example` launches
two vLLM CPU instances sharing a fresh KV folder; the migrated session's first turn is
prefilled on C0, its KV goes through files to C1, whose next turn hits it locally; then
SIGINT mid-run keeps the finished records, and no server and no KV folder is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_vllm_cluster import BTB, HANG_GUARD_S, MODEL, ROOT, vllm_pids

pytestmark = pytest.mark.vllm


def rows_of(path: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        row["extra"] = json.loads(row["extra"]) if row.get("extra") else {}
    return rows


def test_example_connector_hands_kv_over_and_sigint_cleans_up(tmp_path: Path) -> None:
    if not MODEL.is_dir():
        pytest.fail(f"{MODEL} is missing: run `btb-lab model make-tiny {MODEL}` first")
    before = vllm_pids()
    storage = tmp_path / "kv"
    storage.mkdir()
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            str(BTB), "run", str(ROOT / "hypotheses" / "cpu-h6.yaml"), "--out", str(out),
            "--no-progress", "--variants", "migrated", "--set", "baseline=migrated",
            "--set", "cluster.kv_connector.type=example",
            "--set", f"cluster.kv_connector.shared_storage_path={storage}",
        ],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    rows: list[dict[str, Any]] = []
    kv_files: list[Path] = []
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline and proc.poll() is None:
        parts = sorted((out / "parts").glob("requests-migrated-*.jsonl")) if out.exists() else []
        if parts:
            rows = rows_of(parts[0])
            if any(r["request_id"] == "w0-s-t2" for r in rows):
                kv_files = list(storage.glob("btb-kv-*/*/*.safetensors"))
                break
        time.sleep(0.5)
    assert rows, "the migrated variant never wrote records"
    os.kill(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode != 0, output

    by_id = {r["request_id"]: r for r in rows}
    first, second = by_id["w0-s-t1"], by_id["w0-s-t2"]
    assert first["ok"], first
    assert (first["prefill_instance"], first["instance"]) == ("C0", "C1")
    # the consumer loaded the prompt's full blocks but the one holding its last token
    assert first["extra"]["kv_transferred_tokens"] == 1152
    assert first["prefill_s"] > 0
    assert second["ok"], second
    assert (second["instance"], second["prefill_instance"]) == ("C1", None)
    assert second["cached_tokens"] == 1216  # the handed-over KV is in C1's prefix cache
    assert kv_files, "no KV files went through the shared folder"

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False
    assert vllm_pids() - before == set()
    assert list(storage.iterdir()) == []  # the connector's folder went with the servers
