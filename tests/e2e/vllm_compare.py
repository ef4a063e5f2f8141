"""Shared by the real-vLLM tier: the tiny model's engine profile (calibrated once per test
session, before any cluster of the tier is launched) and the sim-vs-real comparison of a
cluster run against the simulator on the roofline and on that profile.

The comparisons are written under `results/test-vllm/<hypothesis>/` of the checkout, so
`make test-vllm` leaves them for the reader (the README's "How far is the simulator from a
real engine" quotes them); the tests assert only what can be asserted honestly: that the
comparison's errors are the ones the records give, never that the errors are small.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
BTB = Path(sys.executable).parent / "btb-lab"
OUT = ROOT / "results" / "test-vllm"
PROFILE = OUT / "tiny-llama-cpu.profile.yaml"
HANG_GUARD_S = 900  # only stops a hung test from blocking CI; nothing asserts on time


def btb(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(BTB), *args], cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"btb-lab {' '.join(args)}\n{proc.stdout}\n{proc.stderr}"
    return proc


def calibrate_tiny_model() -> Path:
    """Fit the tiny model's profile on one instance of cpu-smoke's cluster block."""
    OUT.mkdir(parents=True, exist_ok=True)
    btb("calibrate", str(ROOT / "hypotheses" / "cpu-smoke.yaml"), "--out", str(PROFILE))
    return PROFILE


def compare_with_simulator(cluster_run: Path, hypothesis: str, profile: Path) -> dict[str, Path]:
    """Run `hypothesis` on the simulator on the roofline and on `profile`, and compare each
    with the cluster run; returns the comparison folders by cost model."""
    stem = Path(hypothesis).stem
    root = OUT / stem
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    shutil.copytree(cluster_run, root / "cluster", ignore=shutil.ignore_patterns("instances"))
    path = str(ROOT / "hypotheses" / hypothesis)
    out: dict[str, Path] = {}
    for name, model in (("roofline", "roofline"), ("profile", None)):
        sim = root / f"sim-{name}"
        setting = "costs.model=roofline" if model else f"costs.model.profile={profile}"
        btb("run", path, "--backend", "sim", "--out", str(sim), "--no-progress", "--set", setting)
        out[name] = root / f"compare-{name}"
        btb("compare", str(root / "cluster"), str(sim), "--out", str(out[name]))
    return out


def check_errors_against_records(compare_dir: Path) -> dict[str, Any]:
    """The comparison's TTFT/E2E p50 and their relative errors are those of the records
    on both sides (recomputed here from requests.parquet), for every variant."""
    from btb_lab.results import read_records

    data = json.loads((compare_dir / "compare.json").read_text())
    assert (compare_dir / "compare.md").is_file()
    assert len(data["reference_runs"]) == len(data["model_runs"]) == 1
    reference = read_records(Path(data["reference_runs"][0]))
    model = read_records(Path(data["model_runs"][0]))
    gaps = {(g["variant"], g["metric"]): g for g in data["gaps"] if g["scope"] == "all"}
    variants = sorted(set(reference["variant"]))
    assert variants
    assert variants == sorted(set(model["variant"]))
    for variant in variants:
        for metric, end in (("ttft_p50", "first_token_s"), ("e2e_p50", "finish_s")):

            def p50(frame: Any, v: str = variant, e: str = end) -> float:
                part = frame[(frame["variant"] == v) & frame["ok"]]
                return float(np.percentile((part[e] - part["sent_s"]).to_numpy(), 50))

            want_ref, want_model = p50(reference), p50(model)
            gap = gaps[(variant, metric)]
            assert np.isclose(gap["reference"], want_ref, rtol=1e-6), (variant, metric, gap)
            assert np.isclose(gap["model"], want_model, rtol=1e-6), (variant, metric, gap)
            rel = (want_model - want_ref) / want_ref
            assert np.isclose(gap["error"], rel, rtol=1e-6, atol=1e-9), gap
    return data
