"""Sweep engine: grid expansion, override merging, resume, tables, executors, CLI.

The point runner is injected (a fake that writes a manifest and a summary whose numbers
are a known function of the point's overrides), so these tests check the engine, not
the simulator.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from btb_lab.analysis.models import Summary
from btb_lab.errors import UserError, ValidationFailed
from btb_lab.results import Manifest
from btb_lab.sweep import (
    PointTask,
    build_table,
    expand_points,
    load_sweep,
    run_sweep,
)
from btb_lab.sweep.spec import TableSpec

BASE_YAML = "id: T1\nbaseline: cache_aware\n"


def fake_run(task: PointTask) -> None:
    """Writes what the runner writes: TTFT = scale × (1 for cache_aware, 0.6 for btb)."""
    scale = float(task.overrides.get("workload.time_scale", 1.0))
    model_factor = {"small": 1.0, "large": 3.0}.get(str(task.overrides.get("model")), 1.0)
    if task.overrides.get("fail"):
        raise RuntimeError("simulated failure")
    run_dir = Path(task.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    calls = run_dir.parent.parent / "calls.log"
    with calls.open("a", encoding="utf-8") as fh:
        fh.write(task.point_id + "\n")
    base = scale * model_factor
    fake_summary(
        {
            "btb": {
                "all": {"ttft_mean": 0.6 * base, "ttft_p95": 1.2 * base},
                "classes": {"HEAVY": {"ttft_mean": 2.0 * base}},
                "gpu": {"imbalance": 1.5},
            },
            "cache_aware": {
                "all": {"ttft_mean": base, "ttft_p95": 2.0 * base},
                "classes": {"HEAVY": {"ttft_mean": 4.0 * base}},
                "gpu": {"imbalance": 3.0},
            },
        }
    ).save(run_dir)
    Manifest(
        run_id="r", run_dir=str(run_dir), hypothesis_id="T1", hypothesis_file="b.yaml",
        hypothesis={}, backend="sim", variants=["cache_aware", "btb"], repeats=1,
        master_seed=task.seed or 0, runs_planned=2, started="now", complete=True,
    ).save(run_dir)  # fmt: skip


def fake_summary(variants: dict[str, dict]) -> Summary:
    """A stored summary with the given per-variant metrics (n/ok filled in)."""

    def metrics(values: dict) -> dict:
        return {"n": 1, "ok": 1, **values}

    blocks = {
        name: {
            "all": metrics(v.get("all", {})),
            "classes": {c: metrics(m) for c, m in v.get("classes", {}).items()},
            "gpu": v.get("gpu", {}),
        }
        for name, v in variants.items()
    }
    return Summary.model_validate({
        "hypothesis": "T1", "title": "t", "run_id": "r", "backend": "sim", "complete": True,
        "baseline": "cache_aware",
        "primary": {"metric": "ttft_mean", "direction": "decrease", "min_effect": 0.05},
        "verdict": {"word": "VALIDATED", "reason": "fake"}, "variants": blocks,
    })  # fmt: skip


def write_sweep(tmp_path: Path, body: str) -> Path:
    (tmp_path / "base.yaml").write_text(BASE_YAML, encoding="utf-8")
    path = tmp_path / "sweep.yaml"
    path.write_text("name: t\nbase: base.yaml\n" + body, encoding="utf-8")
    return path


def calls(sweep_dir: Path) -> list[str]:
    log = sweep_dir / "calls.log"
    return log.read_text(encoding="utf-8").split() if log.exists() else []


GRID_SWEEP = """
overrides: {workload.requests: 50}
axes:
  size:
    small: {model: small}
    large: {model: large}
grid:
  workload.time_scale: [1.0, 2.0, 4.0]
"""


# ------------------------------------------------------------------------- expansion


def test_grid_expansion_is_cartesian_in_file_order(tmp_path: Path) -> None:
    spec = load_sweep(write_sweep(tmp_path, GRID_SWEEP)).spec
    points = expand_points(spec)
    assert len(points) == 6
    assert [(p.labels["size"], p.labels["workload.time_scale"]) for p in points] == [
        ("small", "1"), ("small", "2"), ("small", "4"),
        ("large", "1"), ("large", "2"), ("large", "4"),
    ]  # fmt: skip
    assert points[4].overrides == {
        "workload.requests": 50,
        "model": "large",
        "workload.time_scale": 2.0,
    }
    assert len({p.point_id for p in points}) == 6


def test_points_list_crosses_axes_and_later_sources_win(tmp_path: Path) -> None:
    body = """
overrides: {model: common, seed: 1}
points:
  - {label: a, overrides: {model: from-point, x: 1}}
  - {label: b, overrides: {x: 2}}
axes:
  wl:
    bursted: {workload.generator.kind: bursted}
    plain: {workload.generator.kind: poisson, x: 3}
"""
    points = expand_points(load_sweep(write_sweep(tmp_path, body)).spec)
    assert [tuple(p.labels.values()) for p in points] == [
        ("a", "bursted"), ("a", "plain"), ("b", "bursted"), ("b", "plain"),
    ]  # fmt: skip
    assert points[0].overrides["model"] == "from-point"
    assert points[2].overrides["model"] == "common"
    assert points[1].overrides["x"] == 3  # the axis comes after the point
    assert points[0].overrides["x"] == 1


def test_point_ids_are_stable_and_change_with_overrides(tmp_path: Path) -> None:
    spec = load_sweep(write_sweep(tmp_path, GRID_SWEEP)).spec
    ids = [p.point_id for p in expand_points(spec)]
    assert ids == [p.point_id for p in expand_points(spec)]
    changed = load_sweep(
        write_sweep(tmp_path, GRID_SWEEP.replace("requests: 50", "requests: 60"))
    ).spec
    assert set(ids).isdisjoint(p.point_id for p in expand_points(changed))
    assert ids[0].startswith("small_1-")


# ----------------------------------------------------------------------- validation


def test_unknown_key_names_file_line_and_field(tmp_path: Path) -> None:
    path = write_sweep(tmp_path, "table:\n  metrix: [ttft_mean]\n")
    with pytest.raises(ValidationFailed) as info:
        load_sweep(path)
    (problem,) = info.value.problems
    assert problem.startswith(f"{path}:4: table.metrix:")
    assert "unknown key" in problem


def test_empty_grid_and_missing_base_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(ValidationFailed, match="has no values"):
        load_sweep(write_sweep(tmp_path, "grid: {seed: []}\n"))
    path = tmp_path / "s.yaml"
    path.write_text("name: t\nbase: nowhere.yaml\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"s\.yaml:2: base: .*nowhere\.yaml not found"):
        load_sweep(path)


# --------------------------------------------------------------------- run and table


def test_run_writes_table_with_values_and_reductions(tmp_path: Path) -> None:
    path = write_sweep(tmp_path, GRID_SWEEP + "seed: 7\n")
    out = tmp_path / "out"
    outcome = run_sweep(path, out=out, run_fn=fake_run, validate=False)
    assert sorted(outcome.ran) == sorted(p.point_id for p in outcome.points)
    df = pd.read_csv(out / "table.csv")
    assert len(df) == 6
    row = df[(df["size"] == "large") & (df["workload.time_scale"] == 4)].iloc[0]
    assert row["cache_aware ttft_mean"] == pytest.approx(12.0)
    assert row["btb ttft_mean"] == pytest.approx(7.2)
    assert row["ttft_mean reduction % (btb vs cache_aware)"] == pytest.approx(40.0)
    assert row["ttft_p95 reduction % (btb vs cache_aware)"] == pytest.approx(40.0)
    assert row["verdict"] == "VALIDATED"
    # the baseline comes first, read from the base hypothesis
    assert list(df.columns).index("cache_aware ttft_mean") < list(df.columns).index("btb ttft_mean")
    md = (out / "table.md").read_text(encoding="utf-8")
    assert "| large | 4 |" in md
    assert "+40.0%" in md
    assert (out / "plot.png").stat().st_size > 1000
    # the sweep's seed reached every point
    assert Manifest.load(next((out / "points").glob("*/summary.json")).parent).master_seed == 7


def test_table_scope_class_and_gpu_metrics() -> None:
    from btb_lab.sweep.plan import SweepPoint

    points = [SweepPoint("p1", {"x": "1"}, {}), SweepPoint("p2", {"x": "2"}, {})]
    summary = fake_summary(
        {
            "a": {"classes": {"HEAVY": {"ttft_p50": 4.0}}, "gpu": {"imbalance": 2.0}},
            "b": {"classes": {"HEAVY": {"ttft_p50": 5.0}}, "gpu": {"imbalance": 1.0}},
        }
    )
    table = TableSpec(metrics=["ttft_p50", "gpu_imbalance"], scope="HEAVY")
    df = build_table(points, {"p1": summary, "p2": None}, table, baseline="a")
    assert df.loc[0, "ttft_p50 reduction % (b vs a)"] == pytest.approx(-25.0)
    assert df.loc[0, "gpu_imbalance reduction % (b vs a)"] == pytest.approx(50.0)
    assert df.loc[1, "status"] == "failed"
    assert math.isnan(df.loc[1, "a ttft_p50"])


def test_resume_skips_finished_points_and_reruns_unfinished(tmp_path: Path) -> None:
    path = write_sweep(tmp_path, GRID_SWEEP)
    out = tmp_path / "out"
    run_sweep(path, out=out, run_fn=fake_run, validate=False)
    assert len(calls(out)) == 6
    first_csv = (out / "table.csv").read_bytes()

    again = run_sweep(path, out=out, run_fn=fake_run, validate=False)
    assert len(calls(out)) == 6  # nothing ran
    assert len(again.skipped) == 6
    assert not again.ran
    assert (out / "table.csv").read_bytes() == first_csv

    # one point interrupted: its manifest says incomplete → only it runs again
    victim = again.points[2].point_id
    manifest = out / "points" / victim / "manifest.json"
    manifest.write_text(json.dumps({"complete": False}), encoding="utf-8")
    third = run_sweep(path, out=out, run_fn=fake_run, validate=False)
    assert third.ran == [victim]
    assert calls(out)[6:] == [victim]

    # a point without point.json (crashed before it was recorded) is not finished
    (out / "points" / victim / "point.json").unlink()
    fourth = run_sweep(path, out=out, run_fn=fake_run, validate=False)
    assert fourth.ran == [victim]

    # editing the base hypothesis makes every point stale
    (tmp_path / "base.yaml").write_text(BASE_YAML + "title: changed\n", encoding="utf-8")
    fifth = run_sweep(path, out=out, run_fn=fake_run, validate=False)
    assert len(fifth.ran) == 6


def test_a_pass_stopped_in_its_points_leaves_no_old_table(tmp_path: Path) -> None:
    """A Ctrl-C while a pass ran its points left the previous pass's table.md and plots
    beside the new sweep.json, the old points' numbers read as this sweep's."""
    path = write_sweep(tmp_path, GRID_SWEEP)
    out = tmp_path / "out"
    run_sweep(path, out=out, run_fn=fake_run, validate=False)
    assert (out / "table.md").is_file()

    def stopped(task: PointTask) -> None:
        raise KeyboardInterrupt

    (tmp_path / "base.yaml").write_text(BASE_YAML + "title: changed\n", encoding="utf-8")
    with pytest.raises(KeyboardInterrupt):
        run_sweep(path, out=out, run_fn=stopped, validate=False, jobs=1)
    assert (out / "sweep.json").is_file()
    assert not [p.name for p in out.iterdir() if p.name.startswith(("table", "plot", "series"))]


def test_failed_point_is_reported_and_others_finish(tmp_path: Path) -> None:
    body = "points:\n  - {label: ok, overrides: {}}\n  - {label: bad, overrides: {fail: true}}\n"
    path = write_sweep(tmp_path, body)
    out = tmp_path / "out"
    outcome = run_sweep(path, out=out, run_fn=fake_run, validate=False)
    assert len(outcome.ran) == 1
    (bad_id,) = outcome.failed
    assert "simulated failure" in outcome.failed[bad_id]
    assert "simulated failure" in (out / "points" / bad_id / "error.txt").read_text()
    df = pd.read_csv(out / "table.csv")
    assert df.set_index("point")["status"].to_dict() == {"ok": "ok", "bad": "failed"}
    # the failed point is retried on the next invocation
    fixed = path.read_text().replace("{fail: true}", "{fail: false}")
    path.write_text(fixed, encoding="utf-8")
    assert len(run_sweep(path, out=out, run_fn=fake_run, validate=False).ran) == 1


def test_process_pool_gives_the_same_table_as_serial(tmp_path: Path) -> None:
    path = write_sweep(tmp_path, GRID_SWEEP)
    run_sweep(path, out=tmp_path / "serial", run_fn=fake_run, validate=False)
    run_sweep(path, out=tmp_path / "pool", run_fn=fake_run, validate=False, jobs=2)
    assert (tmp_path / "serial" / "table.csv").read_bytes() == (
        tmp_path / "pool" / "table.csv"
    ).read_bytes()
    assert len(calls(tmp_path / "pool")) == 6


def test_jobs_0_runs_the_first_point_alone_then_as_many_as_memory_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--jobs 0` (the CLI's default): the first point's process alone, its peak memory
    measured, then the rest in a pool as wide as the cores and the memory allow; the
    same table as one after another."""
    from btb_lab.sweep import engine

    if not hasattr(engine.os, "sched_getaffinity"):
        pytest.skip("needs os.sched_getaffinity")
    monkeypatch.setattr(engine.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    widths: list[int] = []
    run_pool = engine._run_pool

    def counted(tasks: object, run_fn: object, jobs: int, *args: object, **kw: object) -> object:
        widths.append(jobs)
        return run_pool(tasks, run_fn, jobs, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "_run_pool", counted)
    said: list[str] = []
    path = write_sweep(tmp_path, GRID_SWEEP)
    run_sweep(path, out=tmp_path / "serial", run_fn=fake_run, validate=False)
    run_sweep(path, out=tmp_path / "auto", run_fn=fake_run, validate=False, jobs=0,
              echo=said.append)  # fmt: skip
    assert (tmp_path / "serial" / "table.csv").read_bytes() == (
        tmp_path / "auto" / "table.csv"
    ).read_bytes()
    assert len(calls(tmp_path / "auto")) == 6
    assert widths[0] == 1  # the first point alone
    assert len(widths) == 2
    assert 1 <= widths[1] <= 4
    assert any(line.startswith("--jobs 0: the first point's process peaked at") for line in said)


def test_auto_jobs_is_bounded_by_cores_and_memory() -> None:
    from btb_lab.sweep.engine import auto_jobs

    gib = 2**30
    assert auto_jobs(gib // 2, 64 * gib, 8) == 8  # memory to spare: one per core
    assert auto_jobs(4 * gib, 16 * gib, 8) == 2  # 70% of 16 GiB holds two 4 GiB points
    assert auto_jobs(32 * gib, 16 * gib, 8) == 1  # never below one
    assert auto_jobs(0, 16 * gib, 8) == 8  # nothing measured (the first point failed)


def test_a_pool_worker_starts_no_point_after_one_of_its_points_was_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stopping sweep signals each worker once and the executor hands the worker the
    next queued point as soon as the interrupted one returns: that point must not run
    (it would run or wait to its end instead of stopping with the rest)."""
    from btb_lab.sweep import engine

    monkeypatch.setattr(engine, "_worker_stopped", [])
    ran: list[str] = []

    def interrupted(task: PointTask) -> None:
        ran.append(task.point_id)
        raise KeyboardInterrupt

    def runs(task: PointTask) -> None:
        ran.append(task.point_id)

    first, second = (PointTask(point_id=p, labels={}, overrides={}, base_path="b.yaml",
                               run_dir=p, seed=0) for p in ("1", "2"))  # fmt: skip
    engine._pool_point(runs, first)  # a point that finishes changes nothing
    with pytest.raises(KeyboardInterrupt):
        engine._pool_point(interrupted, first)
    with pytest.raises(KeyboardInterrupt, match="point not started"):
        engine._pool_point(runs, second)
    assert ran == ["1", "1"]


def test_ray_executor_without_ray_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray → ImportError
    path = write_sweep(tmp_path, GRID_SWEEP)
    with pytest.raises(UserError, match=r"pip install 'btb-lab\[ray\]'"):
        run_sweep(path, out=tmp_path / "o", run_fn=fake_run, validate=False, executor="ray")


# ------------------------------------------------------------------------------- CLI


def test_cli_help_and_dry_run(tmp_path: Path) -> None:
    from btb_lab.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["sweep", "--help"])
    assert result.exit_code == 0
    assert "--executor" in result.output
    assert "--jobs" in result.output
    from tests.unit.test_runner_fake import HYPOTHESIS

    path = write_sweep(
        tmp_path, GRID_SWEEP.replace("small}", "qwen3-8b}").replace("large}", "glm45}")
    )
    (tmp_path / "base.yaml").write_text(HYPOTHESIS, encoding="utf-8")  # --dry-run validates
    result = runner.invoke(app, ["sweep", str(path), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "6 points" in result.output
    assert "model=glm45" in result.output
    assert not (tmp_path / "results").exists()


def test_cli_rejects_unknown_executor(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = write_sweep(tmp_path, GRID_SWEEP)
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "btb-lab"), "sweep", str(path), "--executor", "slurm"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "--executor" in proc.stderr
    assert "local, ray" in proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------- series and Pareto


def test_pareto_front_known_answer() -> None:
    import numpy as np

    from btb_lab.sweep.series import pareto_front

    throughput = np.array([1.0, 2.0, 2.0, 3.0, 1.5])
    latency = np.array([0.5, 0.6, 0.9, 1.4, 0.7])
    # (2, 0.9) is beaten by (2, 0.6); (1.5, 0.7) by (2, 0.6)
    assert pareto_front(throughput, latency).tolist() == [True, True, False, True, False]


def test_series_plots_draw_a_line_per_variant_and_a_pareto_view_for_load(tmp_path: Path) -> None:
    from btb_lab.sweep.series import is_load_column, write_series_plots

    assert is_load_column("workload.time_scale")
    assert is_load_column("workload.generator.params.rate_per_s")
    assert not is_load_column("sim.kv_visibility")
    rows = []
    for scale, rps in ((2.0, 1.0), (1.0, 2.0), (0.5, 3.5)):
        for variant, factor in (("cache_aware", 1.0), ("btb", 0.7)):
            value = factor / scale
            rows.append({"point_id": f"p{scale}", "workload.time_scale": str(scale),
                         "variant": variant, "metric": "ttft_p90", "value": value,
                         "ci_low": 0.9 * value, "ci_high": 1.1 * value, "offered_rps": rps,
                         "achieved_rps": rps * 0.95})  # fmt: skip
    series = pd.DataFrame(rows)
    paths = write_series_plots(series, tmp_path, ["workload.time_scale"],
                               ["cache_aware", "btb"], "ttft_p90", "t")  # fmt: skip
    assert set(paths) == {"intervals", "series", "pareto"}
    assert paths["series"].stat().st_size > 1000
    assert paths["pareto"].stat().st_size > 1000
    back = pd.read_csv(paths["intervals"])
    assert len(back) == 6
    # not a load sweep: no Pareto view
    other = series.rename(columns={"workload.time_scale": "sim.kv_visibility"})
    (tmp_path / "o").mkdir()
    paths = write_series_plots(other, tmp_path / "o", ["sim.kv_visibility"],
                               ["cache_aware", "btb"], "ttft_p90", "t")  # fmt: skip
    assert "pareto" not in paths


def test_a_point_whose_cost_profile_changed_runs_again(tmp_path: Path) -> None:
    """The base's engine profile was edited (10× slower prefill): the points kept the
    old costs' numbers, "already finished", where a changed trace reruns them."""
    import hashlib

    profile = tmp_path / "profiles" / "p.yaml"
    profile.parent.mkdir()
    profile.write_text("name: p\n", encoding="utf-8")

    def with_profile(task: PointTask) -> None:
        fake_run(task)
        manifest = Manifest.load(Path(task.run_dir))
        sha = hashlib.sha256(profile.read_bytes()).hexdigest()
        facts = {"costs.profile.path": "profiles/p.yaml", "costs.profile.sha256": sha}
        manifest.fidelity = {"cache_aware": facts, "btb": facts}
        manifest.save(Path(task.run_dir))

    path = write_sweep(tmp_path, GRID_SWEEP)
    out = tmp_path / "out"
    run_sweep(path, out=out, run_fn=with_profile, validate=False)
    assert not run_sweep(path, out=out, run_fn=with_profile, validate=False).ran
    profile.write_text("name: p\nprefill: {per_token_s: 1.0e-3}\n", encoding="utf-8")
    assert len(run_sweep(path, out=out, run_fn=with_profile, validate=False).ran) == 6
    profile.unlink()  # a profile gone: nothing stands for those numbers either, so every
    # point runs again (here failing, as the fake run reads the file)
    assert len(run_sweep(path, out=out, run_fn=with_profile, validate=False).failed) == 6
