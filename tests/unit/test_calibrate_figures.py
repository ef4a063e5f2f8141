"""Profiles fitted to published figures: the scale solver's known answers, the shipped
seed-elastic profile's prefill (n / 8,333 s exactly) and its decode (the 8C baseline's
TPOT90 is the seed's 0.0761 s), the fit on a small case, and the calibration statement a
profile's provenance puts into the manifest, the report and the log entry."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from btb_lab.calibrate.figures import (
    PublishedFigures,
    fit_to_figures,
    solve_scale,
    tpot_percentile,
)
from btb_lab.config.variants import resolve_variant
from btb_lab.errors import UserError
from btb_lab.hypothesis import load_hypothesis
from btb_lab.model.costmodel import build_cost_model
from btb_lab.model.profile import DecodeFit, EngineProfile, PrefillFit, load_profile
from btb_lab.policies.base import build_policy
from btb_lab.records import RequestRecord
from btb_lab.report.log import append_entry
from btb_lab.runner import RunOptions, derive_seed, run_hypothesis
from btb_lab.sim.backend import run_replay
from btb_lab.workload.loader import load_requests
from tests.unit.test_runner_fake import HYPOTHESIS

ROOT = Path(__file__).resolve().parents[2]
SEED_PROFILE = ROOT / "hypotheses" / "profiles" / "seed-elastic.yaml"
ELASTIC = [ROOT / "hypotheses" / f"h{i}.yaml" for i in range(1, 8)]
SEED_TPOT90_S = 0.0761
# TPOT90 is a percentile of discrete events: it steps as the decode scale moves, and the
# bisection stops where it steps over the figure (+0.12% for the shipped fit)
TPOT_REL_TOL = 2e-3


def test_solve_scale_finds_a_linear_root() -> None:
    scale, value, tried = solve_scale(lambda s: 0.01 + 0.002 * s, 0.0761, rel_tol=1e-6)
    assert scale == pytest.approx(33.05, rel=1e-5)
    assert value == pytest.approx(0.0761, rel=1e-6)
    assert tried[0] == (1.0, pytest.approx(0.012))


def test_solve_scale_stops_at_a_step_over_the_target() -> None:
    # a step function never meets the target: the solver returns the side nearer to it
    scale, value, _ = solve_scale(lambda s: 1.0 if s < 5.0 else 3.0, 2.5)
    assert scale == pytest.approx(5.0, rel=1e-9)
    assert value == 3.0


def test_solve_scale_refuses_a_target_below_the_start() -> None:
    with pytest.raises(UserError, match="below the value at scale 1"):
        solve_scale(lambda s: 0.01 * s, 0.001)


def test_the_seed_profile_prefills_at_8333_uncached_tokens_per_second() -> None:
    profile, _ = load_profile(SEED_PROFILE)
    for n in (1, 512, 8333, 40_000, 100_000):
        assert math.isclose(profile.prefill_s(n), n / 8333, rel_tol=1e-15, abs_tol=0.0)
        # the seed's cost model: cached tokens are free, `(input - cached) / 8333`
        assert profile.prefill_s(n, cached_tokens=30_000) == profile.prefill_s(n)
    assert profile.fitted_to is not None
    assert "8,333" in profile.fitted_to
    assert "TPOT90 0.0761 s" in profile.fitted_to
    assert profile.decode.per_seq_s == 0.0
    # the decode step is the roofline's shape, scaled: one figure fixes one number
    roof = profile.measured_on["roofline"]
    scale = profile.measured_on["decode_scale"]
    assert profile.decode.fixed_s == pytest.approx(roof["decode_step_s"] * scale, rel=1e-12)
    assert profile.decode.per_context_token_s == pytest.approx(
        roof["decode_context_token_s"] * scale, rel=1e-12
    )


def _baseline_records(path: Path, variant: str, repeats: range) -> list[RequestRecord]:
    """The variant's runs as `btb-lab run` makes them, with the file's own cost model."""
    loaded = load_hypothesis(path)
    hyp = loaded.hypothesis
    resolved = resolve_variant(hyp, variant)
    costs = build_cost_model(resolved, loaded.base_dir)
    router = hyp.variants[variant].router
    records: list[RequestRecord] = []
    for r in repeats:
        requests = load_requests(resolved.workload, base_dir=loaded.base_dir,
                                 seed=derive_seed(hyp.seed, "workload", r))  # fmt: skip
        seed = derive_seed(hyp.seed, "variant", r, variant)
        run_replay(costs, resolved.sim,
                   lambda seed=seed: build_policy(router.policy, router.params, seed=seed),
                   requests, records.append, variant=variant, repeat=r)  # fmt: skip
    return records


@pytest.mark.parametrize(("name", "variant"), [("h7", "of_2.0"), ("h3", "affinity")])
def test_the_seed_profile_gives_the_8c_baseline_the_seeds_tpot90(name: str, variant: str) -> None:
    """H7's of_2.0 is the run the profile was fitted on; H3's affinity is the same 8C plain
    reference in another file (same workloads, same policy), so it must agree."""
    records = _baseline_records(ROOT / "hypotheses" / f"{name}.yaml", variant, range(20))
    got = tpot_percentile(records, 90)
    assert got == pytest.approx(SEED_TPOT90_S, rel=TPOT_REL_TOL)
    profile, _ = load_profile(SEED_PROFILE)
    assert got == pytest.approx(profile.measured_on["fit"]["tpot90_fitted_s"], rel=1e-12)


@pytest.mark.parametrize("path", ELASTIC, ids=lambda p: p.stem)
def test_every_elastic_prefill_hypothesis_uses_the_seed_profile(path: Path) -> None:
    loaded = load_hypothesis(path)
    for variant in loaded.hypothesis.variants:
        costs = build_cost_model(resolve_variant(loaded.hypothesis, variant), loaded.base_dir)
        facts = costs.facts()
        assert facts["costs.model"] == "profile"
        assert facts["costs.profile.name"] == "seed-elastic"
        assert [c.split(":")[0] for c in facts["costs.calibrated"]] == ["prefill", "decode step"]
        assert facts["costs.not_calibrated"][0].startswith("KV transfer between instances")


def test_fit_to_figures_on_a_small_case() -> None:
    figures = PublishedFigures(prefill_tokens_per_s=10_000.0, tpot_s=0.03, source="test figures",
                               baseline="a test run", checks={"ttft_p50": 1.0})  # fmt: skip
    fit = fit_to_figures(ROOT / "hypotheses" / "h7.yaml", "of_2.0", figures, name="small",
                         fit_repeats=2, holdout_repeats=1, rel_tol=1e-3)  # fmt: skip
    p = fit.profile
    assert p.prefill.per_token_s == 1e-4
    # 400 requests: the percentile steps coarsely; the fit is the step nearest the figure
    assert fit.tpot_fit_s == pytest.approx(0.03, rel=5e-3)
    assert abs(fit.tpot_fit_s - 0.03) == min(abs(v - 0.03) for _, v in fit.evaluations)
    assert fit.tpot_holdout_s is not None
    assert fit.decode_scale > 1.0
    assert fit.evaluations[-1][0] == fit.decode_scale or any(
        s == fit.decode_scale for s, _ in fit.evaluations
    )
    assert p.fitted_to == (
        "test figures: prefill 10,000 uncached tokens/s; TPOT90 0.03 s of a test run"
    )
    assert p.decode.quality is not None
    assert p.decode.quality.mape == pytest.approx(abs(fit.tpot_fit_s - 0.03) / 0.03)
    assert p.measured_on["fit"]["workloads"] == "0–1"
    assert p.measured_on["holdout"]["workloads"] == "2–2"
    assert set(p.measured_on["not_fitted"]) == {"ttft_p50"}
    with pytest.raises(UserError, match="unknown variant"):
        fit_to_figures(ROOT / "hypotheses" / "h7.yaml", "nope", figures, name="x")


def _run_with_profile(tmp_path: Path, profile: EngineProfile | None) -> Path:
    text = HYPOTHESIS
    if profile is not None:
        profile.save(tmp_path / "p.yaml")
        text = text.replace("repeats: 1", "repeats: 1\ncosts:\n  model: {profile: p.yaml}")
    path = tmp_path / "h.yaml"
    path.write_text(text)
    return run_hypothesis(path, RunOptions(out=tmp_path / "run", progress=False)).run_dir


def test_the_log_entry_says_what_is_calibrated_and_to_what(tmp_path: Path) -> None:
    profile = EngineProfile(
        name="figs",
        fitted_to="a paper's figures: prefill 5,000 tokens/s; TPOT90 0.05 s",
        prefill=PrefillFit(fixed_s=0.0, per_token_s=2e-4, fitted_to="a paper's prefill rate"),
        decode=DecodeFit(fixed_s=0.01, fitted_to="a paper's TPOT90"),
    )
    run_dir = _run_with_profile(tmp_path, profile)
    log = tmp_path / "LOG.md"
    append_entry(run_dir, log)
    text = log.read_text()
    (line,) = [t for t in text.splitlines() if t.startswith("- Calibration: ")]
    assert "prefill: profile `figs`, fitted to a paper's prefill rate" in line
    assert "decode step: profile `figs`, fitted to a paper's TPOT90" in line
    assert "Not calibrated (presets): KV transfer between instances" in line
    assert "TTFT under queueing" in line
    assert "costs.profile.fitted_to=a paper's figures" in text  # the fidelity line
    assert line in (run_dir / "report.md").read_text()


def test_a_roofline_entry_says_nothing_is_calibrated(tmp_path: Path) -> None:
    run_dir = _run_with_profile(tmp_path, None)
    log = tmp_path / "LOG.md"
    append_entry(run_dir, log)
    (line,) = [t for t in log.read_text().splitlines() if t.startswith("- Calibration: ")]
    assert line.startswith("- Calibration: no cost is calibrated")
    assert "prefill: roofline" in line
