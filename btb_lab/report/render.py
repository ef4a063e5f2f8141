"""Render a stored run: `summary.json`, `report.md` (jinja2, seed log shape) and plots.

`build_report` reads only the run directory, so `btb-lab report` re-renders any run
(complete or interrupted) without a backend and gives the same bytes every time.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jinja2

from btb_lab.analysis.models import RequestMetrics, Summary
from btb_lab.analysis.summary import AnalyzedRun, analyze_run
from btb_lab.config.hypothesis import Hypothesis
from btb_lab.config.metrics import METRICS
from btb_lab.results import RunEntry, write_atomic

__all__ = [
    "build_report",
    "entry_context",
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
_RESULT_LINE_METRICS: tuple[tuple[str, int], ...] = (
    ("ttft_p50", 3), ("ttft_p90", 3), ("tpot_p90", 4), ("e2e_p50", 3),
)  # fmt: skip


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
        for cls, m in v.classes.items():
            lines.append(f"{cls}: {_metric_line(m, counts=False)}")
        if v.routes:
            lines.append("Routes: " + ", ".join(f"{n} {r}" for r, n in v.routes.items()))
        cache = v.cache
        if cache.hit_rate is not None:
            median = cache.median_fraction or 0.0
            lines.append(
                f"Cache hit: {cache.hit_rate * 100:.1f}% of tokens, "
                f"{cache.requests_with_hit}/{v.all.n} requests, "
                f"median per request {median * 100:.0f}%"
            )
        gpu = v.gpu
        if gpu.max is not None:
            imbalance = "n/a" if gpu.imbalance is None else f"{gpu.imbalance:.2f}x"
            std = gpu.std or 0.0
            lines.append(f"GPU imbalance={imbalance} std={std * 100:.1f}% max={gpu.max * 100:.1f}%")
    return lines


def engine_lines(runs: list[RunEntry]) -> list[str]:
    """Per run, what the engines themselves reported (real clusters only): each instance's
    prefix-cache hit rate over the run from vLLM's /metrics, and the load driver's lag."""
    lines: list[str] = []
    for entry in runs:
        extra = entry.extra
        rates = (extra.get("metrics") or {}).get("cache_hit_rate")
        if not rates:
            continue
        shown = ", ".join(
            f"{name} {'n/a' if rate is None else f'{rate * 100:.1f}%'}"
            for name, rate in sorted(rates.items())
        )
        line = f"{entry.variant} r{entry.repeat + 1}: prefix-cache hit {shown}"
        driver = extra.get("driver") or {}
        if driver.get("lag_p99_ms") is not None:
            line += f"; driver send lag p99 {float(driver['lag_p99_ms']):.2f} ms"
        lines.append(line)
    return lines


def _topology(hyp: Hypothesis) -> str:
    groups = [f"{g.count}×{g.role} ({g.gpus}×{g.gpu})" for g in hyp.cluster.instances]
    conn = hyp.cluster.kv_connector
    text = " + ".join(groups)
    if conn.type != "none":
        text += f", KV connector {conn.type} ({conn.role})"
    return text


def _model(hyp: Hypothesis) -> str:
    if isinstance(hyp.model, str):
        return hyp.model
    return f"{hyp.model.name} ({hyp.model.params:g} params, {hyp.model.layers} layers)"


def _workload(hyp: Hypothesis) -> str:
    w = hyp.workload
    if w.trace is not None:
        source = f"trace `{w.trace.path}` ({w.trace.format})"
    else:
        assert w.generator is not None
        params = ", ".join(f"{k}={v}" for k, v in sorted(w.generator.params.items()))
        source = f"generator `{w.generator.kind}`" + (f" ({params})" if params else "")
    return source


def _variant_text(hyp: Hypothesis, name: str) -> str:
    v = hyp.variants[name]
    params = ", ".join(f"{k}={val}" for k, val in sorted(v.router.params.items()))
    text = f"`{name}`{' (baseline)' if name == hyp.baseline else ''}: {v.router.policy}"
    if params:
        text += f" ({params})"
    overrides = {**{f"sim.{k}": val for k, val in v.sim.items()},
                 **{f"costs.{k}": val for k, val in v.costs.items()},
                 **{f"cluster.{k}": val for k, val in v.cluster.items()}}  # fmt: skip
    if overrides:
        text += "; overrides " + ", ".join(f"{k}={val}" for k, val in sorted(overrides.items()))
    if v.description:
        text += f" — {v.description}"
    return text


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}%"


def _comparisons(run: AnalyzedRun) -> list[dict[str, str]]:
    rows = []
    metric = run.hypothesis.verdict.metric
    for name, vv in run.summary.verdict.variants.items():
        comps = [vv.primary, *vv.per_class] if vv.primary else []
        for c in comps:
            rows.append({
                "variant": name, "scope": c.scope, "metric": metric,
                "baseline": _num(c.baseline, 4), "value": _num(c.value, 4),
                "change": _pct(c.change), "ci": f"[{_pct(c.ci_low)}, {_pct(c.ci_high)}]",
                "outcome": c.outcome,
            })  # fmt: skip
    return rows


# facts already printed elsewhere in the report (variants, topology) or too bulky for it;
# summary.json and manifest.json keep them all
_FIDELITY_HIDDEN = frozenset({"per_variant", "policy", "policy_params", "topology", "stats"})


def _shown_fidelity(settings: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v
        for k, v in settings.items()
        if k not in _FIDELITY_HIDDEN and not isinstance(v, dict | list)
    }


def entry_context(run: AnalyzedRun) -> dict[str, Any]:
    """Everything the report and log templates print, preformatted."""
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
    rule = hyp.verdict
    claim_metric = rule.metric + (f" ({rule.klass})" if rule.klass else "")
    return {
        "id": hyp.id,
        "title": hyp.title,
        "claim": hyp.claim.strip(),
        "prior_evidence": (hyp.prior_evidence or "").strip(),
        "seed_verdict": hyp.seed_verdict,
        "backend": summary.backend,
        "telemetry": manifest.telemetry_source or "",
        "model": _model(hyp),
        "topology": _topology(hyp),
        "workload": _workload(hyp),
        "requests": requests_per_run if requests_per_run is not None else "n/a",
        "time_scale": f"{hyp.workload.time_scale:g}",
        "block_tokens": hyp.workload.block_tokens,
        "repeats": hyp.repeats,
        "seed": hyp.seed,
        "variants": [_variant_text(hyp, n) for n in manifest.variants or hyp.variants],
        "fidelity": [f"{k}={v}" for k, v in fidelity.items()],
        "aliases": manifest.aliases,
        "per_variant_fidelity": [
            f"{name}: " + ", ".join(f"{k}={v}" for k, v in diff.items())
            for name, diff in per_variant_fidelity.items()
        ],
        "rule": f"{claim_metric} {rule.direction}s by at least {rule.min_effect * 100:g}% vs "
        f"`{hyp.baseline}`"
        + (
            "; guards: "
            + ", ".join(
                f"{g.metric}{' (' + g.klass + ')' if g.klass else ''} ≤ {g.max_worse:g} worse"
                for g in rule.guards
            )
            if rule.guards
            else ""
        ),
        "result_lines": result_lines(summary, hyp.baseline),
        "engine_lines": engine_lines(runs),
        "comparisons": _comparisons(run),
        "verdict_word": summary.verdict.word,
        "verdict_reason": summary.verdict.reason,
        "complete": summary.complete,
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


def build_report(run_dir: Path) -> AnalyzedRun:
    """Analyze a stored run and (re)write `summary.json`, `plots/` and `report.md`."""
    from btb_lab.report.plots import write_plots

    run = analyze_run(run_dir)
    run.summary.save(run_dir)
    context = entry_context(run)
    context["plots"] = write_plots(
        run_dir / "plots", run.records, run.utilization,
        list(run.summary.variants), [r.name for r in run.hypothesis.classes],
    )  # fmt: skip
    write_atomic(run_dir / "report.md", render_template("report.md.j2", context))
    return run
