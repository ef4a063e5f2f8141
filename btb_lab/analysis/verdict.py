"""The verdict engine: each variant against the baseline on the primary metric.

Relative change with a bootstrap confidence interval (resampling requests, and repeats
as well when there are two or more). Every variant of a repeat replays the same requests,
so the request-level bootstrap is paired: the same draw of request ids for both variants,
the metric evaluated on both over those requests; the between-request spread both share
then cancels from the interval of the difference. `analysis.bootstrap` makes the draws
exactly in distribution from row counts (a million requests × 1,000 resamples in seconds);
only means of very large runs use a labelled normal approximation. Records whose request
ids do not overlap are resampled per variant (`Comparison.paired`); GPU-utilization
metrics resample time samples per variant. Either way, with two or more repeats run on
both sides, each resample draws one set of repeats for both (the same workloads).

Outcomes are read off the interval, signs taken so positive is the claimed direction and
m is the minimum effect: beyond m (`holds`) → VALIDATED when every guard holds (PARTIALLY
VALIDATED when one fails, or when declared classes split; INCONCLUSIVE when one has no
value to check, e.g. a pool without requests); entirely short of m (`small`,
or `noise` when it holds 0) or entirely against the claim (`reversed`) → REJECTED; holding
effects both beyond m and short of it (`straddles`) → INCONCLUSIVE, needs more repeats.
Too few successful requests or failed runs are INCONCLUSIVE too.

Several variants against one baseline are several looks: with `multiplicity: holm` the
primary intervals follow Holm's step-down procedure on the one-sided bootstrap p-values of
"not beyond m" — the comparison with the smallest p is judged at level 1 − α/k, the next
at 1 − α/(k − 1), …, and once one fails the rest are judged at its level — so the family
of VALIDATED claims keeps the stated error rate. Per repeat, the change on that repeat's
requests alone says whether the repeats agree in direction; `require_all_repeats` turns
one that points against the claim into not confirmed. The hypothesis's verdict is the
strongest of its variants' (VALIDATED > PARTIALLY VALIDATED > INCONCLUSIVE > REJECTED: it
is rejected only when every variant is). The generator is seeded from the hypothesis
seed, so a report is reproducible.

The units and intervals the outcomes are read off live in `intervals.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from btb_lab.analysis.bootstrap import Draws
from btb_lab.analysis.intervals import (
    change_draws,
    metric_units,
    paired_units,
    paired_with_repeats,
    percentile_interval,
    point_value,
    seed_of,
    units_by_repeat,
)
from btb_lab.analysis.models import (
    Comparison,
    GuardResult,
    Outcome,
    VariantVerdict,
    Verdict,
    VerdictWord,
)
from btb_lab.analysis.repeats import distinct_repeats, same_repeats_text
from btb_lab.analysis.scopes import common_arrivals, in_pool, variant_rows
from btb_lab.config.hypothesis import Guard, VerdictRule
from btb_lab.config.metrics import METRICS

__all__ = [
    "VALIDATED",
    "GuardResult",
    "VariantVerdict",
    "Verdict",
    "evaluate_verdict",
    "holm_levels",
]

VALIDATED: VerdictWord = "VALIDATED"
PARTIAL: VerdictWord = "PARTIALLY VALIDATED"
REJECTED: VerdictWord = "REJECTED"
INCONCLUSIVE: VerdictWord = "INCONCLUSIVE"
_RANK = {VALIDATED: 3, PARTIAL: 2, INCONCLUSIVE: 1, REJECTED: 0}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


# ---------------------------------------------------------------------------- decisions


def _pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x * 100:+.1f}%"


def _num(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.4g}"


def _scope_label(metric: str, klass: str | None, pool: str | None) -> str:
    label = METRICS[metric].label
    if klass is not None:
        label = f"{klass} {label}"
    if pool is not None:
        label = f"{label} ({pool} pool)"
    return label


def _fmt_change(metric: str, cmp: Comparison) -> str:
    label = _scope_label(metric, None if cmp.scope == "all" else cmp.scope, cmp.pool)
    return f"{label} {_pct(cmp.change)} [{_pct(cmp.ci_low)}, {_pct(cmp.ci_high)}]"


def _sign(rule: VerdictRule) -> float:
    return -1.0 if rule.direction == "decrease" else 1.0


def _outcome(rule: VerdictRule, low: float, high: float) -> Outcome:
    """Where the interval lies against the minimum effect (see the module docstring)."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return "undefined"
    lo, hi = sorted((_sign(rule) * low, _sign(rule) * high))
    m = rule.min_effect
    if lo > m:
        return "holds"
    if hi < 0:
        return "reversed"
    if hi <= m:
        return "small" if lo > 0 else "noise"
    return "straddles"


def _p_not_beyond(rule: VerdictRule, draws: Draws) -> float | None:
    """One-sided bootstrap p-value of "the effect is not beyond the minimum effect"."""
    if draws.values.size < draws.samples * 0.9:
        return None
    signed = _sign(rule) * draws.values
    return float((np.count_nonzero(signed <= rule.min_effect) + 1) / (signed.size + 1))


def holm_levels(p_values: Sequence[float], confidence: float) -> list[tuple[float, float]]:
    """Holm's step-down procedure on one-sided p-values, as interval levels: for each
    comparison (in input order) the confidence level its interval is judged at, and its
    Holm-adjusted p-value. The i-th smallest p gets level 1 − (1 − confidence) / (k − i + 1)
    until one fails its level (p ≥ α/2 there, α = 1 − confidence); every later one is
    judged at that failing level."""
    k = len(p_values)
    alpha = 1 - confidence
    order = sorted(range(k), key=lambda i: (p_values[i], i))
    out: list[tuple[float, float]] = [(confidence, 1.0)] * k
    stopped: float | None = None
    running = 0.0
    for step, i in enumerate(order):
        factor = k - step
        running = max(running, min(1.0, factor * p_values[i]))
        level = 1 - alpha / factor
        if stopped is None and p_values[i] >= alpha / factor / 2:
            stopped = level
        out[i] = (stopped if stopped is not None else level, running)
    return out


@dataclass
class _Judged:
    """A comparison and the draws behind it (kept until the family is adjusted)."""

    comparison: Comparison
    draws: Draws


def _repeat_agreement(
    rule: VerdictRule, metric: str, per_repeat: list[tuple[np.ndarray, np.ndarray]]
) -> tuple[list[float | None], int, int]:
    changes: list[float | None] = []
    agree = contradict = 0
    for b_units, v_units in per_repeat:
        base = point_value([b_units], metric)
        value = point_value([v_units], metric)
        change = (value - base) / base if base and math.isfinite(base) else math.nan
        if not math.isfinite(change):
            changes.append(None)
            continue
        changes.append(change)
        signed = _sign(rule) * change
        agree += signed > 0
        contradict += signed < 0
    return changes, agree, contradict


def _compare(
    records: pd.DataFrame,
    util: pd.DataFrame,
    rule: VerdictRule,
    baseline: str,
    variant: str,
    metric: str,
    klass: str | None,
    seed: int,
) -> _Judged:
    pool = rule.pool
    records = in_pool(records, pool)
    aligned = paired_with_repeats(records, baseline, variant, metric, klass)
    if aligned is not None:
        _, base_units, var_units = aligned
        per_repeat = list(zip(base_units, var_units, strict=True))
    else:
        base_by = units_by_repeat(records, util, baseline, metric, klass)
        var_by = units_by_repeat(records, util, variant, metric, klass)
        shared = sorted(set(base_by) & set(var_by))
        per_repeat = [(base_by[r], var_by[r]) for r in shared]
        if len(shared) == len(base_by) == len(var_by):
            # the same repeats (workloads) on both sides, in one order: paired on repeats
            base_units, var_units = [base_by[r] for r in shared], [var_by[r] for r in shared]
        else:
            base_units, var_units = list(base_by.values()), list(var_by.values())
    seed_parts: tuple[object, ...] = (seed, variant, metric, klass or "")
    if pool is not None:
        seed_parts += (f"pool:{pool}",)
    draws = change_draws(base_units, var_units, metric, samples=rule.bootstrap_samples,
                   seed=seed_of(*seed_parts), paired=aligned is not None,
                   pair_repeats=aligned is None and len(per_repeat) == len(base_units))  # fmt: skip
    base = point_value(base_units, metric)
    value = point_value(var_units, metric)
    change = (value - base) / base if base and math.isfinite(base) else math.nan
    low, high = percentile_interval(draws, rule.confidence)
    changes, agree, contradict = _repeat_agreement(rule, metric, per_repeat)
    p_value = _p_not_beyond(rule, draws)

    def ok_count(v: str) -> int:
        keys = ["repeat", "request_id"]
        rows = variant_rows(records, v, [*keys, "class", "ok"])
        if klass is not None and aligned is not None and v != baseline:
            # the requests paired on: those of the class in the baseline
            labelled = variant_rows(records, baseline, [*keys, "class"])
            labelled = labelled[labelled["class"] == klass]
            chosen = pd.MultiIndex.from_frame(labelled[keys].astype({"request_id": str}))
            rows = rows[
                pd.MultiIndex.from_frame(rows[keys].astype({"request_id": str})).isin(chosen)
            ]
        elif klass is not None:
            rows = rows[rows["class"] == klass]
        # OK rate is over the requests sent: a variant failing them all is an answer
        ok = rows["ok"].astype(bool)
        return len(rows) if METRICS[metric].kind == "ok_rate" else int(ok.sum())

    comparison = Comparison(
        scope=klass or "all",
        pool=pool,
        baseline=_finite(base),
        value=_finite(value),
        change=_finite(change),
        ci_low=_finite(low),
        ci_high=_finite(high),
        level=rule.confidence,
        outcome=_outcome(rule, low, high),
        ok_baseline=ok_count(baseline),
        ok_variant=ok_count(variant),
        paired=aligned is not None,
        method=draws.method,
        p_value=p_value,
        p_adjusted=p_value,
        repeat_changes=changes,
        repeats_agree=agree,
        repeats_contradict=contradict,
    )
    return _Judged(comparison, draws)


def _adjust(judged: dict[str, _Judged], rule: VerdictRule) -> None:
    """Holm's adjustment of the primary comparisons of every variant (in place)."""
    family = {v: j for v, j in judged.items() if j.comparison.p_value is not None}
    if rule.multiplicity != "holm" or len(family) < 2:
        return
    names = list(family)
    levels = holm_levels([family[v].comparison.p_value or 1.0 for v in names], rule.confidence)
    for name, (level, p_adjusted) in zip(names, levels, strict=True):
        cmp = family[name].comparison
        low, high = percentile_interval(family[name].draws, level)
        cmp.ci_low, cmp.ci_high = _finite(low), _finite(high)
        cmp.level = level
        cmp.outcome = _outcome(rule, low, high)
        cmp.p_adjusted = p_adjusted
        cmp.adjustment = "holm"
        cmp.comparisons = len(family)


def _guard(
    records: pd.DataFrame, util: pd.DataFrame, guard: Guard, baseline: str, variant: str
) -> GuardResult:
    records = in_pool(records, guard.pool)
    # the requests the primary reads: paired, a class scope the baseline's labels (a
    # variant's own class may be other requests, and a guard on the primary's metric
    # and class would contradict it)
    units = paired_units(records, baseline, variant, guard.metric, guard.klass) or (
        metric_units(records, util, baseline, guard.metric, guard.klass),
        metric_units(records, util, variant, guard.metric, guard.klass),
    )
    base, value = (point_value(u, guard.metric) for u in units)
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
        metric=guard.metric, klass=guard.klass, pool=guard.pool, baseline=_finite(base),
        value=_finite(value), worse_by=worse, max_worse=guard.max_worse, holds=holds,
    )  # fmt: skip


def _fewer_ok(records: pd.DataFrame, util: pd.DataFrame, rule: VerdictRule, baseline: str,
              variant: str) -> str:  # fmt: skip
    """Latencies are of successful requests: where the variant completes fewer and no guard
    weighs that, the verdict says so (its latencies may be of the easier requests)."""
    if METRICS[rule.metric].kind != "latency" or any(g.metric == "ok_rate" for g in rule.guards):
        return ""
    ok = _guard(records, util, Guard.model_validate({"metric": "ok_rate", "max_worse": 0.01,
                "class": rule.klass, "pool": rule.pool}), baseline, variant)  # fmt: skip
    if ok.holds or ok.value is None or ok.baseline is None:
        return ""
    return (f"; note: {variant} completed {ok.value:.1%} of its requests, {baseline} "
            f"{ok.baseline:.1%}, and latencies are of successful requests only (an ok_rate "
            "guard weighs this)")  # fmt: skip


def _guard_text(g: GuardResult) -> str:
    label = METRICS[g.metric].label + (f" ({g.klass})" if g.klass else "")
    if g.pool:
        label += f" ({g.pool} pool)"
    if g.worse_by is None:
        return f"{label} undefined"
    if METRICS[g.metric].kind == "ok_rate":
        return f"{label} worse by {g.worse_by * 100:.1f} pt (limit {g.max_worse * 100:.1f} pt)"
    return f"{label} worse by {g.worse_by * 100:.1f}% (limit {g.max_worse * 100:.1f}%)"


def _tag(variant: str, baseline: str, cmp: Comparison) -> str:
    """`(btb vs cache_aware; Holm over 3 comparisons, 98.3% interval; 4 of 5 repeats agree)`."""
    parts = [f"{variant} vs {baseline}"]
    if cmp.adjustment == "holm" and cmp.level is not None:
        parts.append(f"Holm-adjusted over {cmp.comparisons} comparisons, "
                     f"{cmp.level * 100:.4g}% interval")  # fmt: skip
    total = sum(c is not None for c in cmp.repeat_changes)
    if total >= 2:
        text = f"{cmp.repeats_agree} of {total} repeats agree in direction"
        unchanged = total - cmp.repeats_agree - cmp.repeats_contradict
        if unchanged:
            text += f", {unchanged} unchanged"
        parts.append(text)
    return "(" + "; ".join(parts) + ")"


def _decide(
    records: pd.DataFrame,
    util: pd.DataFrame,
    rule: VerdictRule,
    baseline: str,
    variant: str,
    seed: int,
    primary: Comparison,
) -> VariantVerdict:
    tag = _tag(variant, baseline, primary)
    scope = f" {rule.klass}" if rule.klass else ""
    if rule.pool:
        scope += f" {rule.pool}-pool"
        if "source" in records and not bool((records["source"] == rule.pool).any()):
            pools = ", ".join(sorted(map(str, records["source"].dropna().unique()))) or "none"
            return VariantVerdict(
                variant=variant, word=INCONCLUSIVE, primary=primary,
                reason=f"no request is in the pool verdict.pool names, {rule.pool!r}; this "
                f"run's pools (request sources): {pools}",
            )  # fmt: skip
    if min(primary.ok_baseline, primary.ok_variant) < rule.min_ok_requests:
        counted = (  # OK rate is over the requests sent
            f"{scope} requests sent" if METRICS[rule.metric].kind == "ok_rate"
            else f" successful{scope} requests"
        )  # fmt: skip
        return VariantVerdict(
            variant=variant, word=INCONCLUSIVE, primary=primary,
            reason=f"too few{counted}: {primary.ok_variant} for {variant}, "
            f"{primary.ok_baseline} for {baseline} (need {rule.min_ok_requests})",
        )  # fmt: skip
    text = f"{_fmt_change(rule.metric, primary)} {tag}"
    effect = f"{rule.min_effect * 100:g}%"
    if primary.outcome == "undefined":
        label = _scope_label(rule.metric, rule.klass, rule.pool)
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
        _compare(records, util, rule, baseline, variant, rule.metric, c, seed).comparison
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
        beyond = f"{text}, beyond the {effect} minimum effect"
        if rule.require_all_repeats and primary.repeats_contradict:
            against = [
                f"r{i + 1} {_pct(c)}"
                for i, c in enumerate(primary.repeat_changes)
                if c is not None and _sign(rule) * c < 0
            ]
            verdict.word = INCONCLUSIVE
            many = primary.repeats_contradict > 1
            verdict.reason = (
                f"{beyond}, but not confirmed: {primary.repeats_contradict} "
                f"{'repeats point' if many else 'repeat points'} against the claimed "
                f"{rule.direction} ({', '.join(against)}) and every repeat must agree"
            )
        elif any(g.worse_by is not None for g in failed_guards):  # a guard that failed
            # decides, whatever another that cannot be checked would say
            verdict.word = PARTIAL
            verdict.reason = f"{beyond}, but guard failed: " + "; ".join(
                _guard_text(g) for g in failed_guards if g.worse_by is not None
            ) + "".join(
                f"; cannot be checked: {_guard_text(g)}"
                for g in failed_guards if g.worse_by is None
            )  # fmt: skip
        elif failed_guards:  # no value: cannot be checked
            verdict.word = INCONCLUSIVE
            verdict.reason = f"{beyond}, but a guard cannot be checked: " + "; ".join(
                _guard_text(g) for g in failed_guards
            )
        elif reversed_:
            verdict.word = PARTIAL
            rev = "; ".join(_fmt_change(rule.metric, c) for c in per_class if c.scope in reversed_)
            verdict.reason = f"{beyond}, but reverses for {rev}"
        else:
            verdict.word = VALIDATED
            verdict.reason = beyond + ("; guards hold" if guards else "")
        return verdict
    # the declared classes are context here, not a way past the primary: their checks are
    # unadjusted, and a class that holds cannot lift a claim the whole run does not show
    split = ""
    if held or reversed_:
        told = "; ".join(
            _fmt_change(rule.metric, c) for c in per_class if c.scope in held + reversed_
        )
        split = f" (per class, unadjusted: {told})"
    if primary.outcome == "straddles":
        verdict.word = INCONCLUSIVE
        verdict.reason = (
            f"{text}, straddles the {effect} minimum effect: the interval holds effects "
            "beyond it and short of it, so neither the claim nor its rejection is shown "
            f"(needs more repeats){split}"
        )
        return verdict
    verdict.reason = {
        "reversed": f"{text}, the opposite of the claimed {rule.direction}",
        "noise": f"{text}, within noise: the interval holds no change, so no effect of the "
        f"{effect} minimum size is shown",
        "small": f"{text}, smaller than the {effect} minimum effect (the whole interval "
        "is short of it)",
    }[primary.outcome] + split
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
    """Compare every non-baseline variant with the baseline (the family adjusted for
    multiplicity); the strongest result among them is the hypothesis's verdict
    (INCONCLUSIVE when the run is incomplete; a string `incomplete` says why, e.g.
    "run failed: …")."""
    records, util, same = distinct_repeats(records, util)
    verdict = _evaluate(records, util, rule, baseline, variants, seed, failed, incomplete)
    if same:
        verdict.reason += "; " + same_repeats_text(same)
    return verdict


def common_arrivals_of_pair(
    records: pd.DataFrame, util: pd.DataFrame, baseline: str, variant: str
) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """`common_arrivals` for `baseline` and `variant`, and a sentence saying what was cut
    ("" if nothing)."""
    two, samples, recorded, samples_cut = common_arrivals(records, util, [baseline, variant])
    notes: list[str] = []
    if recorded is not None:
        notes.append(
            f"`{variant}` is compared with `{baseline}` on the "
            f"{int((two['variant'] == variant).sum()):,} requests that arrived before the "
            f"first one either lacks ({variant} recorded {recorded[variant]:,}, "
            f"{baseline} {recorded[baseline]:,})"
        )
    if samples_cut:
        notes.append("GPU samples up to the time both covered")
    return two, samples, "; ".join(notes)


def _evaluate(
    records: pd.DataFrame,
    util: pd.DataFrame,
    rule: VerdictRule,
    baseline: str,
    variants: Sequence[str],
    seed: int,
    failed: Sequence[str],
    incomplete: bool | str,
) -> Verdict:
    others = [v for v in variants if v != baseline]
    failed_set = set(failed)
    if not others:
        return Verdict(
            word=INCONCLUSIVE, reason=f"no variant to compare with the baseline {baseline!r}"
        )
    results: dict[str, VariantVerdict] = {}
    judged: dict[str, _Judged] = {}
    pairs: dict[str, tuple[pd.DataFrame, pd.DataFrame]] = {}
    cut: list[str] = []
    for v in others:
        broken = sorted({baseline, v} & failed_set)
        if broken:
            results[v] = VariantVerdict(
                variant=v, word=INCONCLUSIVE, reason=f"{', '.join(broken)}: failed or missing runs"
            )
            continue
        pairs[v] = (records, util)
        if incomplete:
            cut_records, cut_util, dropped = common_arrivals_of_pair(records, util, baseline, v)
            pairs[v] = (cut_records, cut_util)
            if dropped:
                cut.append(dropped)
        judged[v] = _compare(*pairs[v], rule, baseline, v, rule.metric, rule.klass, seed)
    _adjust(judged, rule)
    for v, j in judged.items():
        results[v] = _decide(*pairs[v], rule, baseline, v, seed, j.comparison)
        results[v].reason += _fewer_ok(*pairs[v], rule, baseline, v)
    results = {v: results[v] for v in others}
    if incomplete:
        done = sorted(set(records["variant"].unique()) if len(records) else set())
        return Verdict(
            word=INCONCLUSIVE,
            reason=(incomplete if isinstance(incomplete, str) else "run incomplete (interrupted)")
            + "; variants with records: "
            + (", ".join(done) or "none")
            + "".join(f"; {text}" for text in cut),
            variants=results,
        )
    best = max(results.values(), key=lambda r: (_RANK[r.word], -others.index(r.variant)))
    return Verdict(word=best.word, reason=best.reason, variants=results)
