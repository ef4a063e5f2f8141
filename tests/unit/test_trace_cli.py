"""`btb-lab trace` commands through typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from btb_lab.cli import app
from btb_lab.workload.formats import load_trace
from tests.helpers import cli

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "workload"
runner = CliRunner()


def test_help_mentions_time_scale_semantics() -> None:
    for command in ("generate", "inspect", "audit", "convert", "fetch"):
        result = runner.invoke(app, ["trace", command, "--help"], terminal_width=200)
        assert result.exit_code == 0
        assert "multiplies every inter-arrival gap" in " ".join(result.output.split())


def test_generate_then_audit_and_inspect(tmp_path: Path) -> None:
    out = tmp_path / "b.jsonl"
    args = ["trace", "generate", "bursted", "-o", str(out), "--seed", "4",
            "-p", "windows=2", "-p", "burst_size=30", "-p", "prefix_tokens=8192",
            "-p", "background_rate_per_s=0.2"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    trace = load_trace(out, "bursted-art")
    assert len({r.trace_id for r in trace.requests}) == 2
    again = tmp_path / "again.jsonl"
    runner.invoke(app, [*args[:4], str(again), *args[5:]])
    assert again.read_bytes() == out.read_bytes()  # same seed, same file

    audit = runner.invoke(app, ["trace", "audit", str(out), "--json"])
    assert audit.exit_code == 0, audit.output
    report = json.loads(audit.output)
    assert report["format"] == "bursted-art"
    assert report["deep"]["max_fanout"] == 30

    inspect = runner.invoke(app, ["trace", "inspect", str(out), "--json"])
    summary = json.loads(inspect.output)
    assert summary["rows"] == len(trace.requests)
    assert summary["windows"] == 2
    assert summary["per_source"] == {"synthetic": len(trace.requests)}
    assert 0.5 < summary["block_reuse_ratio"] < 1.0

    table = runner.invoke(app, ["trace", "inspect", str(out)], terminal_width=120)
    assert table.exit_code == 0
    assert "block reuse ratio" in table.output


def test_inspect_time_scale_and_skip_bad_rows() -> None:
    path = str(FIXTURES / "mooncake_small.jsonl")
    plain = json.loads(runner.invoke(app, ["trace", "inspect", path, "--json"]).output)
    slow = json.loads(
        runner.invoke(app, ["trace", "inspect", path, "--json", "--time-scale", "10"]).output
    )
    assert slow["span_s"] == pytest.approx(10 * plain["span_s"])
    bad = str(FIXTURES / "mooncake_bad.jsonl")
    result = runner.invoke(app, ["trace", "inspect", bad, "--json", "--skip-bad-rows"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["skipped_rows"] == 5
    assert "skipped 5 malformed rows" in result.stderr


def test_user_errors_exit_2_without_traceback(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = str(FIXTURES / "mooncake_bad.jsonl")
    cmd = [sys.executable, "-c", "from btb_lab.cli import main; main()"]
    proc = subprocess.run([*cmd, "trace", "audit", bad], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {bad}:3: field 'input_length': must be ≥ 0"
    proc = subprocess.run(
        [*cmd, "trace", "generate", "agentic", "-p", "sesions=3", "-o", str(tmp_path / "a")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "generator 'agentic' param 'sesions'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", ["audit", "inspect"])
def test_a_time_scale_that_overflows_is_refused(command: str) -> None:
    # audit looped for ever on the infinite arrivals; inspect printed `span inf s`
    path = str(FIXTURES / "mooncake_small.jsonl")
    result = cli("trace", command, path, "--time-scale", "1e308")
    assert result.code == 2, result.output
    assert "--time-scale 1e+308: arrival times overflow to infinity" in result.output


@pytest.mark.parametrize(
    ("kind", "params"),
    [("poisson", ["requests=5", "rate_per_s=1e-320"]),
     ("agentic", ["sessions=3", "session_rate_per_s=1e-320"])],
)  # fmt: skip
def test_generate_refuses_arrivals_that_are_not_finite(
    tmp_path: Path, kind: str, params: list[str]
) -> None:
    # it wrote Infinity / NaN arrivals that no loader then accepted
    out = tmp_path / "g.jsonl"
    args = ["trace", "generate", kind, "-o", str(out)]
    for p in params:
        args += ["-p", p]
    result = cli(*args)
    assert result.code == 2, result.output
    assert f"{kind} arrival times are not finite numbers" in result.output
    assert not out.exists()


def test_inspect_counts_sessions_per_window() -> None:
    """Session `s1` in two windows is two sessions, as replay and the turn checks key them
    (inspect said 1)."""
    from btb_lab.records import Request
    from btb_lab.workload.summary import trace_summary

    requests = [
        Request(f"{w}{t}", float(t), 512, 1, (1,), 512, trace_id=w, session_id="s1", turn=t)
        for w in ("w1", "w2")
        for t in (1, 2)
    ]
    summary = trace_summary(requests)
    assert summary["sessions"] == 2
    assert summary["windows"] == 2
