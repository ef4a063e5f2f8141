"""The compiled cache and the Python one give byte-identical records on every shipped
simulator hypothesis.

tests/golden runs each hypothesis with the cache this install uses (compiled when built)
and compares a digest of its records with headlines.json; here each runs again on the
Python classes (`BTB_LAB_SIM_CACHE=python`) and must give the same digest. Without the
compiled cache both would be the Python path, so this is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from btb_lab.results import Manifest
from btb_lab.runner import RunOptions, run_hypothesis
from btb_lab.sim.cache import IMPL_ENV
from tests.golden.test_headlines import GOLDEN, records_digest, shipped_sim_hypotheses
from tests.unit.test_sim_cache_model import implementations

pytestmark = pytest.mark.skipif(
    "compiled" not in implementations(), reason="btb_lab.sim._cachec is not built"
)


@pytest.mark.parametrize("path", shipped_sim_hypotheses(), ids=lambda p: p.stem)
def test_the_python_cache_gives_the_golden_records(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))[path.stem]["records_sha256"]
    monkeypatch.setenv(IMPL_ENV, "python")
    run_dir = run_hypothesis(path, RunOptions(out=tmp_path / "run", progress=False)).run_dir
    assert Manifest.load(run_dir).versions["btb_lab.sim.cache"] == "python"
    assert records_digest(run_dir) == golden


def test_a_run_records_the_cache_it_used(tmp_path: Path) -> None:
    path = shipped_sim_hypotheses()[0]
    run_dir = run_hypothesis(path, RunOptions(out=tmp_path / "run", progress=False)).run_dir
    assert Manifest.load(run_dir).versions["btb_lab.sim.cache"] == "compiled"
