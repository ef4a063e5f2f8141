"""Render a stored run: `summary.json`, `report.md` (jinja2, seed log shape) and plots.

`build_report` reads only the run directory, so `btb-lab report` re-renders any run
(complete or interrupted) without a backend and gives the same bytes every time.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pandas as pd

from btb_lab.analysis.models import Comparison, RequestMetrics, Summary
from btb_lab.analysis.scopes import measured_window, rows_where
from btb_lab.analysis.summary import (
    AnalyzedRun,
    StoredRun,
    analyze_stored,
    comparable,
    read_stored_run,
)
from btb_lab.config.metrics import METRICS
from btb_lab.report import describe, forked
from btb_lab.report.plots import write_plots
from btb_lab.report.png import stop_drawing
from btb_lab.results import RunEntry, StoredFrames, stored_frames, write_atomic

__all__ = [
    "build_report",
    "calibration_text",
    "entry_context",
    "kv_source_rows",
    "render_template",
    "result_lines",
]


def _env() -> jinja2.Environment:
    # Templates ship inside the package (btb_lab/report/templates), so an installed wheel
    # renders reports as an editable checkout does.
    return jinja2.Environment(
        loader=jinja2.PackageLoader("btb_lab.report", "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # markdown, not HTML
    )


def render_template(name: str, context: dict[str, Any]) -> str:
    return _env().get_template(name).render(**context)


def _num(value: float | None, digits: int) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


# the seed log's Result line: OK=198/200 TTFT50=1.075 TTFT90=9.384 TPOT90=0.0761 E2E50=5.075
_RESULT_LINE_METRICS = (("ttft_p50", 3), ("ttft_p90", 3), ("tpot_p90", 4), ("e2e_p50", 3))


def _metric_line(m: RequestMetrics, *, counts: bool = True) -> str:
    parts = [f"OK={m.ok}/{m.n}"] if counts else [f"n={m.n}"]
    parts += [
        f"{METRICS[name].label}={_num(m.value(name), digits)}"
        for name, digits in _RESULT_LINE_METRICS
    ]
    return " ".join(parts)


def result_lines(summary: Summary, baseline: str) -> list[str]:
    """The compact Result block: per variant one overall line, one line per class,
    routes, cache hits and GPU balance."""
    lines: list[str] = []
    for name, v in summary.variants.items():
        lines.append(f"[{name}{' (baseline)' if name == baseline else ''}]")
        lines.append(_metric_line(v.all))
        if v.failures:
            lines.append(v.failure_line())
        for cls, m in v.classes.items():
            lines.append(f"{cls}: {_metric_line(m, counts=False)}")
        if v.routes:
            lines.append("Routes: " + ", ".join(f"{n} {r}" for r, n in v.routes.items()))
        cache = v.cache
        if cache.hit_rate is not None:
            median = cache.median_fraction or 0.0
            failed = v.all.n - v.all.ok
            lines.append(
                f"Cache hit: {cache.hit_rate * 100:.1f}% of prompt tokens, "
                f"{cache.requests_with_hit}/{v.all.n} requests, "
                f"median per request {median * 100:.0f}%"
                + (f" (the {failed} failed requests' prompts count as uncached)" if failed else "")
            )
        gpu = v.gpu
        if gpu.max is not None:
            imbalance = "n/a" if gpu.imbalance is None else f"{gpu.imbalance:.2f}x"
            if gpu.idle_repeats:
                imbalance += (f" (an instance sat idle in {gpu.idle_repeats} of "
                              f"{gpu.repeats} repeats)")  # fmt: skip
            std = gpu.std or 0.0
            lines.append(f"GPU imbalance={imbalance} std={std * 100:.1f}% max={gpu.max * 100:.1f}%")
        warm = v.warm
        if warm.prefills:
            lines.append(
                f"Speculative prefill: {warm.prefills} actions, {warm.prefill_tokens:,} tokens "
                f"= {warm.prefill_s:.2f} instance-s; on decoys (jobs of ≤ "
                f"{warm.decoy_max_requests} requests) {warm.decoy_prefill_tokens:,} tokens = "
                f"{warm.decoy_prefill_s:.2f} instance-s"
            )
    return lines


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f}"


def kv_source_rows(runs: list[RunEntry]) -> list[dict[str, str]]:
    """Per run and instance, where prompt KV came from (real clusters only; the cluster
    backend stores it as `extra.metrics.kv_sources`): local prefix-cache hits, external
    hits (KV received through the connector), computed tokens, and the KV moved in. A
    `total` row per run sums the KV moved."""
    rows: list[dict[str, str]] = []
    for entry in runs:
        sources = (entry.extra.get("metrics") or {}).get("kv_sources")
        if not sources:
            continue
        label = f"{entry.variant} r{entry.repeat + 1}"
        total_bytes = total_s = transfers = 0.0
        for name, kv in sorted(sources.items()):
            rows.append({
                "run": label, "instance": name,
                "prompt": f"{kv['prompt_tokens']:.0f}", "local": f"{kv['local_hit_tokens']:.0f}",
                "external": f"{kv['external_hit_tokens']:.0f}",
                "computed": f"{kv['computed_tokens']:.0f}",
                "mib": _mib(kv["kv_bytes"]), "seconds": f"{kv['kv_transfer_s']:.3f}",
                "transfers": f"{kv['kv_transfers']:.0f}",
            })  # fmt: skip
            total_bytes += kv["kv_bytes"]
            total_s += kv["kv_transfer_s"]
            transfers += kv["kv_transfers"]
        rows.append({
            "run": label, "instance": "total", "prompt": "", "local": "", "external": "",
            "computed": "", "mib": _mib(total_bytes), "seconds": f"{total_s:.3f}",
            "transfers": f"{transfers:.0f}",
        })  # fmt: skip
    return rows


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}%"


_OUTCOME_WORDS = {
    "holds": "beyond",
    "straddles": "straddles (needs more repeats)",
    "small": "within (short of it)",
    "noise": "within (no effect)",
    "reversed": "reversed",
    "undefined": "undefined",
}
_METHOD_WORDS = {
    "window": "paired bootstrap, exact (quantile window + aggregate cells)",
    "cells": "paired bootstrap, exact (outcome cells)",
    "rows": "paired bootstrap, exact (rows drawn by index)",
    "normal": "normal approximation of the paired bootstrap (run too large to resample rows)",
    "unpaired": "bootstrap of each variant's time samples (or requests without shared ids) on "
    "its own, the same repeats drawn for both",
}


def _agreement(c: Comparison) -> str:
    total = sum(x is not None for x in c.repeat_changes)
    if total < 2:
        return "1 repeat" if total == 1 else "n/a"
    text = f"{c.repeats_agree}/{total}"
    if c.repeats_contradict:
        text += f" ({c.repeats_contradict} against)"
    unchanged = total - c.repeats_agree - c.repeats_contradict
    return text + (f" ({unchanged} unchanged)" if unchanged else "")


def _level(c: Comparison) -> str:
    return "n/a" if c.level is None else f"{c.level * 100:.4g}%"


def _comparisons(run: AnalyzedRun) -> list[dict[str, str]]:
    rows = []
    metric = run.hypothesis.verdict.metric
    for name, vv in run.summary.verdict.variants.items():
        primary = vv.primary
        if primary is None:
            continue
        # a declared class the primary is already scoped to is its row already
        same = (primary.scope, primary.pool)
        comps = [primary, *(c for c in vv.per_class if (c.scope, c.pool) != same)]
        for c in comps:
            scope = c.scope + (f", pool {c.pool}" if c.pool else "")
            p = "n/a" if c.p_value is None else f"{c.p_value:.3g}"
            if c.adjustment == "holm" and c.p_adjusted is not None:
                p += f" → {c.p_adjusted:.3g}"
            rows.append({
                "variant": name, "scope": scope, "metric": metric,
                "baseline": _num(c.baseline, 4), "value": _num(c.value, 4),
                "change": _pct(c.change), "ci": f"[{_pct(c.ci_low)}, {_pct(c.ci_high)}]",
                "level": _level(c), "outcome": _OUTCOME_WORDS[c.outcome], "p": p,
                "repeats": _agreement(c),
            })  # fmt: skip
    return rows


def _statistics(run: AnalyzedRun) -> list[str]:
    """How the intervals were made and adjusted, and how the repeats agree, in words."""
    rule = run.hypothesis.verdict
    lines: list[str] = []
    primaries = {n: vv.primary for n, vv in run.summary.verdict.variants.items() if vv.primary}
    methods = sorted({c.method for c in primaries.values() if c.method})
    if methods:
        lines.append(
            f"Intervals: {rule.bootstrap_samples} resamples, "
            + "; ".join(_METHOD_WORDS.get(m, m) for m in methods)
            + f"; outcomes read off the interval against the {rule.min_effect * 100:g}% "
            "minimum effect (beyond → VALIDATED, within or reversed → REJECTED, straddling "
            "→ INCONCLUSIVE)."
        )
    k = max((c.comparisons for c in primaries.values()), default=1)
    if any(c.adjustment == "holm" for c in primaries.values()):
        half_alpha = (1 - rule.confidence) / 2
        lines.append(
            f"Multiplicity: {k} variants against `{run.hypothesis.baseline}`, primary "
            'intervals Holm-adjusted (step-down on the one-sided bootstrap p of "not beyond '
            'the minimum effect"; levels per comparison in the table); a one-sided p '
            f"passes below half of 1 − {rule.confidence:g}, so an adjusted p reads against "
            f"{half_alpha:.3g}, not {2 * half_alpha:.3g}; per-class checks unadjusted."
        )
    elif len(primaries) >= 2 and rule.multiplicity == "holm":  # a family of one or none
        defined = sum(c.p_value is not None for c in primaries.values())
        lines.append(f"Multiplicity: {len(primaries)} comparisons, {defined} of them "
                     "defined, so Holm's adjustment has nothing to adjust.")  # fmt: skip
    elif len(primaries) >= 2:
        lines.append(f"Multiplicity: {len(primaries)} comparisons, not adjusted "
                     "(`verdict.multiplicity: none`).")  # fmt: skip
    else:
        lines.append("Multiplicity: one comparison, nothing to adjust.")
    for name, c in primaries.items():
        total = sum(x is not None for x in c.repeat_changes)
        if total >= 2:
            changes = ", ".join(_pct(x) for x in c.repeat_changes)
            against = f", {c.repeats_contradict} against" if c.repeats_contradict else ""
            lines.append(
                f"Repeats ({name}): {c.repeats_agree} of {total} agree in direction{against} "
                f"({changes})" + ("; every repeat must agree" if rule.require_all_repeats else "")
            )
        elif total == 1:
            lines.append(f"Repeats ({name}): one repeat, no direction check across repeats.")
    return lines


def _breakdown(summary: Summary, attr: str, limit: int = 40) -> list[dict[str, str]]:
    """Rows of the per-pool / per-window table: one per scope × variant."""
    rows: list[dict[str, str]] = []
    scopes: list[str] = []
    for v in summary.variants.values():
        for key in getattr(v, attr):
            if key not in scopes:
                scopes.append(key)
    for scope in scopes[:limit]:
        for name, v in summary.variants.items():
            m = getattr(v, attr).get(scope)
            if m is None:
                continue
            rows.append({
                "scope": scope, "variant": name, "ok": f"{m.ok}/{m.n}",
                "ttft_p50": _num(m.ttft_p50, 3), "ttft_p90": _num(m.ttft_p90, 3),
                "ttft_p99": _num(m.ttft_p99, 3), "ttft_mean": _num(m.ttft_mean, 3),
                "e2e_p50": _num(m.e2e_p50, 3), "e2e_p90": _num(m.e2e_p90, 3),
            })  # fmt: skip
    return rows


def _repeats_text(run: AnalyzedRun) -> str:
    hyp = run.hypothesis
    done = run.summary.repeats or hyp.repeats
    auto = hyp.auto_repeats
    if auto is None:
        return str(done)
    target = auto.half_width if auto.half_width is not None else hyp.verdict.min_effect
    text = (
        f"{done} (auto: {auto.min} to {auto.max}, until every primary interval's half-width "
        f"is at most {target * 100:g} points"
    )
    widths = [vv.primary.half_width for vv in run.summary.verdict.variants.values()
              if vv.primary is not None]  # fmt: skip
    reached = all(w is not None and w <= target + 1e-12 for w in widths)
    if done >= auto.max and not reached:  # the cap stopped it, said
        known = [w for w in widths if w is not None]
        widest = (f"the widest is {max(known) * 100:.1f} points" if len(known) == len(widths)
                  else "an interval is undefined")  # fmt: skip
        text += f"; not reached at the maximum, {widest}"
    return text + ")"


def _exclusion_text(run: AnalyzedRun) -> str:
    ex = run.summary.exclusion
    if ex is None:
        return ""
    parts = []
    if ex.first_s or ex.last_s:
        parts.append(f"requests arriving in the first {ex.first_s:g} s and last {ex.last_s:g} s")
    if ex.first_requests or ex.last_requests:
        parts.append(f"the first {ex.first_requests} and last {ex.last_requests} requests")
    counts = ", ".join(
        f"{name} {ex.excluded.get(name, 0)} of {ex.excluded.get(name, 0) + ex.kept.get(name, 0)}"
        for name in run.summary.variants
    )
    return (
        "Warmup / cooldown excluded from every metric and the verdict (by target send time, "
        f"the same on every backend): {' and '.join(parts)} of each repeat; left out: {counts}."
    )


# facts already printed elsewhere in the report (variants, topology) or too bulky for it;
# summary.json and manifest.json keep them all
_FIDELITY_HIDDEN = frozenset({"per_variant", "policy", "policy_params", "topology", "stats"})


def _shown_fidelity(settings: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v
        for k, v in settings.items()
        if k not in _FIDELITY_HIDDEN and not isinstance(v, dict | list)
    }


def calibration_text(fidelity: dict[str, Any]) -> str | None:
    """Which costs are calibrated, and to what, and which are not: the cost model's
    `costs.calibrated` / `costs.not_calibrated` facts as one sentence (None when the run
    recorded neither, as a real cluster's does: its numbers are measured)."""
    calibrated = fidelity.get("costs.calibrated")
    not_calibrated = fidelity.get("costs.not_calibrated")
    if calibrated is None and not_calibrated is None:
        return None
    parts = []
    if calibrated:
        parts.append("calibrated: " + "; ".join(calibrated) + ".")
    else:
        parts.append("no cost is calibrated to measurements or published figures.")
    if not_calibrated:
        parts.append("Not calibrated (presets): " + "; ".join(not_calibrated) + ".")
    parts.append(
        "Only the figures a profile was fitted to are reproduced by construction; TTFT "
        "under queueing, E2E, GPU balance and cache hits follow from these costs and are "
        "not calibrated."
        if calibrated
        else "Every number is the roofline model's, not a calibrated one."
    )
    return " ".join(parts)


def entry_context(run: AnalyzedRun, timeline: pd.DataFrame | None = None) -> dict[str, Any]:
    """Everything the report and log templates print, preformatted (`timeline`: the first
    repeat's events, when the caller has them already)."""
    hyp = run.hypothesis
    manifest = run.manifest
    summary = run.summary
    runs = manifest.runs
    counts = sorted({r.requests for r in runs})
    requests_per_run: Any = manifest.requests_per_run
    if len(counts) > 1:
        requests_per_run = f"{counts[0]}–{counts[-1]}"
    elif counts:
        requests_per_run = counts[0]
    fidelity = _shown_fidelity(summary.fidelity)
    per_variant_fidelity = {
        name: shown
        for name, diff in summary.fidelity.get("per_variant", {}).items()
        if (shown := _shown_fidelity(diff))
    }
    return {
        "id": hyp.id,
        "title": hyp.title,
        "claim": hyp.claim.strip(),
        "prior_evidence": (hyp.prior_evidence or "").strip(),
        "seed_verdict": hyp.seed_verdict,
        "backend": summary.backend,
        "telemetry": manifest.telemetry_source or "",
        "model": describe.model(hyp),
        "topology": describe.topology(hyp, summary.backend),
        "workload": describe.workload(hyp),
        "requests": requests_per_run if requests_per_run is not None else "n/a",
        "time_scale": f"{hyp.workload.time_scale:g}",
        "block_tokens": hyp.workload.block_tokens,
        "repeats": _repeats_text(run),
        "seed": hyp.seed,
        "variants": [describe.variant_text(hyp, n) for n in manifest.variants or hyp.variants],
        "fidelity": [f"{k}={v}" for k, v in fidelity.items()],
        "calibration": calibration_text(summary.fidelity),
        "aliases": manifest.aliases,
        "run_options": manifest.run_options(),
        "notes": manifest.notes,
        "per_variant_fidelity": [
            f"{name}: " + ", ".join(f"{k}={v}" for k, v in diff.items())
            for name, diff in per_variant_fidelity.items()
        ],
        "rule": describe.rule(hyp),
        "result_lines": result_lines(summary, hyp.baseline),
        "engine_lines": describe.engine_lines(runs),
        "connector_lines": describe.connector_lines(runs),
        "kv_source_rows": kv_source_rows(runs),
        "comparisons": _comparisons(run),
        "statistics": _statistics(run),
        "exclusion": _exclusion_text(run),
        "pools": _breakdown(summary, "pools"),
        "windows": _breakdown(summary, "windows"),
        "windows_total": len({w for v in summary.variants.values() for w in v.windows}),
        "timeline_origins": _origins(
            timeline if timeline is not None else first_repeat_events(run)
        ),
        "verdict": summary.verdict,
        "complete": summary.complete,
        "tables_cover": summary.tables_cover,
        "runs_done": manifest.runs_ok,
        "runs_planned": manifest.runs_planned,
        "failures": [
            {"run": f"{r.variant} r{r.repeat + 1}", "error": r.error, "file": r.error_file}
            for r in runs
            if r.status == "failed"
        ],
        "run_error": manifest.error,
        "run_error_file": manifest.error_file,
        "run_id": summary.run_id or run.run_dir.name,
        "run_dir": str(run.run_dir),
        "plots": [],
    }


_ORIGIN_WORDS = {
    "engine": "recorded by the simulator's engine",
    "router": "recorded by the router as it happened",
    "policy": "the policy's own decisions",
    "vllm_metrics": "vLLM's /metrics gauges, scraped periodically",
    "records": "reconstructed from the request records' time stamps",
}
_ORIGIN_NOTES = {
    ("warm_copy", "policy"): "the copy starts when decided and lands after the cost model's "
    "transfer time (setup + bytes / link bandwidth; a busy link's wait is not seen)",
    ("waiting", "records"): "a request waits from its send until its prefill starts",
    ("running", "records"): "a request runs from its prefill start until it finishes",
    ("kv_transfer", "records"): "from the first token back by the request's kv_transfer_s",
}


def first_repeat_events(run: StoredRun | AnalyzedRun) -> pd.DataFrame:
    """The first repeat's events as the timeline draws them (stored, plus what the records
    reconstruct)."""
    from btb_lab.analysis.timeline import timeline_events

    records = run.all_records
    if records.empty:
        return run.events
    first = rows_where(records, records["repeat"] == records["repeat"].min())
    events = run.events
    if not events.empty:
        events = events[events["repeat"] == first["repeat"].min()]
    return timeline_events(first, events)


def _origins(merged: pd.DataFrame) -> list[str]:
    """Where each kind of timeline event came from (events.parquet's `origin`)."""
    if merged.empty:
        return []
    lines = []
    for kind, rows in merged.groupby("kind", sort=True):
        words = []
        for origin in sorted(set(rows["origin"].astype(str).unique())):
            note = _ORIGIN_NOTES.get((str(kind), origin))
            words.append(_ORIGIN_WORDS.get(origin, origin) + (f" ({note})" if note else ""))
        lines.append(f"`{kind}`: " + "; ".join(words))
    return lines


def _excluded_spans(run: StoredRun | AnalyzedRun) -> list[tuple[float, float]]:
    """The warmup and cooldown of the first repeat, as time spans for the timeline."""
    rule = run.hypothesis.verdict.exclude
    rows = run.all_records
    if rule is None or not rule.active or rows.empty:
        return []
    rows = rows[
        (rows["repeat"] == rows["repeat"].min()) & (rows["variant"] == rows["variant"].iloc[0])
    ]
    window = measured_window(rows, rule)
    if window is None:
        return []
    start = float(rows["arrival_s"].min())
    end = float(np.nanmax(rows["finish_s"].to_numpy(float)))
    return [(start, window[0]), (window[1], end)]


def _plots(stored: StoredRun, timeline: pd.DataFrame) -> functools.partial[list[tuple[str, str]]]:
    """`write_plots` for a stored run, ready to call (here, or pickled to a child)."""
    records, util, _ = comparable(stored)  # an incomplete run's: what every variant covered
    return functools.partial(
        write_plots, stored.run_dir / "plots", records, util,
        list(stored.variants), [r.name for r in stored.hypothesis.classes],
        all_records=stored.all_records, events=timeline, excluded=_excluded_spans(stored),
    )  # fmt: skip


def plots_from_parts(run_dir: Path, variant_order: list[str]) -> list[tuple[str, str]]:
    """The plots `build_report` draws, from the record parts (`stored_frames`): in the
    run's drawing child, while the run converts the same parts and analyses them."""
    stored = read_stored_run(run_dir, stored_frames(run_dir, variant_order))
    return _plots(stored, first_repeat_events(stored))()


def draw_from_parts(run_dir: Path, variant_order: list[str]) -> forked.Warm | None:
    """The run's drawing child, given the plots of the records all in the parts now
    (`plots_from_parts`), for `build_report`; None when there is none."""
    worker = forked.take_warm()
    if worker is not None and not worker.send(plots_from_parts, run_dir, list(variant_order)):
        return None
    return worker


def build_report(
    run_dir: Path, frames: StoredFrames | None = None, drawing: forked.Warm | None = None
) -> AnalyzedRun:
    """Analyze a stored run and (re)write `summary.json`, `plots/` and `report.md`. The
    plots need no statistics: the run's drawing child draws them beside the analysis
    (`drawing`: already at it, `draw_from_parts`). `frames`: what the run that just
    stored itself wrote (`finalize_parquet`), taken instead of reading it back."""
    stored = read_stored_run(run_dir, frames)
    timeline = first_repeat_events(stored)
    draw = _plots(stored, timeline)
    worker = drawing if drawing is not None else forked.take_warm()  # matplotlib imported
    try:
        if worker is not None and drawing is None:
            worker.send(draw)
        run = analyze_stored(stored)
        run.summary.save(run_dir)
        context = entry_context(run, timeline)
        drawn = worker.result() if worker is not None else None
    finally:
        stop_drawing(worker, run_dir / "plots")
    if drawn is None:
        context["plots"] = draw()
    else:
        context["plots"] = [(str(title), str(path)) for title, path in drawn]
    write_atomic(run_dir / "report.md", render_template("report.md.j2", context))
    return run
