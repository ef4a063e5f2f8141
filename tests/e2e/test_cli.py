"""The core CLI through typer's CliRunner: help, validate errors, run, report, log, list."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from btb_lab.cli import app
from tests.unit.test_runner_fake import HYPOTHESIS, fake_effects

__all__ = ["fake_effects"]

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_help_lists_core_commands() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("validate", "run", "report", "log", "list"):
        assert command in result.output


def test_run_help_explains_time_scale() -> None:
    result = invoke("run", "--help")
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert ">1 calmer" in text
    assert "<1 denser" in text


HEAVY_MODULES = ("numpy", "pandas", "pyarrow", "matplotlib", "scipy", "httpx", "jinja2")


@pytest.mark.parametrize(
    "argv", [["--help"], ["validate", "hypotheses/h1.yaml"], ["validate", "hypotheses/btb.yaml"]]
)
def test_help_and_validate_load_no_heavy_library(argv: list[str]) -> None:
    """`--help` and `validate` answer without numpy, pandas, pyarrow or matplotlib, which
    take longer to import than the whole command should (a fresh process, so the test
    session's own imports do not count)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys\n"
        "from btb_lab.cli import main\n"
        f"sys.argv = ['btb-lab', *{argv!r}]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_usage_error_exits_2() -> None:
    assert invoke("run", "--no-such-flag").exit_code == 2


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("    router: {policy: round_robin}", "    routr: {policy: round_robin}",
         ":23: variants.fast.routr: unknown key 'routr'"),
        ("repeats: 1", "repeats: lots", ":25: repeats: Input should be a valid integer"),
        ("policy: round_robin", "policy: round_robbin",
         ":23: variants.fast.router.policy: unknown policy 'round_robbin'; choose one of:"),
        ("  generator:\n    kind: poisson\n    params: {requests: 120, rate_per_s: 4.0}",
         "  trace:\n    path: nowhere.jsonl", ":12: workload.trace.path: trace file not found"),
        ("backend: sim", "backend: simulator", ":5: backend: Input should be 'sim' or 'cluster'"),
    ],
)  # fmt: skip
def test_validate_rejects_with_file_line_path(
    tmp_path: Path, old: str, new: str, expected: str
) -> None:
    path = tmp_path / "bad.yaml"
    assert old in HYPOTHESIS
    path.write_text(HYPOTHESIS.replace(old, new))
    result = invoke("validate", str(path))
    assert result.exit_code == 2
    assert f"{path}{expected}" in result.output
    assert "Traceback" not in result.output


def test_validate_ok_and_missing_file(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(HYPOTHESIS)
    assert invoke("validate", str(good)).exit_code == 0
    result = invoke("validate", str(good), str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2
    assert "nope.yaml: no such hypothesis file" in result.output


def test_validate_explain_lists_fields() -> None:
    result = invoke("validate", "--explain")
    assert result.exit_code == 0
    assert "workload.time_scale: Multiplies every inter-arrival gap" in result.output
    assert "verdict.min_effect:" in result.output


def test_run_report_log_list_round_trip(tmp_path: Path, monkeypatch, fake_effects) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hypotheses").mkdir()
    hyp = tmp_path / "hypotheses" / "ht.yaml"
    hyp.write_text(HYPOTHESIS)
    fake_effects["fast"] = 0.5

    dry = invoke("run", str(hyp), "--backend", "fake", "--dry-run", "--repeats", "2")
    assert dry.exit_code == 0, dry.output
    assert "runs: 4" in dry.output
    assert not (tmp_path / "results").exists()

    result = invoke("run", str(hyp), "--backend", "fake", "--no-progress")
    assert result.exit_code == 0, result.output
    assert "Verdict: VALIDATED" in result.output
    (run_dir,) = (tmp_path / "results" / "HT").iterdir()
    assert f"report: {Path('results') / 'HT' / run_dir.name / 'report.md'}" in result.output
    assert "OK=120/120" in (run_dir / "report.md").read_text()

    before = (run_dir / "report.md").read_bytes()
    rerun = invoke("report", "HT")
    assert rerun.exit_code == 0, rerun.output
    assert (run_dir / "report.md").read_bytes() == before
    assert invoke("report", "--all").exit_code == 0

    logged = invoke("log", "append", str(run_dir))
    assert logged.exit_code == 0, logged.output
    shown = invoke("log", "show")
    assert shown.exit_code == 0
    assert "HT" in shown.output
    assert "VALIDATED" in shown.output

    listed = invoke("list")
    assert listed.exit_code == 0
    assert "HT" in listed.output
    assert "VALIDATED" in listed.output


def test_report_unknown_target_exits_2(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke("report", "H404")
    assert result.exit_code == 2
    assert "neither a run directory nor a hypothesis id" in result.output


def test_run_bad_flags_exit_2(tmp_path: Path) -> None:
    hyp = tmp_path / "ht.yaml"
    hyp.write_text(HYPOTHESIS)
    result = invoke("run", str(hyp), "--variants", "nope", "--dry-run")
    assert result.exit_code == 2
    assert "--variants: unknown nope" in result.output
    assert invoke("run", str(hyp), "--time-scale", "0", "--dry-run").exit_code == 2


def test_ctrl_c_exits_130_and_report_renders(tmp_path: Path, fake_effects) -> None:
    from tests.unit.test_runner_fake import INTERRUPT

    hyp = tmp_path / "ht.yaml"
    hyp.write_text(HYPOTHESIS)
    INTERRUPT["fast"] = 10
    out = tmp_path / "run"
    result = invoke("run", str(hyp), "--backend", "fake", "--no-progress", "--out", str(out))
    assert result.exit_code == 130
    assert "interrupted: finished records kept" in result.output
    again = invoke("report", str(out))
    assert again.exit_code == 0, again.output
    assert "INCONCLUSIVE" in again.output
    assert "INCOMPLETE RUN" in (out / "report.md").read_text()
