"""From a stored run to its `summary.json`: derive timings, assign classes, summarize, judge.

Reads only the run directory (manifest + records), never a backend, so a report can
always be rebuilt, and the same stored run always gives the same summary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import ValidationError

from btb_lab.analysis.classes import assign_classes
from btb_lab.analysis.metrics import summarize_variants
from btb_lab.analysis.models import PrimarySpec, Summary, VariantSummary, Verdict
from btb_lab.analysis.verdict import evaluate_verdict
from btb_lab.config.hypothesis import Hypothesis
from btb_lab.errors import UserError
from btb_lab.records import derive_timings
from btb_lab.results import Manifest, read_records, read_utilization

__all__ = [
    "AnalyzedRun",
    "analyze_frames",
    "analyze_run",
    "incomplete_reason",
    "summarize_fidelity",
]


@dataclass
class AnalyzedRun:
    run_dir: Path
    manifest: Manifest
    hypothesis: Hypothesis
    records: pd.DataFrame  # with derived timings and final classes
    utilization: pd.DataFrame
    verdict: Verdict
    summary: Summary


def summarize_fidelity(per_variant: dict[str, dict[str, Any]], baseline: str) -> dict[str, Any]:
    """One fidelity block: the baseline's settings, plus any variant that differs."""
    if not per_variant:
        return {}
    base_name = baseline if baseline in per_variant else next(iter(per_variant))
    base = dict(per_variant[base_name])
    diffs = {
        name: {k: v for k, v in settings.items() if base.get(k) != v}
        for name, settings in per_variant.items()
        if name != base_name
    }
    diffs = {k: v for k, v in diffs.items() if v}
    if diffs:
        base["per_variant"] = diffs
    return base


def analyze_frames(
    hypothesis: Hypothesis,
    records: pd.DataFrame,
    utilization: pd.DataFrame,
    *,
    variants: list[str],
    failed: Sequence[str] = (),
    incomplete: bool | str = False,
) -> tuple[pd.DataFrame, Verdict, dict[str, VariantSummary]]:
    """Timings, classes, per-variant metrics and the verdict for a set of records."""
    records = derive_timings(records)
    records["class"] = assign_classes(records, hypothesis.classes)
    class_names = [rule.name for rule in hypothesis.classes]
    verdict = evaluate_verdict(
        records, utilization, hypothesis.verdict, baseline=hypothesis.baseline,
        variants=variants, seed=hypothesis.seed, failed=failed, incomplete=incomplete,
    )  # fmt: skip
    variant_block = summarize_variants(records, utilization, variants, class_names)
    return records, verdict, variant_block


def stored_hypothesis(manifest: Manifest, run_dir: Path) -> Hypothesis:
    """The hypothesis a run stored in its manifest."""
    try:
        return Hypothesis.model_validate(manifest.hypothesis)
    except ValidationError as exc:  # a manifest edited by hand or from another version
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise UserError(
            f"{run_dir}/manifest.json: cannot read the stored hypothesis: {where}: {first['msg']}"
        ) from None


def incomplete_reason(manifest: Manifest) -> str:
    """Why a run is incomplete, as the verdict's reason says it."""
    if manifest.error:
        return f"run failed: {manifest.error}"
    if manifest.interrupted:
        return "run incomplete (interrupted)"
    if manifest.finished is None:
        return "run incomplete (it stopped without recording an end: killed?)"
    return "run incomplete"


def analyze_run(run_dir: Path) -> AnalyzedRun:
    """Everything the report needs, computed from the stored run."""
    manifest = Manifest.load(run_dir)
    hypothesis = stored_hypothesis(manifest, run_dir)
    variants: list[str] = list(manifest.variants or hypothesis.variants)
    records = read_records(run_dir, variants)
    util = read_utilization(run_dir, variants)
    records, verdict, variant_block = analyze_frames(
        hypothesis, records, util, variants=variants, failed=manifest.failed_variants,
        incomplete=False if manifest.complete else incomplete_reason(manifest),
    )  # fmt: skip
    rule = hypothesis.verdict
    summary = Summary(
        hypothesis=hypothesis.id,
        title=hypothesis.title,
        run_id=manifest.run_id,
        backend=manifest.backend,
        complete=manifest.complete,
        fidelity=summarize_fidelity(manifest.fidelity, hypothesis.baseline),
        baseline=hypothesis.baseline,
        primary=PrimarySpec(
            metric=rule.metric,
            klass=rule.klass,
            direction=rule.direction,
            min_effect=rule.min_effect,
        ),
        verdict=verdict,
        variants=variant_block,
    )
    return AnalyzedRun(run_dir, manifest, hypothesis, records, util, verdict, summary)
