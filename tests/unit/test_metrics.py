"""Metric formulas against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from btb_lab.analysis.metrics import (
    cache_stats,
    gpu_stats,
    request_metrics,
    summarize_variants,
)
from btb_lab.analysis.models import RequestMetrics
from btb_lab.config.metrics import LATENCIES, LATENCY_STATS, METRICS, REQUEST_METRIC_NAMES
from btb_lab.records import derive_timings

EMPTY_UTIL = pd.DataFrame(
    columns=["variant", "repeat", "time_s", "instance", "device", "utilization"]
)


def frame(rows: list[dict]) -> pd.DataFrame:
    base = {"variant": "v", "repeat": 0, "cached_tokens": 0, "input_tokens": 100, "ok": True,
            "cache_tier": None, "route": "COLO", "class": None}  # fmt: skip
    return pd.DataFrame([{**base, **r} for r in rows])


def test_ttft_e2e_tpot_definitions() -> None:
    f = derive_timings(frame([
        # sent 10, first token 10.5, finish 12.5, 5 tokens -> TPOT (2.5-0.5)/4 = 0.5
        {"sent_s": 10.0, "first_token_s": 10.5, "finish_s": 12.5, "output_tokens": 5},
        # one output token: TPOT undefined
        {"sent_s": 0.0, "first_token_s": 1.0, "finish_s": 1.0, "output_tokens": 1},
        # failed: no timings at all
        {"sent_s": 0.0, "first_token_s": None, "finish_s": None, "output_tokens": 9, "ok": False},
    ]))  # fmt: skip
    assert f["ttft_s"].tolist()[:2] == [0.5, 1.0]
    assert f["e2e_s"].tolist()[:2] == [2.5, 1.0]
    assert f["tpot_s"].iloc[0] == pytest.approx(0.5)
    assert math.isnan(f["tpot_s"].iloc[1])
    assert f.iloc[2][["ttft_s", "e2e_s", "tpot_s"]].isna().all()


def test_derived_timings_of_a_stored_frame_keep_its_columns_and_leave_it_as_it_was() -> None:
    """`requests.parquet` already holds the derived columns: they are computed again in
    their places, and the frame the analysis read stays unchanged."""
    stored = derive_timings(frame([
        {"sent_s": 1.0, "first_token_s": 1.5, "finish_s": 3.5, "output_tokens": 5},
        {"sent_s": 2.0, "first_token_s": None, "finish_s": None, "output_tokens": 9, "ok": False},
    ]))  # fmt: skip
    stored["ttft_s"] = [9.0, 9.0]  # a stale value, to be derived again
    before = stored.copy()
    again = derive_timings(stored)
    assert list(again.columns) == list(stored.columns)
    assert again["ttft_s"].iloc[0] == 0.5
    assert math.isnan(again["ttft_s"].iloc[1])
    assert again["tpot_s"].iloc[0] == pytest.approx(0.5)
    pd.testing.assert_frame_equal(stored, before)


def test_ttft_uses_actual_send_not_target_arrival() -> None:
    f = derive_timings(frame([
        {"arrival_s": 1.0, "sent_s": 1.25, "first_token_s": 2.0, "finish_s": 3.0,
         "output_tokens": 2},
    ]))  # fmt: skip
    assert f["ttft_s"].iloc[0] == pytest.approx(0.75)


def test_percentiles_ok_rate_and_counts() -> None:
    rows = [
        {"sent_s": 0.0, "first_token_s": float(t), "finish_s": float(t) + 1, "output_tokens": 3}
        for t in range(1, 11)
    ] + [{"sent_s": 0.0, "first_token_s": None, "finish_s": None, "output_tokens": 3, "ok": False}]
    m = request_metrics(derive_timings(frame(rows)))
    assert (m.n, m.ok) == (11, 10)
    assert m.ok_rate == pytest.approx(10 / 11)
    # linear interpolation over 1..10 (vLLM's np.percentile): p50 = 5.5, p90 = 9.1, p99 = 9.91
    assert m.ttft_p50 == pytest.approx(5.5)
    assert m.ttft_p90 == pytest.approx(9.1)
    assert m.ttft_p99 == pytest.approx(9.91)
    assert m.ttft_mean == pytest.approx(5.5)
    assert m.e2e_p50 == pytest.approx(6.5)
    assert m.tpot_p50 == pytest.approx(0.5)  # (e2e − ttft) / (3 − 1) = 1 / 2


def test_empty_metrics_are_none() -> None:
    m = request_metrics(derive_timings(frame([
        {"sent_s": 0.0, "first_token_s": None, "finish_s": None, "output_tokens": 3, "ok": False}
    ])))  # fmt: skip
    assert m.ok == 0
    assert m.ttft_p90 is None


def test_gpu_imbalance_std_max_from_per_instance_means() -> None:
    util = pd.DataFrame({
        "variant": "v", "repeat": 0, "device": "sim",
        "time_s": [0, 1, 0, 1, 0, 1],
        "instance": ["a", "a", "b", "b", "c", "c"],
        "utilization": [0.2, 0.4, 0.6, 0.6, 0.9, 0.9],
    })  # fmt: skip
    g = gpu_stats(util)
    # means 0.3, 0.6, 0.9 -> imbalance 3.0, population std sqrt(0.06), max 0.9
    assert g.imbalance == pytest.approx(3.0)
    assert g.std == pytest.approx(np.sqrt(((0.3 - 0.6) ** 2 + 0 + (0.9 - 0.6) ** 2) / 3))
    assert g.max == pytest.approx(0.9)


def test_an_instance_idle_in_a_repeat_leaves_the_imbalance_undefined() -> None:
    """The repeat where an instance sat idle (max / min unbounded) was left out of the
    mean, so a variant that starved an instance in 6 of 10 repeats read better balanced
    than one that never did."""
    from btb_lab.analysis.intervals import point_value

    util = pd.DataFrame({
        "variant": "v", "device": "sim", "time_s": 0,
        "repeat": [0, 0, 1, 1],
        "instance": ["a", "b", "a", "b"],
        "utilization": [0.2, 0.4, 0.5, 0.0],
    })  # fmt: skip
    g = gpu_stats(util)
    assert g.imbalance is None
    assert (g.idle_repeats, g.repeats) == (1, 2)
    assert g.max == pytest.approx((0.4 + 0.5) / 2)
    units = [np.array([[0.2, 0.4]]), np.array([[0.5, 0.0]])]
    assert np.isnan(point_value(units, "gpu_imbalance"))
    assert point_value(units[:1], "gpu_imbalance") == pytest.approx(2.0)
    assert gpu_stats(util[util["repeat"] == 0]).imbalance == pytest.approx(2.0)


def test_cache_stats() -> None:
    c = cache_stats(frame([
        {"input_tokens": 100, "cached_tokens": 50, "cache_tier": "hbm"},
        {"input_tokens": 300, "cached_tokens": 0},
        {"input_tokens": 100, "cached_tokens": 100, "cache_tier": "ram"},
    ]))  # fmt: skip
    assert c.hit_rate == pytest.approx(150 / 500)
    assert c.mean_fraction == pytest.approx((0.5 + 0 + 1) / 3)
    assert c.requests_with_hit == 2
    assert c.tiers == {"hbm": 1, "ram": 1}


def test_metric_definitions() -> None:
    assert METRICS["ttft_p90"].label == "TTFT90"
    assert METRICS["tpot_mean"].label == "TPOTmean"
    assert METRICS["gpu_imbalance"].label == "GPU imbalance"
    assert (METRICS["e2e_p99"].column, METRICS["e2e_p99"].percentile) == ("e2e_s", 99.0)
    assert METRICS["e2e_mean"].percentile is None
    assert METRICS["ok_rate"].higher_is_better
    assert not METRICS["ttft_p50"].higher_is_better
    assert {m.level for m in METRICS.values()} == {"request", "gpu"}
    assert len(METRICS) == len(LATENCIES) * len(LATENCY_STATS) + 5


def test_summary_model_has_a_field_per_request_metric() -> None:
    """summary.json's RequestMetrics and config.metrics name the same request metrics."""
    fields = set(RequestMetrics.model_fields) - {"n", "ok"}
    assert fields == set(REQUEST_METRIC_NAMES)


def test_every_request_metric_has_a_value_overall_per_class_and_per_pool() -> None:
    """What a sweep's table and an ablation's waterfall read (`VariantSummary.value`):
    the cache hit rate too, pooled as the verdict pools it (cached / prompt tokens of the
    requests whose counts are known), not only the latency and OK metrics."""
    frame = derive_timings(pd.DataFrame({
        "variant": "v", "repeat": 0, "request_id": ["a", "b", "c", "d"],
        "source": ["art", "art", "synthetic", "synthetic"], "trace_id": "0", "route": "COLO",
        "arrival_s": 0.0, "sent_s": 0.0, "first_token_s": [0.5, 0.7, 0.9, None],
        "finish_s": [1.0, 1.2, 1.4, None], "output_tokens": 5,
        "input_tokens": [1000, 3000, 2000, 4000], "cached_tokens": [500, 0, 2000, np.nan],
        "ok": [True, True, True, False], "class": ["X", "Y", "X", "Y"],
        "error": [None, None, None, "ConnectError"],
    }))  # fmt: skip
    variant = summarize_variants(frame, EMPTY_UTIL, ["v"], ["X", "Y"])["v"]
    assert variant.value("cache_hit_rate") == pytest.approx(2500 / 6000)
    assert variant.value("cache_hit_rate", "X") == pytest.approx(2500 / 3000)
    assert variant.value("cache_hit_rate", "Y") == 0.0
    assert variant.value("cache_hit_rate", "pool:synthetic") == 1.0
    for metric in REQUEST_METRIC_NAMES:
        assert variant.value(metric) is not None, metric


def test_failures_group_errors_that_differ_only_in_their_numbers() -> None:
    from btb_lab.analysis.metrics import _failures

    errors = [
        *["needs 1000010 KV tokens; C0 holds 262144"] * 3,
        "needs 4000010 KV tokens; C0 holds 262144",
        "needs 2000010 KV tokens; C1 holds 262144",  # another instance: another cause
        "timeout after 30 s",
        None,
        "HTTP 503: busy",
    ]
    rows = pd.DataFrame({"ok": [False] * len(errors) + [True], "error": [*errors, None]})
    assert _failures(rows) == {
        "needs 1000010–4000010 KV tokens; C0 holds 262144": 4,
        "HTTP 503: busy": 1,  # ties by text
        "needs 2000010 KV tokens; C1 holds 262144": 1,
    }
    assert _failures(rows, shown=10)["no error recorded"] == 1
    assert _failures(rows.assign(ok=True)) == {}
