"""The verdict engine on synthetic records with known effects."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from btb_lab.analysis.bootstrap import counts_percentile
from btb_lab.analysis.intervals import paired_units
from btb_lab.analysis.metrics import gpu_stats, latency_stat
from btb_lab.analysis.verdict import evaluate_verdict
from btb_lab.config.hypothesis import VerdictRule
from btb_lab.records import derive_timings

EMPTY_UTIL = pd.DataFrame(columns=["variant", "repeat", "time_s", "instance", "device",
                                   "utilization"])  # fmt: skip


def records(
    variant: str, scale: float, *, n: int = 300, seed: int = 0, repeats: int = 1,
    fail: int = 0, klass: str | None = None, classes: tuple[str, ...] = (),
) -> list[dict]:  # fmt: skip
    """TTFTs drawn from one lognormal, multiplied by `scale` (the true effect)."""
    rng = np.random.default_rng(seed)
    rows = []
    for rep in range(repeats):
        ttft = rng.lognormal(0.0, 0.5, n) * scale
        for i in range(n):
            ok = i >= fail
            rows.append({
                "variant": variant, "repeat": rep, "request_id": f"r{i}",
                "arrival_s": 0.1 * i, "sent_s": 0.0,
                "first_token_s": ttft[i] if ok else None,
                "finish_s": ttft[i] + 1.0 if ok else None,
                "output_tokens": 11, "input_tokens": 1000, "cached_tokens": 0, "ok": ok,
                "class": klass or (classes[i % len(classes)] if classes else None),
            })  # fmt: skip
    return rows


def judge(
    rows: list[dict], rule: VerdictRule | None = None, variants=("base", "new"), seed: int = 1
) -> object:
    frame = derive_timings(pd.DataFrame(rows))
    return evaluate_verdict(
        frame, EMPTY_UTIL, rule or VerdictRule(metric="ttft_p90", min_effect=0.05),
        baseline="base", variants=list(variants), seed=seed,
    )  # fmt: skip


def unpaired(rows: list[dict]) -> list[dict]:
    """The same rows with request ids no other variant shares."""
    return [{**r, "request_id": f"{r['variant']}-{r['request_id']}"} for r in rows]


def test_clear_win_is_validated_with_numbers() -> None:
    v = judge(records("base", 1.0, seed=1) + records("new", 0.6, seed=2))
    assert v.word == "VALIDATED"
    assert v.reason.startswith("TTFT90 -")
    assert "beyond the 5% minimum effect" in v.reason
    primary = v.variants["new"].primary
    assert primary.ci_high < -0.05
    assert primary.ci_low < primary.change < primary.ci_high


def test_no_change_is_rejected_within_noise() -> None:
    # identical latencies per request: the paired interval is exactly no change
    v = judge(records("base", 1.0, seed=1) + records("new", 1.0, seed=1))
    assert v.word == "REJECTED"
    assert v.reason.endswith(
        "within noise: the interval holds no change, so no effect of the 5% minimum size is shown"
    )
    p = v.variants["new"].primary
    assert p.paired
    assert p.ci_low == 0 == p.ci_high


def test_wrong_direction_is_rejected() -> None:
    v = judge(records("base", 1.0, seed=1) + records("new", 1.6, seed=2))
    assert v.word == "REJECTED"
    assert "opposite of the claimed decrease" in v.reason


def test_increase_claim_mirrors() -> None:
    rule = VerdictRule(metric="ttft_p90", direction="increase", min_effect=0.05)
    v = judge(records("base", 1.0, seed=1) + records("new", 1.6, seed=2), rule)
    assert v.word == "VALIDATED"


def test_guard_failure_is_partial() -> None:
    rule = VerdictRule(metric="ttft_p90", min_effect=0.05,
                       guards=[{"metric": "ok_rate", "max_worse": 0.01}])  # fmt: skip
    v = judge(records("base", 1.0, seed=1) + records("new", 0.6, seed=2, fail=30), rule)
    assert v.word == "PARTIALLY VALIDATED"
    assert "OK rate worse by 10.0 pt (limit 1.0 pt)" in v.reason
    guard = v.variants["new"].guards[0]
    assert not guard.holds
    assert abs(guard.worse_by - 0.1) < 1e-9


def test_a_latency_verdict_says_when_the_variant_completes_fewer_requests() -> None:
    # 80% of the variant's requests fail: its latencies are of the 20% that finished
    rows = records("base", 1.0, seed=1) + records("new", 0.6, seed=2, fail=240)
    v = judge(rows, VerdictRule(metric="ttft_p90", min_effect=0.05, min_ok_requests=20))
    assert v.word == "VALIDATED"
    assert v.reason.endswith(
        "; note: new completed 20.0% of its requests, base 100.0%, and latencies are of "
        "successful requests only (an ok_rate guard weighs this)"
    )
    ok_guard = {"metric": "ok_rate", "max_worse": 0.01}  # the guard says it instead
    v = judge(rows, VerdictRule(metric="ttft_p90", min_effect=0.05, min_ok_requests=20,
                                guards=[ok_guard]))  # fmt: skip
    assert v.word == "PARTIALLY VALIDATED"
    assert "note:" not in v.reason
    v = judge(records("base", 1.0, seed=1) + records("new", 0.6, seed=2, fail=3))
    assert v.word == "VALIDATED"
    assert "note:" not in v.reason


def test_a_guard_without_a_value_is_inconclusive_not_failed() -> None:
    # a guard on a pool no request is in: whether it holds is unknown (it read as failed,
    # PARTIALLY VALIDATED)
    guard = {"metric": "ok_rate", "max_worse": 0.01, "pool": "nope"}
    rule = VerdictRule(metric="ttft_p90", min_effect=0.05, guards=[guard])
    rows = records("base", 1.0, seed=1) + records("new", 0.6, seed=2)
    v = judge([{**r, "source": "synthetic"} for r in rows], rule)
    assert v.word == "INCONCLUSIVE"
    assert "but a guard cannot be checked: OK rate (nope pool) undefined" in v.reason


def test_a_failed_guard_decides_beside_one_that_cannot_be_checked() -> None:
    """A guard on an empty pool made the verdict INCONCLUSIVE ("a guard cannot be
    checked: OK rate worse by 79.6 pt…") while another guard had plainly failed, which no
    further data could mend."""
    guards = [{"metric": "ok_rate", "max_worse": 0.01, "pool": "nope"},
              {"metric": "ok_rate", "max_worse": 0.01}]  # fmt: skip
    rule = VerdictRule(metric="ttft_p90", min_effect=0.05, min_ok_requests=20, guards=guards)
    rows = records("base", 1.0, seed=1) + records("new", 0.6, seed=2, fail=100)
    v = judge([{**r, "source": "synthetic"} for r in rows], rule)
    assert v.word == "PARTIALLY VALIDATED"
    assert "but guard failed: OK rate worse by" in v.reason
    assert v.reason.endswith("; cannot be checked: OK rate (nope pool) undefined")


def test_a_class_guard_reads_the_requests_the_primary_reads() -> None:
    """Classes follow cached tokens, which routing changes: the variant labels only 30 of
    the baseline's 100 HEAVY requests HEAVY, and those 30 are its slow ones. A guard on
    HEAVY read them alone (+50%) while the primary on HEAVY read all 100 (−50%): one
    verdict, the same metric on the same class, both better and worse."""
    rows = records("base", 1.0, seed=1, n=100, klass="HEAVY")
    new = records("new", 0.5, seed=1, n=100, klass="WARM")
    for row in new[:30]:  # the 30 it still labels HEAVY are 1.5x the baseline's
        row.update({"class": "HEAVY", "first_token_s": row["first_token_s"] * 3,
                    "finish_s": row["first_token_s"] * 3 + 1.0})  # fmt: skip
    guard = {"metric": "ttft_p50", "class": "HEAVY", "max_worse": 0.05}
    rule = VerdictRule.model_validate(
        {"metric": "ttft_p50", "class": "HEAVY", "min_effect": 0.05, "guards": [guard]}
    )
    v = judge(rows + new, rule)
    primary, (held,) = v.variants["new"].primary, v.variants["new"].guards
    assert primary is not None
    assert primary.change is not None
    assert primary.change < -0.2
    assert held.holds
    assert held.worse_by == pytest.approx(primary.change)
    assert v.word == "VALIDATED"


def test_guard_holding_keeps_validated() -> None:
    rule = VerdictRule(metric="ttft_p90", min_effect=0.05,
                       guards=[{"metric": "ok_rate", "max_worse": 0.01}])  # fmt: skip
    v = judge(records("base", 1.0, seed=1) + records("new", 0.6, seed=2), rule)
    assert v.word == "VALIDATED"
    assert "guards hold" in v.reason


def test_too_few_requests_is_inconclusive() -> None:
    v = judge(records("base", 1.0, n=10, seed=1) + records("new", 0.5, n=10, seed=2))
    assert v.word == "INCONCLUSIVE"
    assert "too few successful requests: 10 for new, 10 for base (need 20)" in v.reason


def test_a_class_no_request_has_is_inconclusive_for_every_kind_of_metric() -> None:
    # a trace whose rows say no turn: no request is of the class the rule judges (the
    # cache hit rate, two columns a row, once failed on the resample of no rows)
    rows = records("base", 1.0, klass="FIRST") + records("new", 0.5, seed=2, klass="FIRST")
    for metric in ("cache_hit_rate", "ttft_p90", "ok_rate"):
        for shared_ids in (True, False):
            rule = VerdictRule.model_validate({"metric": metric, "class": "NEXT"})
            v = judge(rows if shared_ids else unpaired(rows), rule)
            assert v.word == "INCONCLUSIVE", (metric, shared_ids, v.reason)
            counted = "NEXT requests sent" if metric == "ok_rate" else "successful NEXT requests"
            assert f"too few {counted}: 0 for new, 0 for base" in v.reason


def test_failed_run_is_inconclusive() -> None:
    frame = derive_timings(pd.DataFrame(records("base", 1.0) + records("new", 0.5, seed=3)))
    v = evaluate_verdict(frame, EMPTY_UTIL, VerdictRule(metric="ttft_p90"), baseline="base",
                         variants=["base", "new"], seed=0, failed=["new"])  # fmt: skip
    assert v.word == "INCONCLUSIVE"
    assert "failed" in v.reason


def test_small_effect_is_rejected_as_below_minimum() -> None:
    # a true 3% gain with many requests: the interval excludes zero but not the 20% bar
    rule = VerdictRule(metric="ttft_mean", min_effect=0.20)
    v = judge(records("base", 1.0, n=4000, seed=1) + records("new", 0.9, n=4000, seed=2), rule)
    assert v.word == "REJECTED"
    assert "smaller than the 20% minimum effect" in v.reason


def _two_classes(a: float, b: float) -> object:
    """The verdict on TTFTmean (per class A and B) where `new` scales A's TTFTs by `a` and
    B's by `b`: the same requests in both variants."""
    base = records("base", 1.0, seed=1, klass="A") + records("base", 1.0, seed=2, klass="B")
    new = records("new", a, seed=1, klass="A") + records("new", b, seed=2, klass="B")
    for i, row in enumerate(base):
        row["request_id"] = new[i]["request_id"] = f"q{i}"
    return judge(base + new, VerdictRule(metric="ttft_mean", min_effect=0.05, per_class=["A", "B"]))


def test_per_class_reversal_is_partial() -> None:
    # the whole run shows the claim (A much faster, B a little), and class B reverses
    v = _two_classes(0.3, 1.3)
    assert v.word == "PARTIALLY VALIDATED"
    assert "beyond the 5% minimum effect, but reverses for B TTFTmean +30.0%" in v.reason


def test_classes_that_split_cannot_lift_a_claim_the_run_does_not_show() -> None:
    """A faster, B slower, the whole run in between: the per-class checks (unadjusted)
    are reported, not read as a partial validation that would outrank the run's own
    answer."""
    v = _two_classes(0.4, 1.6)
    primary = v.variants["new"].primary
    assert primary is not None
    assert primary.outcome != "holds"
    assert v.word in ("REJECTED", "INCONCLUSIVE")
    assert "(per class, unadjusted: A TTFTmean -60.0%" in v.reason
    assert "B TTFTmean +60.0%" in v.reason


def test_repeats_are_resampled_and_reproducible() -> None:
    rows = records("base", 1.0, seed=1, repeats=3) + records("new", 0.6, seed=2, repeats=3)
    a, b = judge(rows), judge(rows)
    assert a.word == "VALIDATED"
    assert a.model_dump() == b.model_dump()


def test_strongest_variant_decides() -> None:
    rows = records("base", 1.0, seed=1) + records("same", 1.0, seed=2) + records("new", 0.5, seed=3)
    v = judge(rows, variants=("base", "same", "new"))
    assert v.word == "VALIDATED"
    assert "(new vs base; Holm-adjusted over 2 comparisons, 97.5% interval)" in v.reason
    assert v.variants["same"].word == "REJECTED"


def test_gpu_metric_from_utilization_samples() -> None:
    util = pd.DataFrame([
        {"variant": var, "repeat": 0, "time_s": float(t), "instance": f"C{k}", "device": "sim",
         "utilization": (0.1 + 0.6 * k if var == "base" else 0.4 + 0.05 * k) + 0.01 * (t % 3)}
        for var in ("base", "new") for t in range(60) for k in range(2)
    ])  # fmt: skip
    frame = derive_timings(pd.DataFrame(records("base", 1.0) + records("new", 1.0, seed=5)))
    v = evaluate_verdict(frame, util, VerdictRule(metric="gpu_imbalance"), baseline="base",
                         variants=["base", "new"], seed=0)  # fmt: skip
    assert v.word == "VALIDATED"
    assert v.reason.startswith("GPU imbalance -")


def test_gpu_imbalance_is_per_repeat_where_the_hot_instance_changes() -> None:
    """Repeat 1 runs C0 hot, repeat 2 C1 (a new workload each): each repeat is 3× out of
    balance. Pooled by instance name both would read 1.0×, and a balanced variant would
    look no better."""

    def level(var: str, rep: int, k: int) -> float:
        if var == "new":
            return 0.6
        return 0.9 if k == rep else 0.3

    util = pd.DataFrame([
        {"variant": var, "repeat": rep, "time_s": float(t), "instance": f"C{k}",
         "device": "sim", "utilization": level(var, rep, k) + 0.01 * (t % 3)}
        for var in ("base", "new") for rep in range(2) for t in range(60) for k in range(2)
    ])  # fmt: skip
    frame = derive_timings(
        pd.DataFrame(records("base", 1.0, repeats=2) + records("new", 1.0, seed=5, repeats=2))
    )
    gpu = gpu_stats(util[util["variant"] == "base"])  # the report's Result block
    assert gpu.imbalance == pytest.approx(0.91 / 0.31, rel=0.01)
    assert gpu.per_instance["C0/sim"] == pytest.approx(0.61)  # over both repeats
    v = evaluate_verdict(frame, util, VerdictRule(metric="gpu_imbalance", min_effect=0.05),
                         baseline="base", variants=["base", "new"], seed=0)  # fmt: skip
    assert v.word == "VALIDATED"
    primary = v.variants["new"].primary
    assert primary.change == pytest.approx(1 / (0.91 / 0.31) - 1, rel=0.02)  # about -66%
    assert primary.ci_high is not None
    assert primary.ci_high < -0.5


def test_undefined_gpu_imbalance_is_inconclusive_with_reason() -> None:
    util = pd.DataFrame([
        {"variant": var, "repeat": 0, "time_s": float(t), "instance": f"C{k}", "device": "sim",
         "utilization": 0.0 if k == 1 else 0.5}
        for var in ("base", "new") for t in range(10) for k in range(2)
    ])  # fmt: skip
    frame = derive_timings(pd.DataFrame(records("base", 1.0) + records("new", 1.0, seed=5)))
    v = evaluate_verdict(frame, util, VerdictRule(metric="gpu_imbalance"), baseline="base",
                         variants=["base", "new"], seed=0)  # fmt: skip
    assert v.word == "INCONCLUSIVE"
    assert "GPU imbalance undefined (new vs base): n/a for base, n/a for new" in v.reason
    assert "zero mean utilization" in v.reason


# ---------------------------------------------------------------------------- pairing


def test_small_slowdown_on_every_request_gives_a_tight_paired_interval() -> None:
    # H1's shape: the variant is the baseline 1.3% slower on every request. Unpaired, the
    # request-to-request spread swamps it; paired, the interval sits on +1.3%.
    rule = VerdictRule(metric="ttft_p90", direction="increase", min_effect=0.05)
    rows = records("base", 1.0, seed=1) + records("new", 1.013, seed=1)
    v = judge(rows, rule)
    p = v.variants["new"].primary
    assert p.paired
    assert 0.010 <= p.ci_low <= p.change <= p.ci_high <= 0.016
    assert v.word == "REJECTED"
    assert v.reason.endswith(
        "smaller than the 5% minimum effect (the whole interval is short of it)"
    )
    loose = judge(unpaired(rows), rule).variants["new"].primary
    assert not loose.paired
    assert loose.ci_low < 0 < loose.ci_high  # what the unpaired bootstrap made of it
    assert loose.ci_high - loose.ci_low > 10 * (p.ci_high - p.ci_low)


def test_large_gain_on_every_request_is_validated_tightly() -> None:
    v = judge(records("base", 1.0, seed=1) + records("new", 0.8, seed=1))
    p = v.variants["new"].primary
    assert v.word == "VALIDATED"
    assert p.paired
    assert -0.205 <= p.ci_low <= p.change <= p.ci_high <= -0.195
    assert "TTFT90 -20.0% [-20.0%, -20.0%]" in v.reason


def test_disjoint_request_ids_fall_back_to_unpaired() -> None:
    rows = unpaired(records("base", 1.0, seed=1) + records("new", 0.6, seed=2))
    v = judge(rows)
    p = v.variants["new"].primary
    assert v.word == "VALIDATED"
    assert not p.paired
    assert p.ci_low < p.change < p.ci_high < -0.05
    assert v.model_dump()["variants"]["new"]["primary"]["paired"] is False


def test_paired_repeats_are_resampled_too() -> None:
    # the same requests per repeat, a different true effect in each repeat: resampling
    # repeats spreads the interval over the repeats' effects; requests alone would not
    rows = records("base", 1.0, seed=1, repeats=3)
    new = records("new", 1.0, seed=1, repeats=3)
    for row in new:
        scale = (0.9, 0.7, 0.8)[row["repeat"]]
        row["first_token_s"] *= scale
        row["finish_s"] = row["first_token_s"] + 1.0
    rule = VerdictRule(metric="ttft_mean", min_effect=0.05)
    v = judge(rows + new, rule)
    p = v.variants["new"].primary
    assert p.paired
    assert abs(p.change + 0.2) < 0.02
    assert p.ci_low < -0.24
    assert p.ci_high > -0.16
    assert v.word == "VALIDATED"


def test_failed_and_missing_requests_in_paired_units() -> None:
    # the variant fails its first 30 requests and never sent the last 30
    base = records("base", 1.0, seed=1)
    new = records("new", 1.0, seed=1, fail=30)[:-30]
    frame = derive_timings(pd.DataFrame(base + new))
    b, n = paired_units(frame, "base", "new", "ttft_p90")
    assert len(b[0]) == len(n[0]) == 300
    assert np.isnan(n[0][:, 0]).sum() == 60  # 30 failed, 30 never sent
    assert not np.isnan(b[0][:, 0]).any()
    # OK rate counts the requests each variant sent: 240 of 270 for the variant
    v = judge(base + new, VerdictRule(metric="ok_rate", direction="increase", min_effect=0.05))
    p = v.variants["new"].primary
    assert p.paired
    assert p.baseline == 1.0
    assert abs(p.value - 240 / 270) < 1e-12
    assert v.word == "REJECTED"
    assert "opposite of the claimed increase" in v.reason
    # latency percentiles stay over the variant's successful requests
    v = judge(base + new)
    p = v.variants["new"].primary
    ok_ttft = np.array([r["first_token_s"] for r in new[30:]])
    assert p.value == latency_stat(ok_ttft, "p90")


def test_class_metrics_pair_on_the_baseline_class() -> None:
    # the variant relabels every request A (say, cache hits moved them); the B comparison
    # follows the requests the baseline called B, 20% faster in the variant
    base = records("base", 1.0, seed=1, classes=("A", "B"))
    new = [{**r, "class": "A"} for r in records("new", 0.8, seed=1, classes=("A", "B"))]
    rule = VerdictRule(metric="ttft_p90", min_effect=0.05, **{"class": "B"})
    v = judge(base + new, rule)
    p = v.variants["new"].primary
    assert p.paired
    assert p.scope == "B"
    b_ttft = np.array([r["first_token_s"] for r in base if r["class"] == "B"])
    assert p.baseline == latency_stat(b_ttft, "p90")
    assert abs(p.value - 0.8 * p.baseline) < 1e-12
    assert -0.205 <= p.ci_low <= p.ci_high <= -0.195
    assert p.ok_baseline == p.ok_variant == 150
    assert v.word == "VALIDATED"


def test_same_seed_same_verdict_other_seed_other_interval() -> None:
    rows = records("base", 1.0, seed=1, repeats=2) + records("new", 0.7, seed=2, repeats=2)
    a, b, c = judge(rows), judge(rows), judge(rows, seed=2)
    assert a.variants["new"].primary.paired
    assert a == b
    assert a.model_dump() == b.model_dump()
    assert a.variants["new"].primary.ci_low != c.variants["new"].primary.ci_low


def test_percentile_from_counts_matches_numpy_on_resamples() -> None:
    # the bootstrap evaluates percentiles from how often each sorted row was drawn
    rng = np.random.default_rng(7)
    column = np.sort(rng.lognormal(0, 1, 501))
    for q in (50.0, 90.0, 95.0, 99.0):
        for _ in range(20):
            rows = rng.integers(0, column.size, column.size)
            counts = np.bincount(rows, minlength=column.size)
            assert counts_percentile(column, counts, q / 100) == latency_stat(
                column[rows], f"p{q:g}"
            )
    assert np.isnan(counts_percentile(column[:4], np.zeros(4, dtype=int), 0.9))


def test_an_interrupted_variant_is_compared_on_the_requests_both_recorded() -> None:
    """A variant stopped after the workload's first requests: its latencies stand next to
    the baseline's on those requests only, not next to the baseline's whole workload (here
    the later requests are slow, as a workload's busy part is)."""
    base = records("base", 1.0, n=200, seed=1)
    for row in base[80:]:  # the part the stopped variant never reached
        row["first_token_s"] *= 10
        row["finish_s"] = row["first_token_s"] + 1.0
    new = records("new", 1.0, n=200, seed=1)[:80]
    frame = derive_timings(pd.DataFrame(base + new))
    v = evaluate_verdict(
        frame, EMPTY_UTIL, VerdictRule(metric="ttft_p90", min_effect=0.05), baseline="base",
        variants=["base", "new"], seed=1, incomplete=True,
    )  # fmt: skip
    assert v.word == "INCONCLUSIVE"
    primary = v.variants["new"].primary
    assert primary.change == 0.0  # the same latencies on the same 80 requests
    assert primary.ok_baseline == primary.ok_variant == 80
    assert (
        "on the 80 requests that arrived before the first one either lacks "
        "(new recorded 80, base 200)" in v.reason
    )
    # a complete run's comparison is not cut (a failed request is recorded, not missing)
    whole = judge(base + records("new", 1.0, n=200, seed=1))
    assert "first one either lacks" not in whole.reason
    assert whole.variants["new"].primary.ok_baseline == 200


def test_an_interrupted_variant_is_compared_on_requests_chosen_by_arrival_only() -> None:
    """A record is written when its request ends: a variant stopped while its slowest
    requests still waited holds the fast ones that arrived after them. Compared on the
    requests it recorded, it would look faster than it is; the comparison stops at the
    first arrival it lacks."""
    base = records("base", 1.0, n=200, seed=1)  # request i arrives at 0.1 i s
    new = records("new", 1.0, n=200, seed=1)
    slow = set(range(50, 80, 3))  # still waiting when the run stopped: no records
    for i in slow:
        base[i]["first_token_s"] += 20.0
        base[i]["finish_s"] += 20.0
    kept = [new[i] for i in range(80) if i not in slow]
    frame = derive_timings(pd.DataFrame(base + kept))
    v = evaluate_verdict(
        frame, EMPTY_UTIL, VerdictRule(metric="ttft_p90", min_effect=0.05), baseline="base",
        variants=["base", "new"], seed=1, incomplete=True,
    )  # fmt: skip
    primary = v.variants["new"].primary
    assert primary.ok_baseline == primary.ok_variant == 50  # the arrivals before the first gap
    assert primary.change == 0.0  # neither side's slow requests are left in
    assert f"(new recorded {len(kept)}, base 200)" in v.reason


def test_an_interrupted_variant_is_compared_on_the_gpu_time_both_covered() -> None:
    """GPU samples of a variant stopped at 20 s stand next to the baseline's first 20 s,
    not its whole run (here the baseline's load spreads evenly only later)."""

    def busy(var: str, t: int, k: int) -> float:
        if var == "base" and t > 20:
            return 0.5
        return 0.2 + 0.6 * k + 0.01 * (t % 3)

    util = pd.DataFrame([
        {"variant": var, "repeat": 0, "time_s": float(t), "instance": f"C{k}", "device": "sim",
         "utilization": busy(var, t, k)}
        for var in ("base", "new") for t in range(60 if var == "base" else 21) for k in range(2)
    ])  # fmt: skip
    frame = derive_timings(pd.DataFrame(records("base", 1.0) + records("new", 1.0)))
    v = evaluate_verdict(frame, util, VerdictRule(metric="gpu_imbalance"), baseline="base",
                         variants=["base", "new"], seed=0, incomplete=True)  # fmt: skip
    primary = v.variants["new"].primary
    assert primary.change == 0.0  # the same samples over the same 21 s
    assert "GPU samples up to the time both covered" in v.reason


def test_an_ok_rate_claim_counts_the_requests_sent_not_the_successful_ones() -> None:
    # the variant fails every request: for latencies too few successful requests, but
    # for a claim on the OK rate that is the answer (it was INCONCLUSIVE, "too few")
    rows = records("base", 1.0, seed=1) + records("new", 1.0, seed=2, fail=300)
    rule = VerdictRule(metric="ok_rate", direction="increase", min_effect=0.05)
    v = judge(rows, rule)
    assert v.word == "REJECTED"
    assert "OK rate" in v.reason
    assert "the opposite of the claimed increase" in v.reason
    latency = judge(rows, VerdictRule(metric="ttft_p90", min_effect=0.05))
    assert latency.word == "INCONCLUSIVE"
    assert latency.reason.startswith("too few successful requests: 0 for new, 300 for base")


def test_the_report_does_not_call_a_holm_family_of_one_unadjusted_by_choice() -> None:
    """One of two comparisons undefined (every request failed): Holm has one to adjust,
    and the report said "not adjusted (`verdict.multiplicity: none`)" of a file that
    says holm."""
    from types import SimpleNamespace

    from btb_lab.report.render import _statistics

    rule = VerdictRule(metric="ttft_p90", min_effect=0.05, min_ok_requests=20)
    rows = (records("base", 1.0, seed=1) + records("new", 0.6, seed=2)
            + records("dead", 1.0, seed=3, fail=300))  # fmt: skip
    verdict = judge(rows, rule, variants=("base", "new", "dead"))
    run = SimpleNamespace(hypothesis=SimpleNamespace(verdict=rule, baseline="base"),
                          summary=SimpleNamespace(verdict=verdict))  # fmt: skip
    lines = _statistics(run)  # type: ignore[arg-type]
    assert (
        "Multiplicity: 2 comparisons, 1 of them defined, so Holm's adjustment has nothing "
        "to adjust." in lines
    )
    assert not any("multiplicity: none" in line for line in lines)


def test_the_report_says_what_a_holm_adjusted_p_reads_against() -> None:
    """The p is one-sided and a step passes below α/2 (the intervals are two-sided): the
    table's "p (adjusted)" read against 0.05 let 0.03 look like a pass."""
    from types import SimpleNamespace

    from btb_lab.report.render import _statistics

    rule = VerdictRule(metric="ttft_p90", min_effect=0.05, confidence=0.9)
    rows = (records("base", 1.0, seed=1) + records("new", 0.6, seed=2)
            + records("other", 0.8, seed=3))  # fmt: skip
    verdict = judge(rows, rule, variants=("base", "new", "other"))
    assert all(v.primary.adjustment == "holm" for v in verdict.variants.values() if v.primary)
    run = SimpleNamespace(hypothesis=SimpleNamespace(verdict=rule, baseline="base"),
                          summary=SimpleNamespace(verdict=verdict))  # fmt: skip
    (line,) = [x for x in _statistics(run) if x.startswith("Multiplicity:")]  # type: ignore[arg-type]
    assert "a one-sided p passes below half of 1 − 0.9" in line
    assert "an adjusted p reads against 0.05, not 0.1" in line


def test_a_declared_class_the_verdict_is_scoped_to_is_one_comparison_row() -> None:
    """`verdict.class: A` with `per_class: [A, B]` printed A's comparison twice."""
    from types import SimpleNamespace

    from btb_lab.report.render import _comparisons

    rule = VerdictRule.model_validate(
        {"metric": "ttft_p90", "class": "A", "per_class": ["A", "B"], "min_effect": 0.05}
    )
    rows = (records("base", 1.0, seed=1, classes=("A", "B"))
            + records("new", 0.6, seed=2, classes=("A", "B")))  # fmt: skip
    verdict = judge(rows, rule)
    assert [c.scope for c in verdict.variants["new"].per_class] == ["A", "B"]
    run = SimpleNamespace(hypothesis=SimpleNamespace(verdict=rule, baseline="base"),
                          summary=SimpleNamespace(verdict=verdict))  # fmt: skip
    assert [r["scope"] for r in _comparisons(run)] == ["A", "B"]  # type: ignore[arg-type]


def test_auto_repeats_stopped_by_their_maximum_say_the_target_was_not_reached() -> None:
    from types import SimpleNamespace

    from btb_lab.config.hypothesis import AutoRepeats
    from btb_lab.report.render import _repeats_text

    rows = records("base", 1.0, seed=1, repeats=2) + records("new", 0.6, seed=2, repeats=2)
    verdict = judge(rows)
    width = verdict.variants["new"].primary.half_width

    def text(half_width: float) -> str:
        auto = AutoRepeats(min=2, max=2, half_width=half_width)
        hyp = SimpleNamespace(repeats=2, verdict=VerdictRule(metric="ttft_p90"), auto_repeats=auto)
        run = SimpleNamespace(hypothesis=hyp, summary=SimpleNamespace(repeats=2, verdict=verdict))
        return _repeats_text(run)  # type: ignore[arg-type]

    assert text(width * 2).endswith(f"is at most {width * 200:g} points)")
    assert text(width / 2).endswith(
        f"; not reached at the maximum, the widest is {width * 100:.1f} points)"
    )
