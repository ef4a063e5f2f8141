"""Every shipped seed hypothesis runs through the runner on the simulator (with fewer
requests) and yields a verdict with a reason and the routes its variants stand for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from btb_lab.runner import RunOptions, run_hypothesis

REPO = Path(__file__).resolve().parents[2]
HYPOTHESES = REPO / "hypotheses"
WORDS = {"VALIDATED", "PARTIALLY VALIDATED", "REJECTED", "INCONCLUSIVE"}


def _run(name: str, tmp_path: Path, requests: int = 120) -> dict[str, Any]:
    outcome = run_hypothesis(
        HYPOTHESES / name,
        RunOptions(out=tmp_path / "run", requests=requests, repeats=1, progress=False),
    )
    summary = outcome.summary
    assert summary["backend"] == "sim"
    assert summary["verdict"]["word"] in WORDS
    assert len(summary["verdict"]["reason"]) > 10
    assert (outcome.run_dir / "report.md").is_file()
    manifest = json.loads((outcome.run_dir / "manifest.json").read_text(encoding="utf-8"))
    summary["_fidelity"] = manifest["fidelity"]  # per variant, sim.* keys
    return summary


def _routes(summary: dict[str, Any], variant: str) -> dict[str, int]:
    return dict(summary["variants"][variant]["routes"])


def test_h1_kv_both_runs_without_offload(tmp_path: Path) -> None:
    s = _run("h1.yaml", tmp_path)
    for v in ("plain", "kv_both"):
        assert not {"HEAVY_OFFLOAD", "PS"} & set(_routes(s, v))
    assert s["_fidelity"]["kv_both"]["sim.connector_decode_slowdown"] == pytest.approx(0.013)


def test_h2_prefill_service_variants_use_the_ps(tmp_path: Path) -> None:
    s = _run("h2.yaml", tmp_path)
    assert "PS" not in _routes(s, "affinity")
    assert _routes(s, "ps_always").get("PS", 0) > 0
    assert _routes(s, "ps_flexd").get("PS", 0) > 0


def test_h3_offload_decode_offloads_heavy(tmp_path: Path) -> None:
    s = _run("h3.yaml", tmp_path)
    assert _routes(s, "offload_decode").get("HEAVY_OFFLOAD", 0) > 0
    assert "HEAVY_OFFLOAD" not in _routes(s, "affinity")


def test_h4_cache_gate_splits_heavy_into_offload_and_colo(tmp_path: Path) -> None:
    s = _run("h4.yaml", tmp_path, requests=200)
    for v in ("gate_0.3", "gate_0.5"):
        routes = _routes(s, v)
        assert routes.get("HEAVY_OFFLOAD", 0) > 0
        assert routes.get("HEAVY_COLO", 0) > 0
        # cold HEAVY turns outnumber gated ones, as the seed found (92% turn-1)
        assert routes["HEAVY_COLO"] > routes["HEAVY_OFFLOAD"]


@pytest.mark.parametrize("name", ["h5.yaml", "h6.yaml"])
def test_h5_h6_variants_both_offload(name: str, tmp_path: Path) -> None:
    s = _run(name, tmp_path)
    for variant in s["variants"]:
        assert _routes(s, variant).get("HEAVY_OFFLOAD", 0) > 0


def test_h6_setting_reaches_the_simulator(tmp_path: Path) -> None:
    s = _run("h6.yaml", tmp_path)
    assert s["_fidelity"]["reusable"]["sim.transferred_kv_reusable"] is True
    assert s["_fidelity"]["not_reusable"]["sim.transferred_kv_reusable"] is False


def test_h7_lower_overload_factor_breaks_affinity_more(tmp_path: Path) -> None:
    s = _run("h7.yaml", tmp_path)
    broken = {v: _routes(s, v).get("BROKEN", 0) for v in s["variants"]}
    assert broken["of_1.0"] > broken["of_2.0"]


def test_btb_fidelity_warms_under_both_visibilities(tmp_path: Path) -> None:
    s = _run("btb-fidelity.yaml", tmp_path, requests=200)
    for v in ("btb_at_admission", "btb_after_prefill"):
        assert _routes(s, v).get("WARM_HIT", 0) > 0
    assert s["_fidelity"]["btb_at_admission"]["sim.kv_visibility"] == "at_admission"
    assert s["_fidelity"]["btb_after_prefill"]["sim.kv_visibility"] == "after_prefill"
