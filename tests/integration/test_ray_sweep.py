"""The Ray executor on a local Ray instance gives the same sweep table as a process pool.

Marked `ray` and run by `make test-ray` (`pytest -m ray`, which installs the extra).
Starting Ray takes several seconds on a small machine, so the default markers (pyproject)
leave it out of plain `make test`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from btb_lab.sweep import run_sweep

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]


def test_ray_table_equals_process_pool_table(tmp_path: Path) -> None:
    sweep = tmp_path / "tiny.yaml"
    sweep.write_text(
        f"""
name: tiny
base: {REPO / "hypotheses" / "btb.yaml"}
overrides:
  repeats: 1
  workload.generator.params.windows: 1
  workload.generator.params.burst_size: 24
  workload.generator.params.background_rate_per_s: 0.2
grid:
  variants.btb.router.params.replicas: [2, 4]
seed: 3
""",
        encoding="utf-8",
    )
    local = run_sweep(sweep, jobs=2, out=tmp_path / "local")
    ray_run = run_sweep(sweep, executor="ray", out=tmp_path / "ray")
    assert not local.failed
    assert not ray_run.failed
    assert sorted(ray_run.ran) == sorted(p.point_id for p in ray_run.points)
    # results came back into the driver's sweep directory, one run directory per point
    for point in ray_run.points:
        run_dir = tmp_path / "ray" / "points" / point.point_id
        assert (run_dir / "summary.json").is_file()
        assert (run_dir / "requests.parquet").is_file()
    local_csv = (tmp_path / "local" / "table.csv").read_text(encoding="utf-8")
    assert (tmp_path / "ray" / "table.csv").read_text(encoding="utf-8") == local_csv
    assert local_csv.count("\n") == 3  # header + two points
    # and the numbers are real runs: every point has both variants' TTFT and a verdict
    import pandas as pd

    df = pd.read_csv(tmp_path / "ray" / "table.csv")
    assert (df["status"] == "ok").all()
    assert df[["cache_aware ttft_mean", "btb ttft_mean"]].gt(0).all().all()
    assert set(df["verdict"]) <= {"VALIDATED", "PARTIALLY VALIDATED", "REJECTED", "INCONCLUSIVE"}
