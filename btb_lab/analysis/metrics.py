"""Per-variant statistics of stored records: request metrics, cache hits, GPU balance.

What each metric means, and its column, statistic and direction, is defined once in
`btb_lab.config.metrics`; this module computes them over record frames whose latencies
were derived by `btb_lab.records.derive_timings` (the same formula `requests.parquet`
stores). Latency statistics use successful requests only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np
import pandas as pd

from btb_lab.analysis.models import CacheStats, GpuStats, RequestMetrics, VariantSummary
from btb_lab.analysis.scopes import rows_where, variant_rows
from btb_lab.config.metrics import METRICS, MetricDef

__all__ = [
    "cache_stats",
    "gpu_stats",
    "gpu_stats_from_means",
    "latency_stat",
    "request_metrics",
    "summarize_variants",
    "token_hit_rate",
]

_LATENCY_METRICS: tuple[MetricDef, ...] = tuple(m for m in METRICS.values() if m.kind == "latency")


def latency_stat(values: np.ndarray, stat: str) -> float:
    """One statistic (`mean` or `pNN`) of a latency sample; NaN when the sample is empty."""
    values = values[~np.isnan(values)]
    if values.size == 0:
        return math.nan
    if stat == "mean":
        return float(values.mean())
    return float(np.percentile(values, float(stat[1:])))


def request_metrics(frame: pd.DataFrame) -> RequestMetrics:
    """N, OK, OK rate and every latency metric for a set of records."""
    n = len(frame)
    ok = int(frame["ok"].astype(bool).sum()) if n else 0
    values: dict[str, float | None] = {}
    by_column: dict[str, list[MetricDef]] = {}
    for metric in _LATENCY_METRICS:
        assert metric.column is not None
        by_column.setdefault(metric.column, []).append(metric)
    for column, metrics in by_column.items():
        data = frame[column].to_numpy(dtype=float) if n else np.array([], dtype=float)
        data = data[~np.isnan(data)]
        # every percentile of a column from one sort (the values np.percentile gives one by one)
        pcts = [m for m in metrics if m.percentile is not None]
        levels = [m.percentile for m in pcts if m.percentile is not None]
        found: list[float] = np.percentile(data, levels).tolist() if data.size and pcts else []
        for m, value in zip(pcts, found, strict=False):
            values[m.name] = float(value)
        for m in metrics:
            if m.percentile is None:
                values[m.name] = float(data.mean()) if data.size else math.nan
            values.setdefault(m.name, math.nan)
    return RequestMetrics(
        n=n, ok=ok, ok_rate=ok / n if n else None, cache_hit_rate=_hit_rate(frame), **values
    )


def token_hit_rate(pairs: np.ndarray) -> float:
    """`cache_hit_rate` of (cached, prompt) token rows: cached over prompt tokens of the
    rows whose both counts are known; NaN without prompt tokens (or rows)."""
    if len(pairs) == 0:  # no request of the class (a resample of none is 1-wide)
        return math.nan
    pairs = pairs[~np.isnan(pairs).any(axis=1)]
    total = pairs[:, 1].sum()
    return float(pairs[:, 0].sum() / total) if total > 0 else math.nan


def _hit_rate(frame: pd.DataFrame) -> float | None:
    """`token_hit_rate` of a set of records, as the verdict pools it; None when undefined."""
    if not {"cached_tokens", "input_tokens"} <= set(frame.columns):
        return None
    rate = token_hit_rate(frame[["cached_tokens", "input_tokens"]].to_numpy(dtype=float))
    return None if math.isnan(rate) else rate


def cache_stats(frame: pd.DataFrame) -> CacheStats:
    """Prefix-cache hits: token hit rate, per-request hit fractions, tiers hits came from."""
    if frame.empty:
        return CacheStats()
    inp = frame["input_tokens"].astype(float)
    cached = frame["cached_tokens"].astype(float)
    frac = (cached / inp.where(inp > 0)).fillna(0.0)
    tiers: dict[str, int] = {}
    if "cache_tier" in frame.columns:
        hit = frame[cached > 0]
        counts = hit["cache_tier"].fillna("unknown").astype(str).value_counts()
        tiers = {str(k): int(v) for k, v in sorted(counts.items())}
    total_in = float(inp.sum())
    return CacheStats(
        hit_rate=float(cached.sum()) / total_in if total_in > 0 else None,
        mean_fraction=float(frac.mean()),
        median_fraction=float(frac.median()),
        requests_with_hit=int((cached > 0).sum()),
        cached_tokens=int(cached.sum()),
        input_tokens=int(total_in),
        tiers=tiers,
    )


def gpu_stats_from_means(means: Sequence[float] | np.ndarray) -> GpuStats:
    """Imbalance (max/min), std (population) and max of per-instance mean utilization."""
    arr = np.asarray(means, dtype=float)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return GpuStats()
    low = float(arr.min())
    return GpuStats(
        imbalance=float(arr.max()) / low if low > 0 else None,
        std=float(arr.std()),
        max=float(arr.max()),
    )


def gpu_stats(util: pd.DataFrame) -> GpuStats:
    """GPU (sim: instance) balance of one variant: imbalance, std and max of each repeat's
    per-instance means, averaged over the repeats (as the verdict's `point_value`: which
    instance runs hot changes between repeats); `per_instance` over all repeats."""
    if util.empty:
        return GpuStats()
    keyed = util.assign(unit=util["instance"].astype(str) + "/" + util["device"].astype(str))
    by_repeat = keyed.groupby(["repeat", "unit"], sort=True)["utilization"].mean()
    repeats = [gpu_stats_from_means(m.to_numpy()) for _, m in by_repeat.groupby(level=0)]

    def averaged(name: str) -> float | None:
        values = [v for v in (getattr(s, name) for s in repeats) if v is not None]
        return float(np.mean(values)) if values else None

    idle = sum(s.max is not None and s.imbalance is None for s in repeats)
    means = keyed.groupby("unit", sort=True)["utilization"].mean()
    return GpuStats(
        imbalance=None if idle else averaged("imbalance"),
        std=averaged("std"),
        max=averaged("max"),
        per_instance={str(k): float(v) for k, v in means.items()},
        idle_repeats=idle,
        repeats=len(repeats),
    )


def _grouped_metrics(
    rows: pd.DataFrame, column: str, *, per_repeat: bool = False
) -> dict[str, RequestMetrics]:
    """Metrics per value of `column` (pools by `source`, windows by `trace_id`), in order
    of first appearance. `per_repeat`: keys are `r<repeat>:<value>` when the run has
    several repeats (a generator's windows are new requests in every repeat)."""
    if column not in rows.columns or rows.empty:
        return {}
    keys = rows[column].astype(str)
    if per_repeat and rows["repeat"].nunique() > 1:
        keys = "r" + (rows["repeat"].astype(int) + 1).astype(str) + ":" + keys
    return {str(k): request_metrics(rows_where(rows, keys == k)) for k in keys.unique()}


# what a variant's summary reads of its records
_SUMMARY_COLUMNS = [
    "repeat", "ok", "error", "class", "route", "source", "trace_id", "input_tokens",
    "cached_tokens", "cache_tier",
    *dict.fromkeys(m.column for m in _LATENCY_METRICS if m.column is not None),
]  # fmt: skip


def summarize_variants(
    records: pd.DataFrame,
    util: pd.DataFrame,
    variants: Sequence[str],
    class_names: Sequence[str],
) -> dict[str, VariantSummary]:
    """`summary.json`'s `variants` block: metrics overall, per class, per pool (source) and
    per window (trace_id), routes, cache, GPU.

    `records` must already carry derived timings and the final `class` column."""
    out: dict[str, VariantSummary] = {}
    for name in variants:
        rows = variant_rows(records, name, _SUMMARY_COLUMNS)
        present = [str(c) for c in rows["class"].dropna().unique()] if "class" in rows else []
        ordered = list(class_names) + sorted(c for c in present if c not in class_names)
        util_rows = util[util["variant"] == name] if not util.empty else util
        routes = rows["route"].astype(str).value_counts() if len(rows) else pd.Series()
        out[name] = VariantSummary(
            all=request_metrics(rows),
            classes={c: request_metrics(rows_where(rows, rows["class"] == c)) for c in ordered},
            pools=_grouped_metrics(rows, "source"),
            windows=_grouped_metrics(rows, "trace_id", per_repeat=True),
            routes={str(k): int(v) for k, v in sorted(routes.items())},
            cache=cache_stats(rows),
            gpu=gpu_stats(util_rows),
            repeats=sorted(int(r) for r in rows["repeat"].unique()) if len(rows) else [],
            failures=_failures(rows),
        )
    return out


def _failures(rows: pd.DataFrame, shown: int = 3) -> dict[str, int]:
    """The most frequent kinds of error of the failed requests (most first, ties by text):
    a report says why requests failed, not only how many. Errors that differ only in their
    numbers are one kind, each differing number shown as its range ("needs 1000010–4000010
    KV tokens; C0 holds 262144"), so one cause is not listed once per prompt size."""
    if not len(rows) or bool(rows["ok"].all()):
        return {}
    errors = rows.loc[~rows["ok"].astype(bool), "error"].fillna("no error recorded").astype(str)
    kinds: dict[tuple[str, ...], list[tuple[list[str], int]]] = {}
    for error, n in errors.value_counts(sort=False).items():
        text = str(error)
        kinds.setdefault(tuple(_NUMBER.split(text)), []).append((_NUMBER.findall(text), int(n)))
    counts: dict[str, int] = {}
    for parts, members in kinds.items():
        slots = [_number_range([nums[i] for nums, _ in members]) for i in range(len(parts) - 1)]
        text = "".join(part + slot for part, slot in zip(parts, [*slots, ""], strict=True))
        counts[text] = sum(n for _, n in members)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return dict(ranked[:shown])


# a number standing alone (not inside a name such as `C0`)
_NUMBER = re.compile(r"\b\d+(?:\.\d+)?\b")


def _number_range(values: list[str]) -> str:
    """One number slot of an error kind: the value, or `low–high` where it differs."""
    low, high = min(values, key=float), max(values, key=float)
    return low if float(low) == float(high) else f"{low}–{high}"
