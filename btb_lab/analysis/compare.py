"""How far one world's answer is from another's: `btb-lab compare` of stored runs of the same
hypothesis, typically the simulator's run against a real cluster's.

The reference side is the real one (cluster runs; with no cluster run, the first run's
backend). For every variant and scope (all requests, then each class as the *reference*
labelled it, so both sides cover the same requests), and for TTFT, TPOT and E2E × mean,
p50, p90, p99: each side's value over its pooled repeats, the relative error
(model − reference) / reference, and the reference's run-to-run spread — (max − min) /
mean of the per-repeat values across every reference run — beside it: an error means
something only next to the noise of the thing measured. Then whether each variant's verdict
agrees, and whether the variants rank the same way on the hypothesis's primary metric.
Real runs also report the load driver's own offset: client-side mean TTFT and E2E minus the
server's (vLLM's histograms), the part of a measured latency the instrument adds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from btb_lab.analysis.metrics import latency_stat
from btb_lab.analysis.scopes import in_pool
from btb_lab.analysis.summary import AnalyzedRun, analyze_run
from btb_lab.config.hypothesis import Hypothesis
from btb_lab.config.metrics import METRICS
from btb_lab.errors import UserError
from btb_lab.results.manifest import same_contents

__all__ = [
    "COMPARED_METRICS",
    "Comparison",
    "MetricGap",
    "SideRun",
    "compare_runs",
    "compare_side_runs",
    "load_side_runs",
    "split_sides",
    "summary_errors",
]

COMPARED_METRICS: tuple[str, ...] = tuple(
    f"{lat}_{stat}" for lat in ("ttft", "tpot", "e2e") for stat in ("mean", "p50", "p90", "p99")
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MetricGap(_Model):
    """One metric of one variant and scope, on both sides."""

    variant: str
    scope: str
    metric: str
    reference: float | None
    model: float | None
    error: float | None = Field(description="(model − reference) / reference, signed.")
    spread: float | None = Field(
        description="Reference run-to-run spread: (max − min) / mean of per-repeat values."
    )
    reference_repeats: list[float] = Field(default_factory=list)
    model_repeats: list[float] = Field(default_factory=list)
    n_reference: int = 0
    n_model: int = 0

    @property
    def within_spread(self) -> bool | None:
        if self.error is None or self.spread is None:
            return None
        return abs(self.error) <= self.spread


class VerdictAgreement(_Model):
    variant: str
    reference: str | None
    model: str | None
    agrees: bool


class DriverOffset(_Model):
    """Client-measured mean minus the server's own mean (vLLM histograms), per run."""

    run: str
    variant: str
    repeat: int
    ttft_offset_s: float | None
    e2e_offset_s: float | None


class Comparison(_Model):
    """compare.json."""

    hypothesis: str
    reference_backend: str
    model_backend: str
    reference_runs: list[str]
    model_runs: list[str]
    primary_metric: str
    # the requests the ranking is over: the verdict's class and / or pool ("all": every one)
    ranking_scope: str = "all"
    gaps: list[MetricGap]
    verdicts: list[VerdictAgreement]
    # variants best first, of those with a value on both sides; None: fewer than two
    reference_ranking: list[str]
    model_ranking: list[str]
    same_ranking: bool | None
    driver_offsets: list[DriverOffset] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)

    def gap(self, variant: str, metric: str, scope: str = "all") -> MetricGap:
        for g in self.gaps:
            if (g.variant, g.metric, g.scope) == (variant, metric, scope):
                return g
        raise KeyError((variant, metric, scope))


@dataclass
class SideRun:
    """One stored run on one side of the comparison."""

    run_dir: Path
    analyzed: AnalyzedRun

    @property
    def backend(self) -> str:
        return self.analyzed.manifest.backend


def load_side_runs(run_dirs: Sequence[Path]) -> list[SideRun]:
    return [SideRun(Path(d), analyze_run(Path(d))) for d in run_dirs]


def _check_same_experiment(runs: Sequence[SideRun], force: bool) -> list[str]:
    """Refuse runs of different hypotheses or workloads (unless `force`); return warnings."""
    first = runs[0].analyzed
    problems: list[str] = []
    for run in runs[1:]:
        other = run.analyzed
        if other.hypothesis.id != first.hypothesis.id:
            problems.append(
                f"{run.run_dir} is hypothesis {other.hypothesis.id!r}, {runs[0].run_dir} is "
                f"{first.hypothesis.id!r}"
            )
        for what, mine, theirs in (
            ("model", first.hypothesis.model, other.hypothesis.model),
            ("cluster.instances", first.hypothesis.cluster.instances,
             other.hypothesis.cluster.instances),
        ):  # fmt: skip
            if mine != theirs:
                problems.append(f"{run.run_dir} ran another {what} than {runs[0].run_dir}")
        stamps = (first.manifest.trace, other.manifest.trace)
        if None not in stamps and not same_contents(*stamps):
            problems.append(f"{run.run_dir} replayed another version of the trace file than "
                            f"{runs[0].run_dir} (its size or contents differ)")  # fmt: skip
        a = first.hypothesis.workload.model_dump(mode="json")
        b = other.hypothesis.workload.model_dump(mode="json")
        if a != b:
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            problems.append(
                f"{run.run_dir} replays a different workload than {runs[0].run_dir} "
                f"(workload.{', workload.'.join(keys)} differ)"
            )
        elif other.hypothesis.seed != first.hypothesis.seed and _seeded(first.hypothesis):
            problems.append(
                f"{run.run_dir} has seed {other.hypothesis.seed}, {runs[0].run_dir} "
                f"{first.hypothesis.seed}: generated workloads differ"
            )
    if problems and not force:
        raise UserError(
            "runs of different experiments: " + "; ".join(problems)
            + " (pass --force to compare them anyway)"
        )  # fmt: skip
    rule = first.hypothesis.verdict.model_dump(mode="json", by_alias=True)
    for run in runs[1:]:  # the numbers compare; the verdicts answer another question
        judged = run.analyzed.hypothesis
        their_rule = judged.verdict.model_dump(mode="json", by_alias=True)
        keys = [f"verdict.{k}" for k in sorted(set(rule) | set(their_rule))
                if rule.get(k) != their_rule.get(k)]  # fmt: skip
        if judged.baseline != first.hypothesis.baseline:
            keys.insert(0, "baseline")
        if keys:
            problems.append(f"{run.run_dir} judges by another verdict rule than "
                            f"{runs[0].run_dir} ({', '.join(keys)} differ): their verdicts "
                            "need not agree")  # fmt: skip
    for run in runs:  # compared all the same, said
        manifest = run.analyzed.manifest
        if not manifest.complete:
            problems.append(f"{run.run_dir} is incomplete (stopped or failed): its numbers "
                            "cover the runs that finished")  # fmt: skip
        if manifest.failed_variants:
            problems.append(f"{run.run_dir}: runs of {', '.join(manifest.failed_variants)} "
                            "failed")  # fmt: skip
    seen: dict[Path, int] = {}
    for i, run in enumerate(runs):  # a run beside itself agrees with itself: nothing measured
        first_at = seen.setdefault(run.run_dir.resolve(), i)
        if first_at != i:
            problems.append(f"{run.run_dir} is given twice (as {runs[first_at].run_dir}): "
                            "compared with itself, every error is 0 and the verdicts agree "
                            "by construction")  # fmt: skip
    return problems


def _seeded(hypothesis: Hypothesis) -> bool:
    """Whether the seed shapes the workload: a generator, or a trace replayed with
    variation (jitter, resampled windows); a plain trace replays the same requests."""
    workload = hypothesis.workload
    return workload.generator is not None or workload.variation is not None


# a request's class depends on its variant (how much of its prompt was cached, where it
# was routed): labels are looked up per variant, repeat and request
_LABEL_KEY = ["variant", "repeat", "request_id"]


def _reference_classes(reference: Sequence[SideRun]) -> pd.Series:
    """(variant, repeat, request_id) → class as the reference side labelled it."""
    frames = [r.analyzed.records[[*_LABEL_KEY, "class"]].astype({"request_id": str})
              for r in reference]  # fmt: skip
    table = pd.concat(frames).drop_duplicates(_LABEL_KEY, keep="first")
    return table.set_index(_LABEL_KEY)["class"]


def _relabel(frame: pd.DataFrame, labels: pd.Series) -> pd.DataFrame:
    keys = pd.MultiIndex.from_frame(frame[_LABEL_KEY].astype({"request_id": str}))
    out = frame.copy()
    found = labels.reindex(keys).to_numpy()
    out["class"] = np.where(pd.isna(found), out["class"].to_numpy(), found)
    return out


def _values(frames: Sequence[pd.DataFrame], variant: str, scope: str, metric: str) -> tuple[
    float, list[float], int
]:  # fmt: skip
    """Pooled value, per-(run, repeat) values and sample size of one metric."""
    definition = METRICS[metric]
    column = definition.column
    assert column is not None
    pooled: list[np.ndarray] = []
    per_repeat: list[float] = []
    for frame in frames:
        rows = frame[(frame["variant"] == variant) & frame["ok"].astype(bool)]
        if scope != "all":
            rows = rows[rows["class"] == scope]
        for _, rep in rows.groupby("repeat", sort=True):
            values = rep[column].to_numpy(dtype=float)
            values = values[~np.isnan(values)]
            if values.size:
                per_repeat.append(latency_stat(values, definition.statistic))
                pooled.append(values)
    if not pooled:
        return math.nan, [], 0
    allv = np.concatenate(pooled)
    return latency_stat(allv, definition.statistic), per_repeat, int(allv.size)


def _finite(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def _spread(values: Sequence[float]) -> float | None:
    vals = [v for v in values if math.isfinite(v)]
    if len(vals) < 2:
        return None
    mean = float(np.mean(vals))
    return (max(vals) - min(vals)) / mean if mean else None


def _scores(
    frames: Sequence[pd.DataFrame], variants: Sequence[str], metric: str, scope: str,
    pool: str | None,
) -> dict[str, float]:  # fmt: skip
    """`metric` over the requests of `scope` (a class, or "all") and `pool` of each
    variant that has a value: the requests the verdict judges."""
    frames = [in_pool(frame, pool) for frame in frames]
    values = {v: _values(frames, v, scope, metric)[0] for v in variants}
    return {v: value for v, value in values.items() if math.isfinite(value)}


def _same_order(ref: dict[str, float], mod: dict[str, float], ranked: Sequence[str]
                ) -> bool | None:  # fmt: skip
    """Whether the two sides order every pair of variants alike; a pair one side ties
    (the same value: identical policies on a deterministic simulator) is no disagreement,
    whichever way the other side's noise splits it."""
    if len(ranked) < 2:
        return None
    for a, b in itertools.combinations(ranked, 2):
        one, other = ref[a] - ref[b], mod[a] - mod[b]
        if one and other and (one > 0) != (other > 0):
            return False
    return True


def _ties(scores: dict[str, float], ranked: Sequence[str]) -> list[str]:
    return [f"{a} and {b}" for a, b in itertools.combinations(ranked, 2) if scores[a] == scores[b]]


def _ranking(scores: dict[str, float], variants: Sequence[str], direction: str) -> list[str]:
    """Variants best first (the claimed direction is the better one)."""
    sign = 1.0 if direction == "decrease" else -1.0
    return sorted(variants, key=lambda v: (sign * scores[v], variants.index(v)))


def _driver_offsets(run: SideRun) -> list[DriverOffset]:
    """Client-minus-server mean TTFT and E2E of a real run, from each repeat's /metrics delta
    (vLLM's `time_to_first_token_seconds` and `e2e_request_latency_seconds` histograms)."""
    out: list[DriverOffset] = []
    records = run.analyzed.records
    for entry in run.analyzed.manifest.runs:
        delta = (entry.extra.get("metrics") or {}).get("delta") or {}
        if not delta:
            continue
        rows = records[
            (records["variant"] == entry.variant)
            & (records["repeat"] == entry.repeat)
            & records["ok"].astype(bool)
        ]
        offsets: dict[str, float | None] = {}
        for key, column in (("ttft", "ttft_s"), ("e2e", "e2e_s")):
            count = sum(float(m.get(f"{key}_count") or 0) for m in delta.values())
            total = sum(float(m.get(f"{key}_sum") or 0) for m in delta.values())
            client = rows[column].to_numpy(dtype=float)
            client = client[~np.isnan(client)]
            offsets[key] = (
                float(client.mean()) - total / count if count > 0 and client.size else None
            )
        out.append(
            DriverOffset(
                run=str(run.run_dir), variant=entry.variant, repeat=entry.repeat,
                ttft_offset_s=offsets["ttft"], e2e_offset_s=offsets["e2e"],
            )
        )  # fmt: skip
    return out


def split_sides(runs: Sequence[SideRun]) -> tuple[list[SideRun], list[SideRun]]:
    """(reference, model): the cluster runs are the reference when there are any; with one
    backend on both sides (two simulator settings, say), the first run is."""
    backends = [r.backend for r in runs]
    ref_backend = "cluster" if "cluster" in backends else backends[0]
    reference = [r for r in runs if r.backend == ref_backend]
    model = [r for r in runs if r.backend != ref_backend]
    if not model:
        reference, model = list(runs[:1]), list(runs[1:])
    return reference, model


def compare_runs(run_dirs: Sequence[Path], *, force: bool = False) -> Comparison:
    """Compare stored runs of one hypothesis (two or more; the real side is the reference)."""
    if len(run_dirs) < 2:
        raise UserError("compare needs at least two run directories")
    return compare_side_runs(load_side_runs(run_dirs), force=force)


def compare_side_runs(runs: Sequence[SideRun], *, force: bool = False) -> Comparison:
    """`compare_runs` over runs already loaded."""
    warnings = _check_same_experiment(runs, force)
    reference, model = split_sides(runs)
    ref_backend, model_backend = reference[0].backend, model[0].backend
    hyp = reference[0].analyzed.hypothesis
    labels = _reference_classes(reference)
    ref_frames = [r.analyzed.records for r in reference]
    model_frames = [_relabel(r.analyzed.records, labels) for r in model]
    variants = [v for v in reference[0].analyzed.manifest.variants
                if all(v in r.analyzed.manifest.variants for r in runs)]  # fmt: skip
    if not variants:
        raise UserError("the runs share no variant")
    for name in dict.fromkeys(v for r in runs for v in r.analyzed.manifest.variants):
        lacking = [str(r.run_dir) for r in runs if name not in r.analyzed.manifest.variants]
        if lacking:  # said, not dropped without a word
            warnings.append(f"variant {name} is not compared: {', '.join(lacking)} did not run it")
    scopes = ["all", *[c.name for c in hyp.classes]]
    gaps: list[MetricGap] = []
    for variant in variants:
        for scope in scopes:
            for metric in COMPARED_METRICS:
                ref, ref_reps, n_ref = _values(ref_frames, variant, scope, metric)
                mod, mod_reps, n_mod = _values(model_frames, variant, scope, metric)
                if n_ref == 0 and n_mod == 0:
                    continue
                error = (mod - ref) / ref if math.isfinite(ref) and ref else math.nan
                gaps.append(
                    MetricGap(
                        variant=variant, scope=scope, metric=metric, reference=_finite(ref),
                        model=_finite(mod), error=_finite(error), spread=_spread(ref_reps),
                        reference_repeats=[float(v) for v in ref_reps],
                        model_repeats=[float(v) for v in mod_reps],
                        n_reference=n_ref, n_model=n_mod,
                    )
                )  # fmt: skip
    verdicts = []
    ref_verdict = reference[0].analyzed.verdict
    mod_verdict = model[0].analyzed.verdict
    for side in (reference, model):  # a side's own runs that disagree: said, not hidden
        words = {str(r.run_dir): r.analyzed.verdict.word for r in side}
        if len(set(words.values())) > 1:
            shown = ", ".join(f"{run} {word}" for run, word in words.items())
            warnings.append(f"the runs of one side reach different verdicts ({shown}); the "
                            f"verdict agreement is {side[0].run_dir}'s")  # fmt: skip
    for variant in variants:
        if variant == hyp.baseline:
            continue
        a = ref_verdict.variants.get(variant)
        b = mod_verdict.variants.get(variant)
        wa = a.word if a else None
        wb = b.word if b else None
        verdicts.append(VerdictAgreement(variant=variant, reference=wa, model=wb,
                                         agrees=wa == wb))  # fmt: skip
    primary, direction = hyp.verdict.metric, hyp.verdict.direction
    if METRICS[primary].kind != "latency":
        primary, direction = "ttft_p50", "decrease"  # a latency: lower is better
        warnings.append(f"ranking by ttft_p50: the primary metric {hyp.verdict.metric} is not a "
                        "latency compare computes")  # fmt: skip
    scope, pool = hyp.verdict.klass or "all", hyp.verdict.pool
    ref_scores = _scores(ref_frames, variants, primary, scope, pool)
    mod_scores = _scores(model_frames, variants, primary, scope, pool)
    # a ranking sets variants side by side: only those with a value on both sides
    ranked = [v for v in variants if v in ref_scores and v in mod_scores]
    ref_rank = _ranking(ref_scores, ranked, direction)
    mod_rank = _ranking(mod_scores, ranked, direction)
    if len(ranked) < len(variants) and len(variants) > 1:
        missing = ", ".join(v for v in variants if v not in ranked)
        warnings.append(f"ranking without {missing}: no {primary} on both sides")
    for world, scores in ((ref_backend, ref_scores), (model_backend, mod_scores)):
        tied = _ties(scores, ranked)
        if tied:  # listed in some order; the comparison does not count it
            warnings.append(f"{', '.join(tied)} tie on {primary} in the {world} run: the "
                            "ranking's agreement leaves that pair out")  # fmt: skip
    offsets = [o for r in reference if r.backend == "cluster" for o in _driver_offsets(r)]
    return Comparison(
        hypothesis=hyp.id,
        reference_backend=ref_backend,
        model_backend=model_backend,
        reference_runs=[str(r.run_dir) for r in reference],
        model_runs=[str(r.run_dir) for r in model],
        primary_metric=primary,
        ranking_scope=" ".join(
            [*([] if scope == "all" else [scope]), *([] if pool is None else [f"{pool} pool"])]
        )
        or "all",
        gaps=gaps,
        verdicts=verdicts,
        reference_ranking=ref_rank,
        model_ranking=mod_rank,
        same_ranking=_same_order(ref_scores, mod_scores, ranked),
        driver_offsets=offsets,
        warnings=warnings,
    )


def summary_errors(comparison: Comparison, metrics: Sequence[str] = ("ttft_p50", "ttft_p90",
                   "e2e_p50")) -> dict[str, Any]:  # fmt: skip
    """Per variant, the headline errors over all requests (for logs and READMEs)."""
    out: dict[str, Any] = {}
    for g in comparison.gaps:
        if g.scope == "all" and g.metric in metrics:
            out.setdefault(g.variant, {})[g.metric] = {"error": g.error, "spread": g.spread}
    return out
