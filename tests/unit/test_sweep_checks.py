"""The sweep file is checked like a hypothesis file before any point runs (issue 16, item 8):
its `table:` block against the metrics and the points' variants and classes, its YAML for
duplicate keys, its size against the point limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import cli, write_small


def sweep_file(folder: Path, body: str) -> Path:
    write_small(folder)
    path = folder / "s.yaml"
    path.write_text("name: s\nbase: hs.yaml\ngrid:\n  seed: [1, 2]\n" + body, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("table", "line", "expected"),
    [
        ("table:\n  metrics: [ttft_mean, ttft_p91]\n", 6,
         "table.metrics.1: unknown metric 'ttft_p91'; choose one of: "),
        ("table:\n  plot_metric: latency\n", 6, "table.plot_metric: unknown metric 'latency'"),
        ("table:\n  variants: [base, nope]\n", 6,
         "table.variants.1: no point has a variant 'nope'; variants: base, fast"),
        ("table:\n  baseline: nope\n", 6, "table.baseline: 'nope' is not a variant of every point"),
        ("table:\n  scope: HEAVY\n", 6,
         "table.scope: unknown class 'HEAVY'; choose one of: all, LONG, SHORT"),
        ("table:\n  metrics: [ttft_mean]\n  metrics: [ttft_p95]\n", 7,
         "table.metrics: duplicate key 'metrics' (first given at line 6)"),
    ],
)  # fmt: skip
def test_a_bad_table_block_is_refused_at_its_line(
    tmp_path: Path, table: str, line: int, expected: str
) -> None:
    path = sweep_file(tmp_path, table)
    result = cli("sweep", path, "--dry-run")
    assert result.code == 2, result.output
    assert not result.traceback, result.output
    assert f"{path}:{line}: {expected}" in result.err


def test_a_bad_table_block_fails_before_any_point_runs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = sweep_file(tmp_path, "table:\n  metrics: [ttft_p91]\n")
    result = cli("sweep", path, "--out", tmp_path / "sweep")
    assert result.code == 2, result.output
    assert "unknown metric 'ttft_p91'" in result.err
    assert not (tmp_path / "sweep" / "points").exists()


def test_a_sweep_with_too_many_points_is_refused(tmp_path: Path) -> None:
    write_small(tmp_path)
    path = tmp_path / "s.yaml"
    values = ", ".join(str(i) for i in range(101))
    path.write_text(
        f"name: s\nbase: hs.yaml\ngrid:\n  seed: [{values}]\n  workload.offset: [{values}]\n",
        encoding="utf-8",
    )
    result = cli("sweep", path, "--dry-run")
    assert result.code == 2, result.output
    assert "the sweep has 10,201 points, more than the limit of 10,000" in result.err


def test_a_good_table_block_passes(tmp_path: Path) -> None:
    path = sweep_file(
        tmp_path, "table:\n  metrics: [ttft_p90, gpu_imbalance]\n  variants: [base, fast]\n"
        "  baseline: base\n  scope: LONG\n"
    )  # fmt: skip
    result = cli("sweep", path, "--dry-run")
    assert result.code == 0, result.output
    assert "2 points" in result.out


def test_a_sweep_point_is_never_the_hypothesis_newest_full_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a point with no overrides looked like a run of the file as written: `list`,
    # `report ID` and `log append ID` took it over the user's own run
    write_small(tmp_path)
    (tmp_path / "s.yaml").write_text(
        "name: s\nbase: hs.yaml\npoints:\n  - {label: as-written}\n", encoding="utf-8"
    )
    monkeypatch.chdir(tmp_path)
    assert cli("run", "hs.yaml", "--no-progress", "--out", "results/HS/mine").code == 0
    result = cli("sweep", "s.yaml", "--jobs", "1", "--seed", "99")
    assert result.code == 0, result.output
    from btb_lab.results.manifest import resolve_run_dir

    assert resolve_run_dir("HS") == Path("results/HS/mine")


@pytest.mark.parametrize(
    ("seed_line", "flags", "where"),
    [("", ["--seed", "7"], "--seed 7"), ("seed: 9\n", [], "seed: 9 at line 5")],
)
def test_a_swept_seed_and_a_sweep_seed_are_refused_together(
    tmp_path: Path, seed_line: str, flags: list[str], where: str
) -> None:
    """The sweep's seed went over every point's: rows `seed=1` and `seed=2` were the same
    run under two labels."""
    path = sweep_file(tmp_path, seed_line)
    result = cli("sweep", path, "--dry-run", *flags)
    assert result.code == 2, result.output
    assert not result.traceback, result.output
    assert (
        f"{path}:4: grid.seed: the points set their own seed, and the sweep's seed ({where}) "
        "would replace it in every point; give one or the other"
    ) in result.err
