"""Every YAML shipped in hypotheses/ and experiments/ validates against its schema.

Hypotheses go through `load_hypothesis` (schema + semantic checks); sweep files in
experiments/ through the sweep loader. experiments/workloads/ holds trace data, not
configuration, and is skipped."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from btb_lab.hypothesis import load_hypothesis

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
    try:
        sweep = importlib.import_module("btb_lab.sweep")
    except ModuleNotFoundError:
        pytest.skip("the sweep engine is not installed")
    load_sweep = getattr(sweep, "load_sweep", None)
    if load_sweep is None:
        pytest.skip("the sweep engine has no loader yet")
    assert load_sweep(path) is not None
