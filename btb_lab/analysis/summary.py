"""From a stored run to its `summary.json`: derive timings, assign classes, summarize, judge.

Reads only the run directory (manifest + records), never a backend, so a report can
always be rebuilt, and the same stored run always gives the same summary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import ValidationError

from btb_lab.analysis.classes import assign_classes
from btb_lab.analysis.metrics import summarize_variants
from btb_lab.analysis.models import Exclusion, PrimarySpec, Summary, VariantSummary, Verdict
from btb_lab.analysis.scopes import apply_exclusion, common_arrivals
from btb_lab.analysis.speculation import warm_spend
from btb_lab.analysis.verdict import evaluate_verdict
from btb_lab.config.hypothesis import Hypothesis
from btb_lab.errors import UserError
from btb_lab.records import derive_timings
from btb_lab.results import Manifest, StoredFrames, read_events, read_records, read_utilization

__all__ = [
    "AnalyzedRun",
    "StoredRun",
    "analyze_frames",
    "analyze_run",
    "analyze_stored",
    "classified",
    "comparable",
    "incomplete_reason",
    "measured_frames",
    "read_stored_run",
    "summarize_fidelity",
]


@dataclass
class AnalyzedRun:
    run_dir: Path
    manifest: Manifest
    hypothesis: Hypothesis
    records: pd.DataFrame  # with derived timings and final classes, warmup / cooldown out
    utilization: pd.DataFrame  # inside the measured window
    verdict: Verdict
    summary: Summary
    all_records: pd.DataFrame  # every record (timed, classified): the timeline shows them all
    events: pd.DataFrame  # events.parquet (EVENT_COLUMNS)


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
    records, utilization, _ = measured_frames(hypothesis, records, utilization)
    class_names = [rule.name for rule in hypothesis.classes]
    verdict = evaluate_verdict(
        records, utilization, hypothesis.verdict, baseline=hypothesis.baseline,
        variants=variants, seed=hypothesis.seed, failed=failed, incomplete=incomplete,
    )  # fmt: skip
    variant_block = summarize_variants(records, utilization, variants, class_names)
    return records, verdict, variant_block


def classified(hypothesis: Hypothesis, records: pd.DataFrame) -> pd.DataFrame:
    """Records with derived timings and their final classes."""
    records = derive_timings(records)
    records["class"] = assign_classes(records, hypothesis.classes)
    return records


def measured_frames(
    hypothesis: Hypothesis, records: pd.DataFrame, utilization: pd.DataFrame
) -> tuple[pd.DataFrame, pd.DataFrame, Exclusion | None]:
    """The records (timed and classified) and utilization the metrics and the verdict
    cover: without the warmup / cooldown of `verdict.exclude`."""
    return apply_exclusion(classified(hypothesis, records), utilization, hypothesis.verdict.exclude)


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


@dataclass
class StoredRun:
    """A stored run read back, its records timed and classified and the measured window
    applied, before any statistics: what the plots draw, so a report can hand them to
    its drawing process and analyze meanwhile."""

    run_dir: Path
    manifest: Manifest
    hypothesis: Hypothesis
    variants: list[str]
    records: pd.DataFrame
    utilization: pd.DataFrame
    exclusion: Exclusion | None
    all_records: pd.DataFrame
    events: pd.DataFrame


def read_stored_run(run_dir: Path, frames: StoredFrames | None = None) -> StoredRun:
    """The stored run's manifest, hypothesis, records, utilization and events (those of
    `frames` that the run just wrote taken as they are, not read again)."""
    manifest = Manifest.load(run_dir)
    hypothesis = stored_hypothesis(manifest, run_dir)
    variants: list[str] = list(manifest.variants or hypothesis.variants)
    given = frames or StoredFrames(None, None, None)

    def stored(frame: pd.DataFrame | None, read: Callable[..., pd.DataFrame]) -> pd.DataFrame:
        return frame if frame is not None else read(run_dir, variants)

    all_records = classified(hypothesis, stored(given.requests, read_records))
    all_util = stored(given.utilization, read_utilization)
    events = stored(given.events, read_events)
    for given_frame, n, kept in (
        (given.requests, len(all_records), _RECORDS),
        (given.utilization, len(all_util), _SAMPLES),
        (given.events, len(events), _EVENTS),
    ):
        if given_frame is None:
            _check_kept(manifest, run_dir, variants, n, kept)
    records, util, exclusion = apply_exclusion(all_records, all_util, hypothesis.verdict.exclude)
    return StoredRun(run_dir, manifest, hypothesis, variants, records, util, exclusion,
                     all_records, events)  # fmt: skip


# what a manifest entry counts (its field), named as the check says it, and its file
_RECORDS = ("records", "request records", "requests.parquet")
_SAMPLES = ("samples", "utilization samples", "utilization.parquet")
_EVENTS = ("events", "events", "events.parquet")


def _check_kept(
    manifest: Manifest, run_dir: Path, variants: list[str], n: int, kept: tuple[str, str, str]
) -> None:
    """A run read back must hold every record, utilization sample and event its manifest
    counts: with some lost since (parts or parquet deleted, a file corrupted, a disk
    restored from an old copy) its report would be rewritten from what is left (a GPU
    metric undefined, warm copies unseen), so it is refused and the old report stays.
    Entries written before a count was kept (None) count nothing."""
    field, what, name = kept
    counted = sum(getattr(r, field) or 0 for r in manifest.runs if r.variant in variants)
    if n < counted:
        raise UserError(
            f"{run_dir}: the manifest counts {counted:,} {what} but {n:,} can be read "
            f"({name} or parts/ missing or cut short); report.md and summary.json are "
            "left as they were"
        )


def comparable(stored: StoredRun) -> tuple[pd.DataFrame, pd.DataFrame, str | None]:
    """The records and GPU samples the report's tables and plots set side by side, and
    the sentence saying what was cut (None: nothing). An incomplete run's are cut to the
    arrivals every variant with records covered (`common_arrivals`), as its verdict
    compares them."""
    records, util = stored.records, stored.utilization
    if stored.manifest.complete:
        return records, util, None
    present = set(records["variant"].unique()) if len(records) else set()
    names = [v for v in stored.variants if v in present]
    if len(names) < 2:
        return records, util, None
    records, util, recorded, samples_cut = common_arrivals(records, util, names)
    notes = []
    if recorded is not None:
        each = ", ".join(f"{v} {recorded[v]:,}" for v in names)
        n = int((records["variant"] == names[0]).sum())
        notes.append(
            f"the tables and latency plots cover the {n:,} requests that arrived before the "
            f"first one a variant lacks ({each} recorded)"
        )
    if samples_cut:
        notes.append("GPU samples up to the time every variant covered")
    return records, util, "; ".join(notes) or None


def analyze_run(run_dir: Path) -> AnalyzedRun:
    """Everything the report needs, computed from the stored run."""
    return analyze_stored(read_stored_run(run_dir))


def analyze_stored(stored: StoredRun) -> AnalyzedRun:
    """The verdict, metrics and summary of a run read back (`read_stored_run`)."""
    run_dir, manifest, hypothesis = stored.run_dir, stored.manifest, stored.hypothesis
    variants, records, util = stored.variants, stored.records, stored.utilization
    all_records, exclusion, events = stored.all_records, stored.exclusion, stored.events
    verdict = evaluate_verdict(
        records, util, hypothesis.verdict, baseline=hypothesis.baseline, variants=variants,
        seed=hypothesis.seed, failed=manifest.failed_variants,
        incomplete=False if manifest.complete else incomplete_reason(manifest),
    )  # fmt: skip
    records, util, tables_cover = comparable(stored)
    variant_block = summarize_variants(
        records, util, variants, [rule.name for rule in hypothesis.classes]
    )
    for name, spend in warm_spend(events, all_records, variants).items():
        if name in variant_block:
            variant_block[name].warm = spend
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
            pool=rule.pool,
            direction=rule.direction,
            min_effect=rule.min_effect,
            multiplicity=rule.multiplicity,
            require_all_repeats=rule.require_all_repeats,
        ),
        verdict=verdict,
        variants=variant_block,
        exclusion=exclusion,
        repeats=len({r.repeat for r in manifest.runs}) or None,
        tables_cover=tables_cover,
    )
    return AnalyzedRun(
        run_dir, manifest, hypothesis, records, util, verdict, summary, all_records, events
    )
