"""From a stored run to its `summary.json`: derive timings, assign classes, summarize, judge.

Reads only the run directory (manifest + records), never a backend, so a report can
always be rebuilt, and the same stored run always gives the same summary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from btb_lab.analysis.classes import assign_classes
from btb_lab.analysis.metrics import derive_timings, summarize_variants
from btb_lab.analysis.verdict import Verdict, evaluate_verdict
from btb_lab.errors import UserError
from btb_lab.hypothesis.schema import Hypothesis
from btb_lab.results import read_manifest, read_records, read_utilization

__all__ = ["AnalyzedRun", "analyze_frames", "analyze_run", "summarize_fidelity"]


@dataclass
class AnalyzedRun:
    run_dir: Path
    manifest: dict[str, Any]
    hypothesis: Hypothesis
    records: pd.DataFrame  # with derived timings and final classes
    utilization: pd.DataFrame
    verdict: Verdict
    summary: dict[str, Any]


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
    failed: list[str] = (),  # type: ignore[assignment]
    incomplete: bool = False,
) -> tuple[pd.DataFrame, Verdict, dict[str, Any]]:
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


def analyze_run(run_dir: Path) -> AnalyzedRun:
    """Everything the report needs, computed from the stored run."""
    manifest = read_manifest(run_dir)
    try:
        hypothesis = Hypothesis.model_validate(manifest["hypothesis"])
    except Exception as exc:  # a manifest edited by hand or from another version
        raise UserError(f"{run_dir}/manifest.json: cannot read the stored hypothesis: {exc}") \
            from None  # fmt: skip
    variants: list[str] = list(manifest.get("variants") or hypothesis.variants)
    records = read_records(run_dir, variants)
    util = read_utilization(run_dir, variants)
    failed = sorted({r["variant"] for r in manifest.get("runs", []) if r.get("status") == "failed"})
    complete = bool(manifest.get("complete"))
    records, verdict, variant_block = analyze_frames(
        hypothesis, records, util, variants=variants, failed=failed, incomplete=not complete
    )
    summary = {
        "hypothesis": hypothesis.id,
        "title": hypothesis.title,
        "run_id": manifest.get("run_id"),
        "backend": manifest.get("backend"),
        "complete": complete,
        "fidelity": summarize_fidelity(manifest.get("fidelity") or {}, hypothesis.baseline),
        "baseline": hypothesis.baseline,
        "primary": {
            "metric": hypothesis.verdict.metric,
            "class": hypothesis.verdict.klass,
            "direction": hypothesis.verdict.direction,
            "min_effect": hypothesis.verdict.min_effect,
        },
        "verdict": verdict.to_dict(),
        "variants": variant_block,
    }
    return AnalyzedRun(run_dir, manifest, hypothesis, records, util, verdict, summary)
