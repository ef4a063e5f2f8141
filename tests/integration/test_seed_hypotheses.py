"""Every shipped seed hypothesis runs through the runner on the simulator (with fewer
requests) and yields the verdict these shortened runs give (pinned: the simulator is
deterministic) and the routes its variants stand for. The full-size runs' headline
numbers are pinned by tests/golden."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from btb_lab.analysis.models import Summary
from btb_lab.results import Manifest
from btb_lab.runner import RunOptions, run_hypothesis

REPO = Path(__file__).resolve().parents[2]
HYPOTHESES = REPO / "hypotheses"


@dataclass
class Ran:
    summary: Summary
    fidelity: dict[str, dict[str, Any]]  # per variant, sim.* / costs.* keys

    @property
    def variants(self) -> list[str]:
        return list(self.summary.variants)


def _run(name: str, tmp_path: Path, expect: str, requests: int = 120) -> Ran:
    outcome = run_hypothesis(
        HYPOTHESES / name,
        RunOptions(out=tmp_path / "run", requests=requests, repeats=1, progress=False),
    )
    summary = outcome.summary
    assert summary is not None
    assert summary.backend == "sim"
    assert (summary.verdict.word, name) == (expect, name), summary.verdict.reason
    assert (outcome.run_dir / "report.md").is_file()
    return Ran(summary, Manifest.load(outcome.run_dir).fidelity)


def _routes(ran: Ran, variant: str) -> dict[str, int]:
    return dict(ran.summary.variants[variant].routes)


def test_h1_kv_both_runs_without_offload(tmp_path: Path) -> None:
    s = _run("h1.yaml", tmp_path, "REJECTED")
    for v in ("plain", "kv_both"):
        assert not {"HEAVY_OFFLOAD", "PS"} & set(_routes(s, v))
    assert s.fidelity["kv_both"]["sim.connector_decode_slowdown"] == pytest.approx(0.013)
    # costs from the profile fitted to the seed's figures, said in the manifest
    for v in ("plain", "kv_both"):
        assert s.fidelity[v]["costs.profile.name"] == "seed-elastic"
        assert "TPOT90 0.0761 s" in s.fidelity[v]["costs.profile.fitted_to"]


def test_h2_prefill_service_variants_use_the_ps(tmp_path: Path) -> None:
    s = _run("h2.yaml", tmp_path, "REJECTED")
    assert "PS" not in _routes(s, "affinity")
    assert _routes(s, "ps_always").get("PS", 0) > 0
    assert _routes(s, "ps_flexd").get("PS", 0) > 0


def test_h3_offload_decode_offloads_heavy(tmp_path: Path) -> None:
    # one shortened repeat: the E2E interval reaches both sides of the 5% bar
    s = _run("h3.yaml", tmp_path, "INCONCLUSIVE")
    assert _routes(s, "offload_decode").get("HEAVY_OFFLOAD", 0) > 0
    assert "HEAVY_OFFLOAD" not in _routes(s, "affinity")


def test_h4_cache_gate_splits_heavy_into_offload_and_colo(tmp_path: Path) -> None:
    # one repeat: the GPU-imbalance interval spans tens of percent either way
    s = _run("h4.yaml", tmp_path, "INCONCLUSIVE", requests=200)
    for v in ("gate_0.3", "gate_0.5"):
        routes = _routes(s, v)
        assert routes.get("HEAVY_OFFLOAD", 0) > 0
        assert routes.get("HEAVY_COLO", 0) > 0
        # cold HEAVY turns outnumber gated ones, as the seed found (92% turn-1)
        assert routes["HEAVY_COLO"] > routes["HEAVY_OFFLOAD"]


@pytest.mark.parametrize("name", ["h5.yaml", "h6.yaml"])
def test_h5_h6_variants_both_offload(name: str, tmp_path: Path) -> None:
    # h6 on one shortened repeat: the cache-hit interval straddles the 5% bar
    s = _run(name, tmp_path, {"h5.yaml": "REJECTED", "h6.yaml": "INCONCLUSIVE"}[name])
    for variant in s.variants:
        assert _routes(s, variant).get("HEAVY_OFFLOAD", 0) > 0


def test_h6_setting_reaches_the_simulator(tmp_path: Path) -> None:
    s = _run("h6.yaml", tmp_path, "INCONCLUSIVE")
    assert s.fidelity["reusable"]["sim.transferred_kv_reusable"] is True
    assert s.fidelity["not_reusable"]["sim.transferred_kv_reusable"] is False


def test_h7_lower_overload_factor_breaks_affinity_more(tmp_path: Path) -> None:
    s = _run("h7.yaml", tmp_path, "INCONCLUSIVE")  # one repeat: a very wide interval
    broken = {v: _routes(s, v).get("BROKEN", 0) for v in s.variants}
    assert broken["of_1.0"] > broken["of_2.0"]


def test_btb_fidelity_warms_under_both_visibilities(tmp_path: Path) -> None:
    s = _run("btb-fidelity.yaml", tmp_path, "VALIDATED", requests=200)
    for v in ("btb_at_admission", "btb_after_prefill"):
        assert _routes(s, v).get("WARM_HIT", 0) > 0
    assert s.fidelity["btb_at_admission"]["sim.kv_visibility"] == "at_admission"
    assert s.fidelity["btb_after_prefill"]["sim.kv_visibility"] == "after_prefill"
