"""Known answers for the verdict's statistics: outcomes read off the interval, Holm's
adjustment over several variants, per-repeat agreement, pools and warmup exclusion."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from btb_lab.analysis.scopes import apply_exclusion
from btb_lab.analysis.verdict import _outcome, holm_levels
from btb_lab.config.hypothesis import Exclude, VerdictRule
from tests.unit.test_verdict import EMPTY_UTIL, judge, records


@pytest.mark.parametrize(
    ("low", "high", "outcome"),
    [
        (-0.394, -0.036, "straddles"),  # the example: most of it beyond 5%
        (-0.30, -0.06, "holds"),
        (-0.04, -0.01, "small"),
        (-0.03, 0.02, "noise"),
        (-0.20, 0.02, "straddles"),  # holds 0 and effects far beyond the bar
        (-0.02, 0.20, "noise"),  # holds 0, and nothing beyond the bar in the claimed way
        (0.01, 0.30, "reversed"),
        (float("nan"), 0.1, "undefined"),
    ],
)
def test_outcome_is_read_off_the_interval(low: float, high: float, outcome: str) -> None:
    assert _outcome(VerdictRule(metric="ttft_p90", min_effect=0.05), low, high) == outcome


def test_an_interval_straddling_the_minimum_effect_is_not_a_rejection() -> None:
    # a noisy 15% gain on 60 requests: the interval excludes 0 but reaches both sides of
    # the 5% bar, which the old rule called "smaller than the minimum effect"
    base = records("base", 1.0, n=60, seed=1)
    new = records("new", 1.0, n=60, seed=1)
    rng = np.random.default_rng(11)
    for row in new:
        row["first_token_s"] *= 0.85 * rng.lognormal(0, 0.4)
        row["finish_s"] = row["first_token_s"] + 1
    v = judge(base + new, VerdictRule(metric="ttft_mean", min_effect=0.05))
    p = v.variants["new"].primary
    assert -0.05 < p.ci_high < 0
    assert p.ci_low < -0.05
    assert p.outcome == "straddles"
    assert v.word == "INCONCLUSIVE"
    assert "straddles the 5% minimum effect" in v.reason
    assert "needs more repeats" in v.reason


def test_holm_levels_known_answer() -> None:
    # alpha 0.05: one-sided thresholds 0.025/3, 0.025/2, 0.025 in order of p
    levels = holm_levels([0.02, 0.001, 0.04], 0.95)
    assert levels[1] == pytest.approx((1 - 0.05 / 3, 0.003))
    # the second smallest fails its threshold (0.02 >= 0.0125): it and the rest are
    # judged at its level, 97.5%
    assert levels[0] == pytest.approx((0.975, 0.04))
    assert levels[2] == pytest.approx((0.975, 0.04))
    assert holm_levels([0.3], 0.95) == [(0.95, 0.3)]


def _three_variants(scale: float) -> list[dict]:
    """A baseline, two variants with no real gain and one with a marginal gain."""
    rows = records("base", 1.0, n=200, seed=1)
    for name, factor, seed in (("a", 1.0, 11), ("b", 1.02, 12), ("new", scale, 13)):
        new = records(name, 1.0, n=200, seed=1)
        rng = np.random.default_rng(seed)
        for row in new:
            row["first_token_s"] *= factor * rng.lognormal(0, 0.3)
            row["finish_s"] = row["first_token_s"] + 1
        rows += new
    return rows


def test_holm_changes_the_verdict_of_the_best_of_three() -> None:
    rows = _three_variants(0.84)
    variants = ("base", "a", "b", "new")
    plain = judge(rows, VerdictRule(metric="ttft_mean", multiplicity="none"), variants=variants)
    holm = judge(rows, VerdictRule(metric="ttft_mean"), variants=variants)
    # unadjusted, the best of three looks clears the 5% bar ...
    assert plain.word == "VALIDATED"
    assert plain.variants["new"].primary.ci_high < -0.05
    assert plain.variants["new"].primary.adjustment == "none"
    # ... Holm judges the smallest p of three at 1 - 0.05/3 and it no longer does
    p = holm.variants["new"].primary
    assert p.adjustment == "holm"
    assert p.comparisons == 3
    assert p.level == pytest.approx(1 - 0.05 / 3)
    assert p.ci_low < plain.variants["new"].primary.ci_low
    assert p.ci_high > -0.05
    assert p.p_adjusted == pytest.approx(3 * p.p_value)
    assert holm.word == "INCONCLUSIVE"
    assert "Holm-adjusted over 3 comparisons, 98.33% interval" in holm.reason


def _one_repeat_against() -> list[dict]:
    rows = records("base", 1.0, seed=1, repeats=6)
    new = records("new", 1.0, seed=1, repeats=6)
    for row in new:
        row["first_token_s"] *= (0.6, 0.6, 0.6, 1.02, 0.6, 0.6)[row["repeat"]]
        row["finish_s"] = row["first_token_s"] + 1.0
    return rows + new


def test_repeats_report_their_direction() -> None:
    v = judge(_one_repeat_against(), VerdictRule(metric="ttft_p90"))
    p = v.variants["new"].primary
    assert v.word == "VALIDATED"
    assert (p.repeats_agree, p.repeats_contradict) == (5, 1)
    assert p.repeat_changes[3] == pytest.approx(0.02)
    assert all(c == pytest.approx(-0.4) for i, c in enumerate(p.repeat_changes) if i != 3)
    assert "5 of 6 repeats agree in direction" in v.reason


def test_one_contradicting_repeat_means_not_confirmed() -> None:
    v = judge(_one_repeat_against(), VerdictRule(metric="ttft_p90", require_all_repeats=True))
    assert v.word == "INCONCLUSIVE"
    assert "not confirmed: 1 repeat points against the claimed decrease (r4 +2.0%)" in v.reason


def test_pool_restricts_the_comparison_to_one_source() -> None:
    # the gain is all in the synthetic pool; the art pool is unchanged
    base = records("base", 1.0, seed=1)
    new = records("new", 1.0, seed=1)
    for i, row in enumerate(base + new):
        row["source"] = "synthetic" if i % 300 < 150 else "art"
    for row in new:
        if row["source"] == "synthetic":
            row["first_token_s"] *= 0.5
            row["finish_s"] = row["first_token_s"] + 1
    synthetic = judge(base + new, VerdictRule(metric="ttft_mean", pool="synthetic"))
    art = judge(base + new, VerdictRule(metric="ttft_mean", pool="art"))
    assert synthetic.variants["new"].primary.change == pytest.approx(-0.5)
    assert synthetic.variants["new"].primary.pool == "synthetic"
    assert synthetic.word == "VALIDATED"
    assert "TTFTmean (synthetic pool) -50.0%" in synthetic.reason
    assert art.variants["new"].primary.change == 0
    assert art.word == "REJECTED"


def test_a_pool_no_request_is_in_is_named_with_the_pools_there_are() -> None:
    base, new = records("base", 1.0, seed=1), records("new", 0.5, seed=1)
    for i, row in enumerate(base + new):
        row["source"] = "synthetic" if i % 2 else "art"
    v = judge(base + new, VerdictRule(metric="ttft_mean", pool="synthetc"))
    assert v.word == "INCONCLUSIVE"
    assert "no request is in the pool verdict.pool names, 'synthetc'" in v.reason
    assert "pools (request sources): art, synthetic" in v.reason


def test_pool_needs_a_request_metric() -> None:
    with pytest.raises(ValueError, match="cannot be restricted to a pool"):
        VerdictRule(metric="gpu_imbalance", pool="synthetic")


def test_exclusion_drops_warmup_and_cooldown_alike_for_every_variant() -> None:
    rows = []
    for variant in ("base", "new"):
        for i in range(100):
            rows.append({"variant": variant, "repeat": 0, "request_id": f"r{i}",
                         "arrival_s": float(i), "ok": True})  # fmt: skip
    frame = pd.DataFrame(rows)
    util = pd.DataFrame({"variant": ["base"] * 4, "repeat": [0] * 4,
                         "time_s": [5.0, 10.0, 50.0, 95.0]})  # fmt: skip
    kept, kept_util, summary = apply_exclusion(frame, util, Exclude(first_s=10, last_s=9))
    assert summary is not None
    assert summary.excluded == {"base": 19, "new": 19}
    assert summary.kept == {"base": 81, "new": 81}
    assert kept["arrival_s"].min() == 10
    assert kept["arrival_s"].max() == 90
    assert list(kept_util["time_s"]) == [10.0, 50.0]
    kept, _, summary = apply_exclusion(
        frame, EMPTY_UTIL, Exclude(first_requests=5, last_requests=5)
    )
    assert summary is not None
    assert summary.kept == {"base": 90, "new": 90}
    assert apply_exclusion(frame, util, Exclude())[2] is None
