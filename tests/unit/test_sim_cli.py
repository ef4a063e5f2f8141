"""`btb-lab sim bench` and `sim costs` through typer's CliRunner."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from btb_lab.cli import app


def test_bench_json_reports_speed_and_memory() -> None:
    result = CliRunner().invoke(
        app, ["sim", "bench", "--requests", "300", "--repeats", "1", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["requests"] == 300
    assert data["policy"] == "bench_cache_aware"
    assert data["requests_per_s"] > 0
    assert data["requests_per_cpu_s"] > 0
    assert data["peak_rss_bytes"] > data["peak_traced_bytes"] > 0
    assert data["events"] >= 3 * 300  # arrival, prefill end and a finishing segment each


def test_costs_rejects_a_model_that_does_not_fit() -> None:
    result = CliRunner().invoke(
        app, ["sim", "costs", "--model", "dense1t-gqa16", "--gpu", "H100", "--gpus", "1"]
    )
    assert result.exit_code != 0
    assert "does not fit" in str(result.exception)
