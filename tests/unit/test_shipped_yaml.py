"""Every YAML shipped in hypotheses/ and experiments/ validates against its schema.

Hypotheses go through `load_hypothesis` (schema + semantic checks); sweep files in
experiments/ through the sweep loader. experiments/workloads/ holds trace data, not
configuration, and is skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from btb_lab.hypothesis import load_hypothesis
from btb_lab.sweep import expand_points, load_sweep

ROOT = Path(__file__).resolve().parents[2]
HYPOTHESES = sorted((ROOT / "hypotheses").glob("*.y*ml"))
EXPERIMENTS = sorted(
    p for p in (ROOT / "experiments").rglob("*.y*ml") if "workloads" not in p.relative_to(
        ROOT / "experiments").parts
)  # fmt: skip


def test_the_demo_hypothesis_ships() -> None:
    assert ROOT / "hypotheses" / "btb.yaml" in HYPOTHESES


@pytest.mark.parametrize("path", HYPOTHESES, ids=lambda p: p.name)
def test_hypothesis_validates(path: Path) -> None:
    loaded = load_hypothesis(path)
    assert loaded.hypothesis.baseline in loaded.hypothesis.variants


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
def test_experiment_file_validates(path: Path) -> None:
    """The sweep file, and the base hypothesis at every one of its points."""
    loaded = load_sweep(path)
    points = expand_points(loaded.spec)
    assert points
    for point in points:
        hyp = load_hypothesis(loaded.base_path, point.overrides).hypothesis
        for name in loaded.spec.table.variants or []:
            assert name in hyp.variants, (point.point_id, name)
