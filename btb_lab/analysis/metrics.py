"""Metric definitions (as vLLM's benchmark counts them) and per-variant summaries.

TTFT = first token − send; E2E = last token − send; TPOT = (E2E − TTFT) / (output − 1)
for output_tokens > 1; OK/N over requests sent; GPU imbalance = max / min of per-instance
mean utilization, with std and max of the same means. Latency statistics use successful
requests only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

__all__ = [
    "GPU_METRIC_NAMES",
    "HIGHER_IS_BETTER",
    "LATENCIES",
    "METRIC_NAMES",
    "REQUEST_METRIC_NAMES",
    "STATS",
    "cache_stats",
    "derive_timings",
    "gpu_stats",
    "gpu_stats_from_means",
    "latency_stat",
    "metric_label",
    "request_metrics",
    "summarize_variants",
]

LATENCIES = ("ttft", "tpot", "e2e")
STATS = ("p50", "p90", "p95", "p99", "mean")
REQUEST_METRIC_NAMES: tuple[str, ...] = (
    *(f"{lat}_{stat}" for lat in LATENCIES for stat in STATS),
    "ok_rate",
    "cache_hit_rate",
)
GPU_METRIC_NAMES: tuple[str, ...] = ("gpu_imbalance", "gpu_std", "gpu_max")
METRIC_NAMES: tuple[str, ...] = (*REQUEST_METRIC_NAMES, *GPU_METRIC_NAMES)
HIGHER_IS_BETTER = frozenset({"ok_rate", "cache_hit_rate"})


def metric_label(name: str) -> str:
    """Short label in the seed log's style: ttft_p90 → TTFT90, e2e_mean → E2Emean."""
    if "_" in name and name.split("_", 1)[0] in LATENCIES:
        lat, stat = name.split("_", 1)
        return lat.upper() + (stat[1:] if stat.startswith("p") else stat)
    return {
        "ok_rate": "OK rate",
        "cache_hit_rate": "cache hit rate",
        "gpu_imbalance": "GPU imbalance",
        "gpu_std": "GPU std",
        "gpu_max": "GPU max",
    }.get(name, name)


def derive_timings(frame: pd.DataFrame) -> pd.DataFrame:
    """Fill ttft_s, e2e_s, tpot_s from the raw stamps (a copy; failed requests get NaN)."""
    out = frame.copy()
    sent = out["sent_s"].astype(float)
    first = pd.to_numeric(out["first_token_s"], errors="coerce").astype(float)
    finish = pd.to_numeric(out["finish_s"], errors="coerce").astype(float)
    ok = out["ok"].astype(bool)
    ttft = (first - sent).where(ok)
    e2e = (finish - sent).where(ok)
    tokens = out["output_tokens"].astype(float)
    tpot = ((e2e - ttft) / (tokens - 1)).where(ok & (tokens > 1))
    out["ttft_s"] = ttft
    out["e2e_s"] = e2e
    out["tpot_s"] = tpot
    return out


def latency_stat(values: np.ndarray, stat: str) -> float:
    """One statistic of a latency sample; NaN when the sample is empty."""
    values = values[~np.isnan(values)]
    if values.size == 0:
        return math.nan
    if stat == "mean":
        return float(values.mean())
    return float(np.percentile(values, float(stat[1:])))


def _clean(value: float) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def request_metrics(frame: pd.DataFrame) -> dict[str, Any]:
    """N, OK, OK rate and p50/p90/p95/p99/mean of TTFT, TPOT, E2E for a set of records."""
    n = len(frame)
    ok = int(frame["ok"].astype(bool).sum()) if n else 0
    out: dict[str, Any] = {"n": n, "ok": ok, "ok_rate": _clean(ok / n) if n else None}
    for lat in LATENCIES:
        column = f"{lat}_s"
        values = frame[column].to_numpy(dtype=float) if n else np.array([], dtype=float)
        for stat in STATS:
            out[f"{lat}_{stat}"] = _clean(latency_stat(values, stat))
    return out


def cache_stats(frame: pd.DataFrame) -> dict[str, Any]:
    """Prefix-cache hits: token hit rate, per-request hit fractions, tiers hits came from."""
    if frame.empty:
        return {
            "hit_rate": None,
            "mean_fraction": None,
            "median_fraction": None,
            "requests_with_hit": 0,
            "cached_tokens": 0,
            "input_tokens": 0,
            "tiers": {},
        }
    inp = frame["input_tokens"].astype(float)
    cached = frame["cached_tokens"].astype(float)
    frac = (cached / inp.where(inp > 0)).fillna(0.0)
    tiers: dict[str, int] = {}
    if "cache_tier" in frame.columns:
        hit = frame[cached > 0]
        counts = hit["cache_tier"].fillna("unknown").astype(str).value_counts()
        tiers = {str(k): int(v) for k, v in sorted(counts.items())}
    total_in = float(inp.sum())
    return {
        "hit_rate": _clean(float(cached.sum()) / total_in) if total_in > 0 else None,
        "mean_fraction": _clean(float(frac.mean())),
        "median_fraction": _clean(float(frac.median())),
        "requests_with_hit": int((cached > 0).sum()),
        "cached_tokens": int(cached.sum()),
        "input_tokens": int(total_in),
        "tiers": tiers,
    }


def gpu_stats_from_means(means: Sequence[float] | np.ndarray) -> dict[str, float | None]:
    """Imbalance (max/min), std (population) and max of per-instance mean utilization."""
    arr = np.asarray(means, dtype=float)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return {"imbalance": None, "std": None, "max": None}
    low = float(arr.min())
    return {
        "imbalance": _clean(float(arr.max()) / low) if low > 0 else None,
        "std": _clean(float(arr.std())),
        "max": _clean(float(arr.max())),
    }


def gpu_stats(util: pd.DataFrame) -> dict[str, Any]:
    """GPU (sim: instance) balance over one variant's utilization samples, all repeats."""
    if util.empty:
        return {"imbalance": None, "std": None, "max": None, "per_instance": {}}
    keyed = util.assign(unit=util["instance"].astype(str) + "/" + util["device"].astype(str))
    means = keyed.groupby("unit", sort=True)["utilization"].mean()
    out: dict[str, Any] = dict(gpu_stats_from_means(means.to_numpy()))
    out["per_instance"] = {str(k): float(v) for k, v in means.items()}
    return out


def summarize_variants(
    records: pd.DataFrame,
    util: pd.DataFrame,
    variants: Sequence[str],
    class_names: Sequence[str],
) -> dict[str, Any]:
    """`summary.json`'s `variants` block: metrics overall and per class, routes, cache, GPU.

    `records` must already carry derived timings and the final `class` column."""
    out: dict[str, Any] = {}
    for name in variants:
        rows = records[records["variant"] == name]
        present = [str(c) for c in rows["class"].dropna().unique()] if "class" in rows else []
        ordered = list(class_names) + sorted(c for c in present if c not in class_names)
        util_rows = util[util["variant"] == name] if not util.empty else util
        routes = rows["route"].astype(str).value_counts() if len(rows) else pd.Series()
        out[name] = {
            "all": request_metrics(rows),
            "classes": {c: request_metrics(rows[rows["class"] == c]) for c in ordered},
            "routes": {str(k): int(v) for k, v in sorted(routes.items())},
            "cache": cache_stats(rows),
            "gpu": gpu_stats(util_rows),
            "repeats": sorted(int(r) for r in rows["repeat"].unique()) if len(rows) else [],
        }
    return out
