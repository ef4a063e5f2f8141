"""Paired bootstrap draws of a relative change, fast enough for a million requests.

A paired resample draws repeats with replacement (when there are two or more), then the
rows of every drawn repeat with replacement, and evaluates the metric on baseline and
variant over the same rows. What a resample needs is only how often each row was drawn,
and for most metrics only a few aggregates of those counts, so the draws are made on the
aggregates directly, exactly in distribution:

- **percentiles** (`window`): only the rows ranked near the quantile can be the order
  statistics the percentile interpolates. The rows of both columns are split into a
  window around each column's quantile (kept individually) and aggregate cells for the
  rest (below / above / missing, crossed between the two columns). The repeat multiplicities
  are multinomial; given them, the cell counts of each repeat are multinomial over its
  cells; given a cell's count, its rows are uniform picks. A resample whose order
  statistic falls outside a window has its aggregate cells refined into rows, so the
  result is exact whatever the window (the window only decides the speed).
- **OK rate** (`cells`): each row is one of nine (baseline, variant) states (ok, failed,
  not sent); nine multinomial cells per repeat are the whole resample.
- **means and the token hit rate** (`rows`): every row matters, so rows are drawn by index
  while `rows × resamples` stays below `EXACT_LIMIT`; beyond it (`normal`) the draws are
  the normal approximation of the same two-stage bootstrap (delta method on the ratio,
  between-repeat and within-repeat variance), clearly labelled in the summary.

The percentile arithmetic is numpy's linear method, as `latency_stat` computes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

import numpy as np

__all__ = [
    "EXACT_LIMIT",
    "DrawMethod",
    "Draws",
    "counts_percentile",
    "gpu_draws",
    "interp_percentile",
    "paired_draws",
    "unpaired_draws",
    "value_draws",
]

DrawMethod = Literal["window", "cells", "rows", "normal", "unpaired"]
# rows × resamples up to which means are resampled row by row (exact); above it the
# normal approximation is used
EXACT_LIMIT = 20_000_000
_WINDOW_SIGMAS = 4.5  # a wider window is slower, never less exact
_WINDOW_PAD = 16


@dataclass
class Draws:
    """Bootstrap draws of the relative change (variant − baseline) / baseline: the finite
    ones, how many resamples were made, and how they were made."""

    values: np.ndarray
    samples: int
    method: DrawMethod


def interp_percentile(lo: np.ndarray, hi: np.ndarray, t: np.ndarray) -> np.ndarray:
    """numpy's linear interpolation between two order statistics, the same arithmetic
    (`_lerp`) so the values agree bit for bit with `np.percentile`."""
    diff = hi - lo
    return np.where(t >= 0.5, hi - diff * (1 - t), lo + diff * t)


def counts_percentile(sorted_values: np.ndarray, counts: np.ndarray, q: float) -> float:
    """The `q` quantile (0–1) of a sample holding `counts[i]` copies of `sorted_values[i]`."""
    total = int(counts.sum())
    if total == 0:
        return math.nan
    below = np.cumsum(counts)
    index = (total - 1) * q
    low = math.floor(index)
    high = min(low + 1, total - 1)
    a, b = sorted_values[np.searchsorted(below, [low, high], side="right")]
    t = index - low
    return float(interp_percentile(np.array(a), np.array(b), np.array(t)))


def _repeat_multiplicity(
    sizes: Sequence[int], samples: int, rng: np.random.Generator
) -> np.ndarray:
    """How often each repeat is drawn in each resample (samples × repeats)."""
    r = len(sizes)
    if r >= 2:
        return rng.multinomial(r, np.full(r, 1.0 / r), size=samples)
    return np.ones((samples, r), dtype=np.int64)


def _uniform_counts(picks: np.ndarray, n_rows: int, rng: np.random.Generator) -> np.ndarray:
    """Row counts (resamples × n_rows) when resample i picks `picks[i]` rows uniformly.

    The picks are drawn in one call (the same stream as ever) and counted a resample at a
    time into the int32 result: a flat index and an int64 count per (resample, row), as
    before, tripled the memory, and a run's first analysis spent ~0.3 s faulting it in."""
    samples = picks.size
    total = int(picks.sum())
    if n_rows == 0 or total == 0:
        return np.zeros((samples, n_rows), dtype=np.int64)
    drawn = rng.integers(0, n_rows, total)
    counts = np.empty((samples, n_rows), dtype=np.int32)
    start = 0
    for i, end in enumerate(np.cumsum(picks).tolist()):
        counts[i] = np.bincount(drawn[start:end], minlength=n_rows)
        start = end
    return counts


# ---------------------------------------------------------------------------- percentiles


class _Column:
    """One column's ranks and its window around the quantile."""

    def __init__(self, values: np.ndarray, q: float, repeat: np.ndarray, n_rep: int) -> None:
        valid = ~np.isnan(values)
        order = np.argsort(values[valid], kind="stable")
        self.sorted = values[valid][order]
        self.rank = np.full(values.size, -1, dtype=np.int64)
        self.rank[np.flatnonzero(valid)[order]] = np.arange(order.size)
        n_ok = order.size
        centre = q * (n_ok - 1)
        # spread of the count below the quantile: within repeats (binomial) plus between
        # them (repeat resampling moves it by the repeats' deviations)
        within = math.sqrt(max(values.size * q * (1 - q), 1.0))
        between = 0.0
        if n_rep >= 2 and n_ok:
            threshold = math.floor(centre)
            below = np.bincount(repeat[(self.rank >= 0) & (self.rank <= threshold)],
                                minlength=n_rep)  # fmt: skip
            ok = np.bincount(repeat[valid], minlength=n_rep)
            between = math.sqrt(n_rep) * float(np.std(below - q * ok))
        half = _WINDOW_SIGMAS * (within + between) + _WINDOW_PAD
        self.lo = max(0, math.floor(centre - half))
        self.hi = min(n_ok - 1, math.ceil(centre + half))
        # region per row: 0 below the window, 1 inside, 2 above, 3 missing (NaN)
        region = np.full(values.size, 3, dtype=np.int8)
        region[valid] = 1
        region[(self.rank >= 0) & (self.rank < self.lo)] = 0
        region[self.rank > self.hi] = 2
        self.region = region


def _window_values(
    col: _Column,
    q: float,
    total: np.ndarray,
    below: np.ndarray,
    missing: np.ndarray,
    win_counts: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Per resample: the percentile where both order statistics fall in the window, and
    which resamples need the exact refinement instead."""
    samples = total.size
    n_star = total - missing
    index = (n_star - 1) * q
    low = np.floor(index).astype(np.int64)
    high = np.minimum(low + 1, n_star - 1)
    t = index - low
    cum = below[:, None] + np.cumsum(win_counts, axis=1)
    inside = cum[:, -1] if cum.shape[1] else below
    bad = (n_star <= 0) | (low < below) | (high >= inside)
    out = np.full(samples, np.nan)
    good = np.flatnonzero(~bad)
    if good.size and cum.shape[1]:
        # one searchsorted over every row at once: offset each row past the previous one
        span = int(cum.max()) + 1
        flat = (cum[good] + (np.arange(good.size)[:, None] * span)).ravel()
        base = np.arange(good.size) * span
        width = cum.shape[1]
        j_lo = np.searchsorted(flat, base + low[good], side="right") - np.arange(good.size) * width
        j_hi = np.searchsorted(flat, base + high[good], side="right") - np.arange(good.size) * width
        window_sorted = col.sorted[col.lo : col.hi + 1]
        out[good] = interp_percentile(window_sorted[j_lo], window_sorted[j_hi], t[good])
    return out, bad & (n_star > 0)


def _percentile_draws(
    base: np.ndarray,
    var: np.ndarray,
    sizes: Sequence[int],
    q: float,
    samples: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """(baseline, variant) percentile per resample, shape (2, samples)."""
    n_rep = len(sizes)
    repeat = np.repeat(np.arange(n_rep), sizes)
    cols = (_Column(base, q, repeat, n_rep), _Column(var, q, repeat, n_rep))
    in_window = (cols[0].region == 1) | (cols[1].region == 1)
    # aggregate cell of every row outside both windows: (region_b, region_v) in {0,2,3}²
    cell = np.where(in_window, -1, cols[0].region.astype(np.int64) * 4 + cols[1].region)
    mult = _repeat_multiplicity(sizes, samples, rng)
    totals = mult @ np.asarray(sizes, dtype=np.int64)
    win_rows: list[np.ndarray] = []
    win_counts: list[np.ndarray] = []
    agg: list[tuple[np.ndarray, list[np.ndarray]]] = []  # per repeat: counts, member rows
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    for r in range(n_rep):
        rows = np.arange(offsets[r], offsets[r + 1])
        inside = rows[in_window[rows]]
        keys = np.unique(cell[rows][~in_window[rows]])
        members = [rows[cell[rows] == k] for k in keys]
        n_r = rows.size
        if n_r == 0:
            continue
        p = np.array([inside.size, *(m.size for m in members)], dtype=float) / n_r
        coarse = rng.multinomial(mult[:, r] * n_r, p / p.sum())
        win_rows.append(inside)
        win_counts.append(_uniform_counts(coarse[:, 0], inside.size, rng))
        agg.append((coarse[:, 1:], members))
    rows_w = np.concatenate(win_rows) if win_rows else np.empty(0, dtype=np.int64)
    counts_w = (
        np.concatenate(win_counts, axis=1) if win_counts else np.zeros((samples, 0), np.int64)
    )
    out = np.empty((2, samples))
    refine: np.ndarray = np.zeros(samples, dtype=bool)
    for c, col in enumerate(cols):
        below = np.zeros(samples, dtype=np.int64)
        missing = np.zeros(samples, dtype=np.int64)
        for counts, members in agg:
            for k, m in enumerate(members):
                region = col.region[m[0]]
                if region == 0:
                    below += counts[:, k]
                elif region == 3:
                    missing += counts[:, k]
        region_w = col.region[rows_w]
        below += counts_w[:, region_w == 0].sum(axis=1)
        missing += counts_w[:, region_w == 3].sum(axis=1)
        mine = np.flatnonzero(region_w == 1)
        order = mine[np.argsort(col.rank[rows_w[mine]], kind="stable")]
        values, bad = _window_values(col, q, totals, below, missing, counts_w[:, order])
        out[c] = values
        refine |= bad
    for i in np.flatnonzero(refine):
        # exact: the rows of every aggregate cell are uniform picks given its count
        full = np.zeros(base.size, dtype=np.int64)
        full[rows_w] += counts_w[i]
        for counts, members in agg:
            for k, m in enumerate(members):
                if counts[i, k]:
                    full += np.bincount(
                        m[rng.integers(0, m.size, counts[i, k])], minlength=base.size
                    )
        for c, col in enumerate(cols):
            ranked = np.zeros(col.sorted.size, dtype=np.int64)
            ok = col.rank >= 0
            np.add.at(ranked, col.rank[ok], full[ok])
            out[c, i] = counts_percentile(col.sorted, ranked, q)
    return out


# ---------------------------------------------------------------------------- OK rate


def _ok_rate_draws(
    base: np.ndarray, var: np.ndarray, sizes: Sequence[int], samples: int, rng: np.random.Generator
) -> np.ndarray:
    """(baseline, variant) OK rate per resample from nine (state, state) cells."""

    def state(x: np.ndarray) -> np.ndarray:
        return np.where(np.isnan(x), 2, np.where(x > 0.5, 0, 1))

    cell = state(base) * 3 + state(var)
    mult = _repeat_multiplicity(sizes, samples, rng)
    totals = np.zeros((samples, 9), dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    for r, n_r in enumerate(sizes):
        if n_r == 0:
            continue
        p = np.bincount(cell[offsets[r] : offsets[r + 1]], minlength=9) / n_r
        totals += rng.multinomial(mult[:, r] * n_r, p / p.sum())
    grid = totals.reshape(samples, 3, 3)
    out = np.empty((2, samples))
    with np.errstate(invalid="ignore", divide="ignore"):
        for c, axis in ((0, 2), (1, 1)):
            per_state = grid.sum(axis=axis)  # samples × 3 (ok, failed, not sent)
            out[c] = per_state[:, 0] / (per_state[:, 0] + per_state[:, 1])
    return out


# ---------------------------------------------------------------------------- means


def _mean_parts(units: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Numerator and denominator per row: a mean is sum(num) / sum(den) over the rows."""
    if kind == "cache_hit_rate":
        good = ~np.isnan(units).any(axis=1)
        return np.where(good, units[:, 0], 0.0), np.where(good, units[:, 1], 0.0)
    good = ~np.isnan(units[:, 0])
    return np.where(good, units[:, 0], 0.0), good.astype(float)


def _mean_rows(
    parts: tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
    sizes: Sequence[int],
    samples: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """(baseline, variant) ratio of sums per resample, rows drawn by index (exact)."""
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    out = np.empty((2, samples))
    for i in range(samples):
        picks = rng.integers(0, len(sizes), len(sizes)) if len(sizes) >= 2 else range(len(sizes))
        rows = np.concatenate(
            [offsets[r] + rng.integers(0, sizes[r], sizes[r]) for r in picks if sizes[r]]
            or [np.empty(0, dtype=np.int64)]
        )
        for c, (num, den) in enumerate(parts):
            d = den[rows].sum()
            out[c, i] = num[rows].sum() / d if d > 0 else math.nan
    return out


def _normal_change(
    parts: tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
    sizes: Sequence[int],
    samples: int,
) -> np.ndarray:
    """Relative-change draws from the normal approximation of the two-stage bootstrap:
    the delta method on ratio(variant) / ratio(baseline) − 1, with the influence of each
    row; resampling repeats adds the spread of the repeats' influence totals."""
    (nb, db), (nv, dv) = parts
    n = float(sum(sizes))
    mb, mv = db.sum() / n, dv.sum() / n
    if mb <= 0 or mv <= 0:
        return np.empty(0)
    rb, rv = nb.sum() / db.sum(), nv.sum() / dv.sum()
    if rb == 0:
        return np.empty(0)
    # influence of each row on each ratio, then on the relative change
    inf_b = (nb - rb * db) / mb
    inf_v = (nv - rv * dv) / mv
    inf = inf_v / rb - rv * inf_b / rb**2
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    within = 0.0
    totals = []
    for r in range(len(sizes)):
        part = inf[offsets[r] : offsets[r + 1]]
        if part.size:
            within += part.size * float(np.var(part))
            totals.append(float(part.sum()))
    between = len(totals) * float(np.var(totals)) if len(totals) >= 2 else 0.0
    sd = math.sqrt(within + between) / n
    grid = (np.arange(samples) + 0.5) / samples
    z = np.array([NormalDist().inv_cdf(float(p)) for p in grid])
    return (rv / rb - 1) + sd * z


# ---------------------------------------------------------------------------- entry point


def paired_draws(
    base_units: Sequence[np.ndarray],
    var_units: Sequence[np.ndarray],
    kind: str,
    percentile: float | None,
    *,
    samples: int,
    rng: np.random.Generator,
    exact_limit: int = EXACT_LIMIT,
) -> Draws:
    """Relative-change draws of a paired resample of row-aligned units (one 2-D array per
    repeat, row i of both the same request). `kind` is the metric kind (latency, ok_rate,
    cache_hit_rate); `percentile` the latency percentile (90.0) or None for a mean."""
    sizes = [len(u) for u in base_units]
    if sizes != [len(u) for u in var_units]:
        raise ValueError("paired bootstrap needs row-aligned units")
    width = base_units[0].shape[1] if base_units else 1
    base = np.concatenate(base_units) if base_units else np.empty((0, width))
    var = np.concatenate(var_units) if var_units else np.empty((0, width))
    method: DrawMethod
    if kind == "latency" and percentile is not None:
        pair = _percentile_draws(base[:, 0], var[:, 0], sizes, percentile / 100, samples, rng)
        method = "window"
    elif kind == "ok_rate":
        pair = _ok_rate_draws(base[:, 0], var[:, 0], sizes, samples, rng)
        method = "cells"
    else:
        parts = (_mean_parts(base, kind), _mean_parts(var, kind))
        if base.shape[0] * samples > exact_limit:
            values = _normal_change(parts, sizes, samples)
            return Draws(values[np.isfinite(values)], samples, "normal")
        pair = _mean_rows(parts, sizes, samples, rng)
        method = "rows"
    with np.errstate(invalid="ignore", divide="ignore"):
        change = (pair[1] - pair[0]) / pair[0]
    change = change[np.isfinite(change) & (pair[0] != 0)]
    return Draws(change, samples, method)


def _gpu_of_means(means: np.ndarray, statistic: str) -> np.ndarray:
    """`gpu_stats_from_means` per row of per-instance means (NaN instances ignored)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        if statistic == "max":
            return np.nanmax(means, axis=1)
        if statistic == "std":
            return np.nanstd(means, axis=1)
        low = np.nanmin(means, axis=1)
        return np.where(low > 0, np.nanmax(means, axis=1) / low, np.nan)


def _gpu_side(
    units: Sequence[np.ndarray], mult: np.ndarray, statistic: str, rng: np.random.Generator
) -> np.ndarray:
    """The GPU statistic per resample: for each draw of a repeat, its time samples drawn
    uniformly (as counts), the statistic of that draw's per-instance means; then the mean
    over every draw (a repeat drawn twice is two draws of its length, each its own
    statistic, as `point_value` takes one per repeat: pooling the two into one longer
    draw would shrink its spread). A resample that draws a repeat whose statistic is
    undefined (an idle instance's imbalance) is undefined, as `point_value` is."""
    total = np.zeros(mult.shape[0])
    weight = np.zeros(mult.shape[0])
    undefined = np.zeros(mult.shape[0], dtype=bool)
    for r, u in enumerate(units):
        if not len(u):
            continue
        valid = ~np.isnan(u)
        filled = np.where(valid, u, 0.0)
        times = mult[:, r]
        for k in range(int(times.max(initial=0))):  # the (k+1)-th draw of this repeat
            drawn = np.flatnonzero(times > k)
            picks = np.full(drawn.size, len(u))
            counts = _uniform_counts(picks, len(u), rng).astype(float)
            with np.errstate(invalid="ignore", divide="ignore"):
                means = (counts @ filled) / (counts @ valid)
            stat = _gpu_of_means(means, statistic)
            ok = np.isfinite(stat)
            total[drawn[ok]] += stat[ok]
            weight[drawn[ok]] += 1.0
            undefined[drawn[~ok]] = True
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(undefined, np.nan, total / weight)


def gpu_draws(
    base_units: Sequence[np.ndarray],
    var_units: Sequence[np.ndarray],
    statistic: str,
    *,
    samples: int,
    rng: np.random.Generator,
    pair_repeats: bool = False,
) -> Draws | None:
    """GPU-balance draws (imbalance, std or max of per-instance means) over time samples
    (one time × instance matrix per repeat), vectorized through row counts; None when the
    repeats of one side have other instance columns (the caller resamples row by row)."""
    if not base_units or not var_units:
        return None
    if len({u.shape[1] for u in base_units}) != 1 or len({u.shape[1] for u in var_units}) != 1:
        return None
    base_mult = _repeat_multiplicity([len(u) for u in base_units], samples, rng)
    pair_repeats = pair_repeats and len(base_units) == len(var_units)
    var_mult = (
        base_mult
        if pair_repeats
        else _repeat_multiplicity([len(u) for u in var_units], samples, rng)
    )
    b = _gpu_side(base_units, base_mult, statistic, rng)
    v = _gpu_side(var_units, var_mult, statistic, rng)
    with np.errstate(invalid="ignore", divide="ignore"):
        change = (v - b) / b
    return Draws(change[np.isfinite(change) & (b != 0)], samples, "unpaired")


def value_draws(
    units: Sequence[np.ndarray],
    kind: str,
    percentile: float | None,
    statistic: str,
    *,
    samples: int,
    rng: np.random.Generator,
    exact_limit: int = EXACT_LIMIT,
) -> np.ndarray:
    """Bootstrap draws of one variant's metric value itself (not a change), by the same
    methods as `paired_draws`: for the intervals of sweep plots."""
    sizes = [len(u) for u in units]
    if not units or sum(sizes) == 0:
        return np.empty(0)
    if kind == "gpu":
        if len({u.shape[1] for u in units}) != 1:
            return np.empty(0)
        mult = _repeat_multiplicity(sizes, samples, rng)
        out = _gpu_side(units, mult, statistic, rng)
        return out[np.isfinite(out)]
    column = np.concatenate(units)
    if kind == "latency" and percentile is not None:
        out = _percentile_draws(column[:, 0], column[:, 0], sizes, percentile / 100, samples, rng)[
            0
        ]
    elif kind == "ok_rate":
        out = _ok_rate_draws(column[:, 0], column[:, 0], sizes, samples, rng)[0]
    else:
        parts = _mean_parts(column, kind)
        if column.shape[0] * samples > exact_limit:
            num, den = parts
            n = float(column.shape[0])
            ratio = num.sum() / den.sum() if den.sum() > 0 else math.nan
            influence = (num - ratio * den) / (den.sum() / n)
            offsets = np.concatenate(([0], np.cumsum(sizes)))
            pieces = [influence[offsets[r] : offsets[r + 1]] for r in range(len(sizes))]
            within = sum(p.size * float(np.var(p)) for p in pieces if p.size)
            totals = [float(p.sum()) for p in pieces if p.size]
            between = len(totals) * float(np.var(totals)) if len(totals) >= 2 else 0.0
            grid = (np.arange(samples) + 0.5) / samples
            z = np.array([NormalDist().inv_cdf(float(g)) for g in grid])
            out = ratio + math.sqrt(within + between) / n * z
        else:
            out = _mean_rows((parts, parts), sizes, samples, rng)[0]
    return out[np.isfinite(out)]


def unpaired_draws(
    stat: Callable[[np.ndarray], float],
    base_units: Sequence[np.ndarray],
    var_units: Sequence[np.ndarray],
    *,
    samples: int,
    rng: np.random.Generator,
    pair_repeats: bool = False,
) -> Draws:
    """Each variant's rows resampled on its own (no shared request ids, or GPU time
    samples). `pair_repeats`: unit i of both is the same repeat (the same workload), so
    each resample draws one set of repeats for both, as the paired bootstrap does."""

    def resample(units: Sequence[np.ndarray], picks: Sequence[int]) -> np.ndarray:
        parts = [units[i][rng.integers(0, len(units[i]), len(units[i]))] for i in picks
                 if len(units[i])]  # fmt: skip
        if not parts:
            return np.empty((0, units[0].shape[1] if units else 1))
        return np.concatenate(parts)

    def picks(n: int) -> Sequence[int]:
        return rng.integers(0, n, n).tolist() if n >= 2 else range(n)

    pair_repeats = pair_repeats and len(base_units) == len(var_units)
    out = np.empty(samples)
    for i in range(samples):
        base_picks = picks(len(base_units))
        var_picks = base_picks if pair_repeats else picks(len(var_units))
        b = stat(resample(base_units, base_picks))
        v = stat(resample(var_units, var_picks))
        out[i] = (v - b) / b if b and math.isfinite(b) else math.nan
    return Draws(out[np.isfinite(out)], samples, "unpaired")
