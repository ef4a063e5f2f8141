"""`btb-lab run H --backend a,b`: both runs and their comparison in one directory, which
`report` re-renders and `log append` turns into an entry carrying the agreement."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from btb_lab.cli import app
from tests.unit.test_runner_fake import fake_effects, write_hypothesis

__all__ = ["fake_effects"]


def test_crosscheck_runs_compares_reports_and_logs(tmp_path: Path, fake_effects) -> None:
    fake_effects["fast"] = 0.5
    hyp = write_hypothesis(tmp_path)
    out = tmp_path / "both"
    runner = CliRunner()
    result = runner.invoke(app, ["run", str(hyp), "--backend", "sim,fake", "--out", str(out),
                                 "--no-progress"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "[sim]" in result.output
    assert "[fake]" in result.output
    meta = json.loads((out / "crosscheck.json").read_text())
    assert meta == {"hypothesis": "HT", "runs": {"sim": "sim", "fake": "fake"},
                    "reference": "sim", "compare": "compare", "profile": None}  # fmt: skip
    for sub in ("sim/report.md", "fake/report.md", "compare/compare.md", "compare/compare.json"):
        assert (out / sub).is_file(), sub
    compare = json.loads((out / "compare" / "compare.json").read_text())
    assert (compare["reference_backend"], compare["model_backend"]) == ("sim", "fake")

    rebuilt = runner.invoke(app, ["report", str(out)])
    assert rebuilt.exit_code == 0, rebuilt.output
    assert "compare.md" in rebuilt.output

    log = tmp_path / "LOG.md"
    logged = runner.invoke(app, ["log", "append", str(out), "--log", str(log)])
    assert logged.exit_code == 0, logged.output
    text = log.read_text()
    assert "**fake vs sim**: verdicts agree " in text
    assert "Errors of fake against sim: base: TTFT50 " in text
    assert "Comparison: [" in text

    refused = runner.invoke(app, ["run", str(hyp), "--calibrate", "--out", str(tmp_path / "x")])
    assert refused.exit_code == 2
    assert "--calibrate needs --backend sim,cluster" in refused.output
