"""Render a comparison of stored runs (`btb-lab compare`): compare.json, compare.md and the
overlaid CDFs (log time axis) of TTFT and E2E per variant, reference solid, model dashed."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from btb_lab.analysis.compare import (
    Comparison,
    SideRun,
    compare_side_runs,
    load_side_runs,
    split_sides,
    summary_errors,
)
from btb_lab.config.metrics import METRICS
from btb_lab.errors import UserError
from btb_lab.report.render import render_template
from btb_lab.results import MANIFEST, write_json

__all__ = ["write_comparison"]

_META = {"Software": None}


def _pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x * 100:+.1f}%"


def _spread(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def _rows(comparison: Comparison) -> list[dict[str, str]]:
    rows = []
    for g in comparison.gaps:
        within = g.within_spread
        rows.append({
            "variant": g.variant, "scope": g.scope, "metric": METRICS[g.metric].label,
            "reference": _num(g.reference), "model": _num(g.model), "error": _pct(g.error),
            "spread": _spread(g.spread),
            "within": "n/a" if within is None else ("yes" if within else "no"),
        })  # fmt: skip
    return rows


def _cdf_plots(comparison: Comparison, runs: list[SideRun], out_dir: Path) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reference, model = split_sides(runs)
    written = []
    plots = out_dir / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    for column, label in (("ttft_s", "TTFT"), ("e2e_s", "E2E")):
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for i, variant in enumerate(dict.fromkeys(g.variant for g in comparison.gaps)):
            color = f"C{i}"
            for side, style in ((reference, "-"), (model, "--")):
                values = [
                    r.analyzed.records.loc[
                        (r.analyzed.records["variant"] == variant)
                        & r.analyzed.records["ok"].astype(bool), column
                    ].to_numpy(dtype=float)
                    for r in side
                ]  # fmt: skip
                v = np.sort(np.concatenate(values)) if values else np.array([])
                v = v[np.isfinite(v) & (v > 0)]
                if v.size:
                    name = f"{variant} ({side[0].backend})"
                    ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", color=color,
                            linestyle=style, label=name)  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel(f"{label} (s, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{label} CDF: {comparison.reference_backend} (solid) vs "
                     f"{comparison.model_backend} (dashed)")  # fmt: skip
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
        fig.tight_layout()
        name = f"{label.lower()}_cdf.png"
        fig.savefig(plots / name, dpi=100, metadata=_META)
        plt.close(fig)
        written.append((f"{label} CDF", f"plots/{name}"))
    return written


def _check_out_dir(out_dir: Path, run_dirs: list[Path]) -> None:
    """A comparison's folder is its own: never a run directory (its report and plots sit
    beside the records a reader trusts) nor a file."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir}: a file, not a folder")
    resolved = out_dir.resolve()
    if (out_dir / MANIFEST).is_file() or any(resolved == d.resolve() for d in run_dirs):
        raise UserError(
            f"--out {out_dir}: a run directory; write the comparison to a folder of its own"
        )


def write_comparison(run_dirs: list[Path], out_dir: Path, *, force: bool = False) -> Comparison:
    """Compare the runs and write compare.json, compare.md and plots/ into `out_dir`."""
    if len(run_dirs) < 2:
        raise UserError("compare needs at least two run directories")
    _check_out_dir(out_dir, run_dirs)
    runs = load_side_runs(run_dirs)
    comparison = compare_side_runs(runs, force=force)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "compare.json", comparison.model_dump(mode="json"))
    context: dict[str, Any] = {
        "c": comparison,
        "reference_runs": ", ".join(f"`{r}`" for r in comparison.reference_runs),
        "model_runs": ", ".join(f"`{r}`" for r in comparison.model_runs),
        "headline": [
            {"variant": variant, **{m: f"{_pct(e['error'])} [{_spread(e['spread'])}]"
                                    for m, e in errors.items()}}
            for variant, errors in summary_errors(comparison).items()
        ],
        "rows": _rows(comparison),
        "primary_label": METRICS[comparison.primary_metric].label
        + ("" if comparison.ranking_scope == "all" else f" ({comparison.ranking_scope})"),
        "plots": _cdf_plots(comparison, runs, out_dir),
        "offsets": [
            {"run": Path(o.run).name, "variant": o.variant, "repeat": o.repeat + 1,
             "ttft": "n/a" if o.ttft_offset_s is None else f"{o.ttft_offset_s * 1e3:+.1f} ms",
             "e2e": "n/a" if o.e2e_offset_s is None else f"{o.e2e_offset_s * 1e3:+.1f} ms"}
            for o in comparison.driver_offsets
        ],
    }  # fmt: skip
    (out_dir / "compare.md").write_text(render_template("compare.md.j2", context), "utf-8")
    return comparison
