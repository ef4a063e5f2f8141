"""The verdict engine: each variant against the baseline on the primary metric.

Relative change with a bootstrap confidence interval (resampling requests, and repeats
as well when there are two or more). Every variant of a repeat replays the same requests,
so the request-level bootstrap is paired: one draw of request ids per resample, the metric
evaluated on both variants over those same requests; the between-request spread that both
variants share then cancels from the interval of the difference. Records whose request ids
do not overlap fall back to resampling each variant on its own (`Comparison.paired` says
which was used). GPU-utilization metrics resample time samples per variant.
VALIDATED: the interval lies beyond the minimum effect in the claimed direction and every
guard holds. REJECTED: the interval includes no change, stays short of the minimum
effect, or points the other way. PARTIALLY VALIDATED: the claim holds but a guard fails,
or it holds for some declared classes and reverses for others. INCONCLUSIVE: too few
successful requests or failed runs.
The generator is seeded from the hypothesis seed, so a report is reproducible.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from btb_lab.analysis.metrics import gpu_stats_from_means, latency_stat
from btb_lab.analysis.models import Comparison, GuardResult, VariantVerdict, Verdict, VerdictWord
from btb_lab.config.hypothesis import Guard, VerdictRule
from btb_lab.config.metrics import METRICS, MetricDef

__all__ = [
    "VALIDATED",
    "GuardResult",
    "VariantVerdict",
    "Verdict",
    "bootstrap_change",
    "evaluate_verdict",
    "metric_units",
    "paired_units",
    "point_value",
]

VALIDATED: VerdictWord = "VALIDATED"
PARTIAL: VerdictWord = "PARTIALLY VALIDATED"
REJECTED: VerdictWord = "REJECTED"
INCONCLUSIVE: VerdictWord = "INCONCLUSIVE"
_RANK = {VALIDATED: 3, PARTIAL: 2, REJECTED: 1, INCONCLUSIVE: 0}

Stat = Callable[[np.ndarray], float]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


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

        def hit_rate(rows: np.ndarray) -> float:
            rows = rows[~np.isnan(rows).any(axis=1)]
            total = rows[:, 1].sum()
            return float(rows[:, 0].sum() / total) if total > 0 else math.nan

        return hit_rate
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
    definition = METRICS[metric]
    if definition.kind == "gpu":
        rows = util[util["variant"] == variant] if not util.empty else util
        units = []
        for _, rep in rows.groupby("repeat", sort=True):
            unit = rep["instance"].astype(str) + "/" + rep["device"].astype(str)
            matrix = rep.assign(unit=unit).pivot_table(
                index="time_s", columns="unit", values="utilization", aggfunc="mean"
            )
            units.append(matrix.to_numpy(dtype=float))
        return units
    rows = records[records["variant"] == variant]
    if klass is not None:
        rows = rows[rows["class"] == klass]
    units = []
    columns = _unit_columns(definition)
    for _, rep in rows.groupby("repeat", sort=True):
        if definition.kind == "latency":
            good = rep[rep["ok"].astype(bool)]
            arr = good[columns].to_numpy(dtype=float)
            arr = arr[~np.isnan(arr[:, 0])]
        else:
            arr = rep[columns].to_numpy(dtype=float)
        units.append(arr)
    return units


def point_value(units: Sequence[np.ndarray], metric: str) -> float:
    """The metric over all repeats pooled."""
    if not units:
        return math.nan
    return _stat_for(metric)(np.concatenate(units))


def _resample(units: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    if len(units) >= 2:
        chosen = [units[i] for i in rng.integers(0, len(units), len(units))]
    else:
        chosen = list(units)
    parts = [u[rng.integers(0, len(u), len(u))] for u in chosen if len(u)]
    if not parts:
        return np.empty((0, units[0].shape[1] if units else 1))
    return np.concatenate(parts)


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
    definition = METRICS[metric]
    if definition.level == "gpu" or "request_id" not in records.columns:
        return None
    keys = ["repeat", "request_id"]
    columns = _unit_columns(definition)

    def table(name: str) -> pd.DataFrame:
        rows = records[records["variant"] == name]
        out = pd.DataFrame({
            "repeat": rows["repeat"].astype(int).to_numpy(),
            "request_id": rows["request_id"].astype(str).to_numpy(),
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
    if base.empty or var.empty or base.duplicated(keys).any() or var.duplicated(keys).any():
        return None
    base_idx = pd.MultiIndex.from_frame(base[keys])
    var_idx = pd.MultiIndex.from_frame(var[keys])
    if klass is not None:
        universe = pd.MultiIndex.from_frame(base.loc[base["klass"] == klass, keys])
    else:
        universe = base_idx.union(var_idx)
    # `universe` holds the variant's own ids unless restricted to a class; sharing means
    # the baseline's requests (of the class) turn up in the variant
    shared = (base_idx if klass is None else universe).isin(var_idx)
    if universe.empty or not shared.any():
        return None
    universe = universe.sort_values()
    b = base.set_index(keys)[columns].reindex(universe).to_numpy(dtype=float)
    v = var.set_index(keys)[columns].reindex(universe).to_numpy(dtype=float)
    repeats = universe.get_level_values("repeat").to_numpy()
    cuts = np.flatnonzero(np.diff(repeats)) + 1
    return list(np.split(b, cuts)), list(np.split(v, cuts))


def _paired_indices(sizes: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """Row indices into the concatenated units of one paired resample: repeats drawn
    with replacement when there are two or more, then requests within each drawn one."""
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    picks = rng.integers(0, len(sizes), len(sizes)) if len(sizes) >= 2 else range(len(sizes))
    parts = [offsets[i] + rng.integers(0, sizes[i], sizes[i]) for i in picks if sizes[i]]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


class _RankPercentile:
    """A latency percentile over row-index resamples of one column, without sorting or
    partitioning each resample: the column is ranked once, a resample's order statistics
    come from a bincount of its rows' ranks. Same value as `latency_stat` (numpy's linear
    method, same interpolation arithmetic), at a fraction of the cost per resample."""

    def __init__(self, column: np.ndarray, percent: float) -> None:
        valid = ~np.isnan(column)
        order = np.argsort(column[valid], kind="stable")
        self.sorted = column[valid][order]
        ranks = np.empty(order.size, dtype=np.int64)
        ranks[order] = np.arange(order.size)
        self.ranks = np.full(column.size, -1, dtype=np.int64)
        self.ranks[valid] = ranks
        self.quantile = percent / 100

    def __call__(self, rows: np.ndarray) -> float:
        drawn = self.ranks[rows]
        drawn = drawn[drawn >= 0]
        if drawn.size == 0:
            return math.nan
        below = np.cumsum(np.bincount(drawn, minlength=self.sorted.size))
        index = (drawn.size - 1) * self.quantile
        low = math.floor(index)
        high = min(low + 1, drawn.size - 1)
        a, b = self.sorted[np.searchsorted(below, [low, high], side="right")]
        t = index - low
        diff = b - a
        return float(b - diff * (1 - t) if t >= 0.5 else a + diff * t)


def _row_stat(metric: str, units: np.ndarray) -> Callable[[np.ndarray], float]:
    """The metric over the rows `rows` of row-aligned units."""
    definition = METRICS[metric]
    if definition.percentile is not None:
        return _RankPercentile(units[:, 0], definition.percentile)
    if definition.kind == "ok_rate" or (
        definition.kind == "latency" and definition.statistic == "mean"
    ):
        # a mean over the rows that count: successful requests, or for OK rate those sent
        return _ratio_stat(np.nan_to_num(units[:, 0]), ~np.isnan(units[:, 0]))
    full = _stat_for(metric)
    return lambda rows: full(units[rows])


def _ratio_stat(numerator: np.ndarray, counted: np.ndarray) -> Callable[[np.ndarray], float]:
    """sum(numerator) / count(counted) over the rows drawn: a mean over 1-D gathers."""

    def ratio(rows: np.ndarray) -> float:
        count = np.count_nonzero(counted[rows])
        return float(numerator[rows].sum() / count) if count else math.nan

    return ratio


def _seed(*parts: object) -> int:
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


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
    stat = _stat_for(metric)
    base = point_value(base_units, metric)
    value = point_value(var_units, metric)
    change = (value - base) / base if base and math.isfinite(base) else math.nan
    rng = np.random.default_rng(seed)
    draws = np.empty(samples)
    if paired:
        sizes = [len(u) for u in base_units]
        if sizes != [len(u) for u in var_units]:
            raise ValueError("paired bootstrap needs row-aligned units")
        base_stat = _row_stat(metric, np.concatenate(base_units))
        var_stat = _row_stat(metric, np.concatenate(var_units))
    for i in range(samples):
        if paired:
            rows = _paired_indices(sizes, rng)
            b, v = base_stat(rows), var_stat(rows)
        else:
            b = stat(_resample(base_units, rng))
            v = stat(_resample(var_units, rng))
        draws[i] = (v - b) / b if b and math.isfinite(b) else math.nan
    draws = draws[np.isfinite(draws)]
    if draws.size < samples * 0.9:
        return change, math.nan, math.nan
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return change, float(low), float(high)


# ---------------------------------------------------------------------------- decisions


def _pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x * 100:+.1f}%"


def _num(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.4g}"


def _fmt_change(metric: str, cmp: Comparison) -> str:
    label = METRICS[metric].label
    if cmp.scope != "all":
        label = f"{cmp.scope} {label}"
    return f"{label} {_pct(cmp.change)} [{_pct(cmp.ci_low)}, {_pct(cmp.ci_high)}]"


def _outcome(rule: VerdictRule, metric: str, low: float, high: float) -> str:
    if not (math.isfinite(low) and math.isfinite(high)):
        return "undefined"
    sign = -1.0 if rule.direction == "decrease" else 1.0
    lo, hi = sorted((sign * low, sign * high))
    if lo > rule.min_effect:
        return "holds"
    if hi < 0:
        return "reversed"
    if lo <= 0:
        return "noise"
    return "small"


def _compare(
    records: pd.DataFrame,
    util: pd.DataFrame,
    rule: VerdictRule,
    baseline: str,
    variant: str,
    metric: str,
    klass: str | None,
    seed: int,
) -> Comparison:
    aligned = paired_units(records, baseline, variant, metric, klass)
    if aligned is not None:
        base_units, var_units = aligned
    else:
        base_units = metric_units(records, util, baseline, metric, klass)
        var_units = metric_units(records, util, variant, metric, klass)
    change, low, high = bootstrap_change(
        base_units, var_units, metric, samples=rule.bootstrap_samples,
        confidence=rule.confidence, seed=_seed(seed, variant, metric, klass or ""),
        paired=aligned is not None,
    )  # fmt: skip
    base = point_value(base_units, metric)
    value = point_value(var_units, metric)

    def ok_count(v: str) -> int:
        rows = records[records["variant"] == v]
        if klass is not None and aligned is not None and v != baseline:
            # the requests paired on: those of the class in the baseline
            labelled = records[(records["variant"] == baseline) & (records["class"] == klass)]
            keys = ["repeat", "request_id"]
            chosen = pd.MultiIndex.from_frame(labelled[keys].astype({"request_id": str}))
            rows = rows[
                pd.MultiIndex.from_frame(rows[keys].astype({"request_id": str})).isin(chosen)
            ]
        elif klass is not None:
            rows = rows[rows["class"] == klass]
        return int(rows["ok"].astype(bool).sum())

    return Comparison(
        scope=klass or "all",
        baseline=_finite(base),
        value=_finite(value),
        change=_finite(change),
        ci_low=_finite(low),
        ci_high=_finite(high),
        outcome=_outcome(rule, metric, low, high),
        ok_baseline=ok_count(baseline),
        ok_variant=ok_count(variant),
        paired=aligned is not None,
    )


def _guard(
    records: pd.DataFrame, util: pd.DataFrame, guard: Guard, baseline: str, variant: str
) -> GuardResult:
    base = point_value(
        metric_units(records, util, baseline, guard.metric, guard.klass), guard.metric
    )
    value = point_value(
        metric_units(records, util, variant, guard.metric, guard.klass), guard.metric
    )
    worse: float | None
    if not (math.isfinite(base) and math.isfinite(value)):
        worse = None
    elif METRICS[guard.metric].kind == "ok_rate":
        worse = base - value
    elif base == 0:
        worse = 0.0 if value == 0 else math.inf
    else:
        rel = (value - base) / abs(base)
        worse = -rel if METRICS[guard.metric].higher_is_better else rel
    holds = worse is not None and worse <= guard.max_worse + 1e-12
    return GuardResult(
        metric=guard.metric, klass=guard.klass, baseline=_finite(base), value=_finite(value),
        worse_by=worse, max_worse=guard.max_worse, holds=holds,
    )  # fmt: skip


def _guard_text(g: GuardResult) -> str:
    label = METRICS[g.metric].label + (f" ({g.klass})" if g.klass else "")
    if g.worse_by is None:
        return f"{label} undefined"
    if METRICS[g.metric].kind == "ok_rate":
        return f"{label} worse by {g.worse_by * 100:.1f} pt (limit {g.max_worse * 100:.1f} pt)"
    return f"{label} worse by {g.worse_by * 100:.1f}% (limit {g.max_worse * 100:.1f}%)"


def _variant_verdict(
    records: pd.DataFrame,
    util: pd.DataFrame,
    rule: VerdictRule,
    baseline: str,
    variant: str,
    seed: int,
    failed: set[str],
) -> VariantVerdict:
    tag = f"({variant} vs {baseline})"
    broken = sorted({baseline, variant} & failed)
    if broken:
        return VariantVerdict(
            variant=variant,
            word=INCONCLUSIVE,
            reason=f"{', '.join(broken)}: failed or missing runs",
        )
    primary = _compare(records, util, rule, baseline, variant, rule.metric, rule.klass, seed)
    scope = f" {rule.klass}" if rule.klass else ""
    if min(primary.ok_baseline, primary.ok_variant) < rule.min_ok_requests:
        return VariantVerdict(
            variant=variant, word=INCONCLUSIVE, primary=primary,
            reason=f"too few successful{scope} requests: {primary.ok_variant} for {variant}, "
            f"{primary.ok_baseline} for {baseline} (need {rule.min_ok_requests})",
        )  # fmt: skip
    text = f"{_fmt_change(rule.metric, primary)} {tag}"
    effect = f"{rule.min_effect * 100:g}%"
    if primary.outcome == "undefined":
        label = METRICS[rule.metric].label + (f" ({rule.klass})" if rule.klass else "")
        values = f"{_num(primary.baseline)} for {baseline}, {_num(primary.value)} for {variant}"
        why = (
            "an instance with zero mean utilization makes max/min infinite"
            if rule.metric == "gpu_imbalance"
            else "no usable samples or a zero baseline"
        )
        return VariantVerdict(
            variant=variant, word=INCONCLUSIVE, primary=primary,
            reason=f"{label} undefined {tag}: {values} ({why})",
        )  # fmt: skip
    guards = [_guard(records, util, g, baseline, variant) for g in rule.guards]
    per_class = [
        _compare(records, util, rule, baseline, variant, rule.metric, c, seed)
        for c in rule.per_class
    ]
    held = [c.scope for c in per_class if c.outcome == "holds"]
    reversed_ = [c.scope for c in per_class if c.outcome == "reversed"]
    failed_guards = [g for g in guards if not g.holds]
    verdict = VariantVerdict(
        variant=variant, word=REJECTED, reason="", primary=primary, guards=guards,
        per_class=per_class,
    )  # fmt: skip
    if primary.outcome == "holds":
        if failed_guards:
            verdict.word = PARTIAL
            verdict.reason = (
                f"{text}, beyond the {effect} minimum effect, but guard failed: "
                + "; ".join(_guard_text(g) for g in failed_guards)
            )
        elif reversed_:
            verdict.word = PARTIAL
            rev = "; ".join(_fmt_change(rule.metric, c) for c in per_class if c.scope in reversed_)
            verdict.reason = f"{text}, beyond the {effect} minimum effect, but reverses for {rev}"
        else:
            verdict.word = VALIDATED
            verdict.reason = f"{text}, beyond the {effect} minimum effect" + (
                "; guards hold" if guards else ""
            )
        return verdict
    if held and reversed_:
        verdict.word = PARTIAL
        parts = "; ".join(
            _fmt_change(rule.metric, c) for c in per_class if c.scope in held + reversed_
        )
        verdict.reason = (
            f"{text}; holds for {', '.join(held)} but reverses for {', '.join(reversed_)}: {parts}"
        )
        return verdict
    verdict.reason = {
        "reversed": f"{text}, the opposite of the claimed {rule.direction}",
        "noise": f"{text}, within noise",
        "small": f"{text}, smaller than the {effect} minimum effect",
    }[primary.outcome]
    return verdict


def evaluate_verdict(
    records: pd.DataFrame,
    util: pd.DataFrame,
    rule: VerdictRule,
    *,
    baseline: str,
    variants: Sequence[str],
    seed: int,
    failed: Sequence[str] = (),
    incomplete: bool | str = False,
) -> Verdict:
    """Compare every non-baseline variant with the baseline; the strongest result among
    them is the hypothesis's verdict (INCONCLUSIVE when the run is incomplete; a string
    `incomplete` says why, e.g. "run failed: …")."""
    others = [v for v in variants if v != baseline]
    failed_set = set(failed)
    results = {
        v: _variant_verdict(records, util, rule, baseline, v, seed, failed_set) for v in others
    }
    if not others:
        return Verdict(
            word=INCONCLUSIVE, reason=f"no variant to compare with the baseline {baseline!r}"
        )
    if incomplete:
        done = sorted(set(records["variant"].unique()) if len(records) else set())
        return Verdict(
            word=INCONCLUSIVE,
            reason=(incomplete if isinstance(incomplete, str) else "run incomplete (interrupted)")
            + "; variants with records: "
            + (", ".join(done) or "none"),
            variants=results,
        )
    best = max(results.values(), key=lambda r: (_RANK[r.word], -others.index(r.variant)))
    return Verdict(word=best.word, reason=best.reason, variants=results)
