"""The resampling units of a metric and their bootstrap intervals, for the verdict and
the sweep views: per variant and repeat the units one metric is computed over (requests'
latencies, ok flags, (cached, input) token pairs, or GPU-utilization time samples), the
same units row-aligned across two variants for a paired bootstrap, the metric over them,
and percentile intervals of a relative change or of a value. `verdict.py` reads outcomes
off these intervals; `bootstrap.py` makes the draws.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from btb_lab.analysis.bootstrap import (
    Draws,
    gpu_draws,
    paired_draws,
    unpaired_draws,
    value_draws,
)
from btb_lab.analysis.metrics import gpu_stats_from_means, latency_stat, token_hit_rate
from btb_lab.analysis.scopes import in_pool, variant_rows
from btb_lab.config.metrics import METRICS, MetricDef

__all__ = [
    "bootstrap_change",
    "change_draws",
    "metric_units",
    "paired_units",
    "paired_with_repeats",
    "percentile_interval",
    "point_value",
    "seed_of",
    "units_by_repeat",
    "value_interval",
]

Stat = Callable[[np.ndarray], float]


# ---------------------------------------------------------------------------- metric units


def _stat_for(metric: str) -> Stat:
    """The metric over a block of units; NaN rows (a request missing from a variant, or
    for latencies one that failed there) do not count."""
    definition = METRICS[metric]
    if definition.kind == "ok_rate":

        def ok_rate(rows: np.ndarray) -> float:
            sent = rows[:, 0][~np.isnan(rows[:, 0])]
            return float(sent.mean()) if sent.size else math.nan

        return ok_rate
    if definition.kind == "cache_hit_rate":
        return token_hit_rate
    if definition.kind == "gpu":
        key = definition.statistic

        def gpu(rows: np.ndarray) -> float:
            if len(rows) == 0:
                return math.nan
            value = getattr(gpu_stats_from_means(np.nanmean(rows, axis=0)), key)
            return math.nan if value is None else float(value)

        return gpu
    stat = definition.statistic
    return lambda rows: latency_stat(rows[:, 0], stat)


def _unit_columns(definition: MetricDef) -> list[str]:
    """The record columns one resampling unit of a request metric holds."""
    if definition.kind == "cache_hit_rate":
        return ["cached_tokens", "input_tokens"]
    assert definition.column is not None
    return [definition.column]


def metric_units(
    records: pd.DataFrame,
    util: pd.DataFrame,
    variant: str,
    metric: str,
    klass: str | None = None,
) -> list[np.ndarray]:
    """The resampling units of one metric for one variant, one 2-D array per repeat:
    successful requests' latencies, every request's ok flag, (cached, input) token pairs,
    or for GPU metrics the utilization time samples (time × instance)."""
    return list(units_by_repeat(records, util, variant, metric, klass).values())


def units_by_repeat(
    records: pd.DataFrame, util: pd.DataFrame, variant: str, metric: str, klass: str | None
) -> dict[int, np.ndarray]:
    """`metric_units` keyed by repeat."""
    definition = METRICS[metric]
    units: dict[int, np.ndarray] = {}
    if definition.kind == "gpu":
        rows = util[util["variant"] == variant] if not util.empty else util
        if rows.empty:
            return units
        # every repeat's matrix has the same columns (the variant's units, sorted), so the
        # repeats of one variant line up; the mean where a (time, unit) repeats
        names = rows["instance"].astype(str) + "/" + rows["device"].astype(str)
        unit_names, col = np.unique(names.to_numpy(), return_inverse=True)
        repeat_ids = rows["repeat"].to_numpy()
        times = rows["time_s"].to_numpy(dtype=float)
        values = rows["utilization"].to_numpy(dtype=float)
        for repeat in np.unique(repeat_ids):
            mine = repeat_ids == repeat
            t_values, t_index = np.unique(times[mine], return_inverse=True)
            sums = np.zeros((t_values.size, unit_names.size))
            counts = np.zeros_like(sums)
            np.add.at(sums, (t_index, col[mine]), values[mine])
            np.add.at(counts, (t_index, col[mine]), 1.0)
            with np.errstate(invalid="ignore", divide="ignore"):
                units[int(repeat)] = np.where(counts > 0, sums / counts, np.nan)
        return units
    columns = _unit_columns(definition)
    rows = variant_rows(records, variant, ["repeat", "ok", "class", *columns])
    if klass is not None:
        rows = rows[rows["class"] == klass]
    for repeat, rep in rows.groupby("repeat", sort=True):
        if definition.kind == "latency":
            good = rep[rep["ok"].astype(bool)]
            arr = good[columns].to_numpy(dtype=float)
            arr = arr[~np.isnan(arr[:, 0])]
        else:
            arr = rep[columns].to_numpy(dtype=float)
        units[int(str(repeat))] = arr
    return units


def point_value(units: Sequence[np.ndarray], metric: str) -> float:
    """The metric over all repeats pooled; a GPU metric per repeat, then averaged: the
    instances of two repeats are not the same GPUs running the same load (which one runs
    hot changes), so pooling their samples by name would average the imbalance away."""
    if not units:
        return math.nan
    stat = _stat_for(metric)
    if METRICS[metric].kind == "gpu":
        values = [stat(u) for u in units if len(u)]
        # a repeat with an idle instance has no imbalance: nor have the repeats together
        # (their mean without it would read better balanced than the run was)
        if not values or not all(math.isfinite(v) for v in values):
            return math.nan
        return float(np.mean(values))
    return stat(np.concatenate(units))


def paired_units(
    records: pd.DataFrame,
    baseline: str,
    variant: str,
    metric: str,
    klass: str | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """Row-aligned resampling units of baseline and variant for a paired bootstrap: one
    2-D array per repeat each, row i of both the same (repeat, request_id). A request
    missing from a variant is a NaN row there; for latencies a failed request is NaN too,
    so percentiles stay over successful requests and OK rate over the requests sent.

    Without a class the rows are every request either variant sent in that repeat. With a
    class they are the requests the *baseline* labelled with it, read from the variant
    whatever label it gave them: classes can depend on cached tokens, which the variant
    changes, and comparing each variant's own class would compare different request
    populations (a router that turns HEAVY requests into WARM hits would change WARM's
    make-up). The variant's value is then its metric over those requests.

    None when the metric is a GPU one, request ids are absent or repeat within a run, or
    the two variants share no request id: the caller resamples each variant on its own."""
    aligned = paired_with_repeats(records, baseline, variant, metric, klass)
    return None if aligned is None else (aligned[1], aligned[2])


def paired_with_repeats(
    records: pd.DataFrame, baseline: str, variant: str, metric: str, klass: str | None
) -> tuple[list[int], list[np.ndarray], list[np.ndarray]] | None:
    """`paired_units` with the repeat of each unit."""
    definition = METRICS[metric]
    if definition.level == "gpu" or "request_id" not in records.columns:
        return None
    columns = _unit_columns(definition)

    def table(name: str) -> pd.DataFrame:
        rows = variant_rows(records, name, ["repeat", "request_id", "class", "ok", *columns])
        out = pd.DataFrame({
            "repeat": rows["repeat"].astype(int).to_numpy(),
            "request_id": rows["request_id"].astype(str).reset_index(drop=True),
            "klass": rows["class"].to_numpy() if "class" in rows.columns else None,
        })  # fmt: skip
        if definition.kind == "ok_rate":
            out["ok"] = rows["ok"].astype(bool).astype(float).to_numpy()
        elif definition.kind == "cache_hit_rate":
            for c in columns:
                out[c] = rows[c].to_numpy(dtype=float)
        else:
            out[columns[0]] = np.where(
                rows["ok"].astype(bool).to_numpy(), rows[columns[0]].to_numpy(dtype=float), np.nan
            )
        return out

    base, var = table(baseline), table(variant)
    if base.empty or var.empty:
        return None
    # one integer key per (repeat, request id), ordered as the pair sorts (ids as text),
    # so the units' row order never depends on the order records were stored in
    codes, names = pd.factorize(
        pd.concat([base["request_id"], var["request_id"]], ignore_index=True), sort=True
    )
    codes = np.asarray(codes, dtype=np.int64)
    width = max(len(names), 1)
    base_key = base["repeat"].to_numpy(dtype=np.int64) * width + codes[: len(base)]
    var_key = var["repeat"].to_numpy(dtype=np.int64) * width + codes[len(base) :]
    if np.unique(base_key).size < base_key.size or np.unique(var_key).size < var_key.size:
        return None
    if klass is not None:
        universe = np.unique(base_key[base["klass"].to_numpy() == klass])
        # the baseline's requests of the class must turn up in the variant
        shared = np.isin(universe, var_key)
    else:
        universe = np.union1d(base_key, var_key)
        shared = np.isin(base_key, var_key)
    if universe.size == 0 or not shared.any():
        return None

    def aligned(frame: pd.DataFrame, key: np.ndarray) -> np.ndarray:
        out = np.full((universe.size, len(columns)), np.nan)
        pos = np.searchsorted(universe, key)
        inside = (pos < universe.size) & (universe[np.minimum(pos, universe.size - 1)] == key)
        out[pos[inside]] = frame[columns].to_numpy(dtype=float)[inside]
        return out

    b, v = aligned(base, base_key), aligned(var, var_key)
    repeats = universe // width
    cuts = np.flatnonzero(np.diff(repeats)) + 1
    ids = [int(r) for r in repeats[np.r_[0, cuts]]]
    return ids, list(np.split(b, cuts)), list(np.split(v, cuts))


# ---------------------------------------------------------------------------- bootstrap


def seed_of(*parts: object) -> int:
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def change_draws(
    base_units: Sequence[np.ndarray],
    var_units: Sequence[np.ndarray],
    metric: str,
    *,
    samples: int,
    seed: int,
    paired: bool,
    pair_repeats: bool = False,
) -> Draws:
    definition = METRICS[metric]
    rng = np.random.default_rng(seed)
    if paired:
        return paired_draws(base_units, var_units, definition.kind, definition.percentile,
                            samples=samples, rng=rng)  # fmt: skip
    if definition.kind == "gpu":
        draws = gpu_draws(base_units, var_units, definition.statistic, samples=samples,
                          rng=rng, pair_repeats=pair_repeats)  # fmt: skip
        if draws is not None:
            return draws
    return unpaired_draws(_stat_for(metric), base_units, var_units, samples=samples, rng=rng,
                          pair_repeats=pair_repeats)  # fmt: skip


def percentile_interval(draws: Draws, level: float) -> tuple[float, float]:
    """The percentile interval at `level`; NaN when a tenth of the resamples or more had
    no defined change (a zero or undefined baseline)."""
    if draws.values.size < draws.samples * 0.9:
        return math.nan, math.nan
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(draws.values, [tail, 100 - tail])
    return float(low), float(high)


def bootstrap_change(
    base_units: Sequence[np.ndarray],
    var_units: Sequence[np.ndarray],
    metric: str,
    *,
    samples: int,
    confidence: float,
    seed: int,
    paired: bool = False,
) -> tuple[float, float, float]:
    """Relative change (variant − baseline) / baseline and its percentile bootstrap
    interval. NaN where the baseline value is zero or undefined. `paired`: the units are
    row-aligned (`paired_units`), and each resample uses the same rows for both."""
    base = point_value(base_units, metric)
    value = point_value(var_units, metric)
    change = (value - base) / base if base and math.isfinite(base) else math.nan
    draws = change_draws(base_units, var_units, metric, samples=samples, seed=seed, paired=paired)
    low, high = percentile_interval(draws, confidence)
    return change, low, high


def value_interval(
    records: pd.DataFrame,
    util: pd.DataFrame,
    variant: str,
    metric: str,
    scope: str = "all",
    *,
    samples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """A percentile bootstrap interval of one variant's metric value (repeats and requests
    resampled), for `scope` `all`, a class, or `pool:<source>`."""
    klass: str | None = None
    if scope.startswith("pool:"):
        records = in_pool(records, scope[5:])
    elif scope != "all":
        klass = scope
    definition = METRICS[metric]
    units = metric_units(records, util, variant, metric, klass)
    draws = value_draws(
        units, definition.kind, definition.percentile, definition.statistic, samples=samples,
        rng=np.random.default_rng(seed_of(seed, variant, metric, scope, "value")),
    )  # fmt: skip
    if draws.size < samples * 0.9:
        return math.nan, math.nan
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return float(low), float(high)
