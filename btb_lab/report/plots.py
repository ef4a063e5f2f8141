"""Report plots (matplotlib, Agg), written without timestamps so re-rendering gives the same
files, and built from aggregates so a million-request run renders as fast as a small one:

- `timeline.png` and `timeline_zoom.png`: `timeline_plot.py`.
- `latency_cdf.png`: TTFT and E2E CDFs per variant, overall and per class, on a log time
  axis and a logit fraction axis so the tail (p90, p99, p99.9) gets as much room as the
  median; `pool_cdf.png` the same per pool when there are several.
- `utilization.png`: mean utilization per instance, with the spread across repeats.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from btb_lab.analysis.scopes import rows_where
from btb_lab.report import forked
from btb_lab.report.png import pyplot, save, stop_drawing
from btb_lab.report.timeline_plot import write_timelines

__all__ = ["cdf_points", "write_plots"]


def cdf_points(values: np.ndarray, points: int = 240) -> tuple[np.ndarray, np.ndarray]:
    """An empirical CDF as `points` (value, fraction) pairs spaced evenly on the logit of
    the fraction, from 1/(2n) to 1 − 1/(2n): the same few hundred points for any n, dense
    in both tails."""
    values = values[np.isfinite(values)]
    n = values.size
    if n == 0:
        return np.empty(0), np.empty(0)
    lo = 0.5 / n
    u = np.linspace(math.log(lo / (1 - lo)), math.log((1 - lo) / lo), points)
    levels = 1 / (1 + np.exp(-u))
    # numpy's linear quantiles from one sort (np.quantile partitions once per level)
    ordered = np.sort(values)
    position = levels * (n - 1)
    low = np.floor(position).astype(np.int64)
    high = np.minimum(low + 1, n - 1)
    frac = position - low
    return ordered[low] + (ordered[high] - ordered[low]) * frac, levels


# ---------------------------------------------------------------------------- CDFs


def _cdf_grid(
    plt: Any,
    frame: pd.DataFrame,
    variants: Sequence[str],
    scopes: list[tuple[str, pd.Series | None]],
    title: str,
) -> Any:
    from matplotlib.ticker import FuncFormatter, LogLocator

    latencies = (("ttft_s", "TTFT"), ("e2e_s", "E2E"))
    cols = len(scopes)
    fig, axes = plt.subplots(2, cols, figsize=(4.2 * cols + 0.6, 7.2), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, (column, label) in enumerate(latencies):
        for col, (scope, mask) in enumerate(scopes):
            ax = axes[row][col]
            rows = frame if mask is None else frame[mask]
            drawn = False
            for i, name in enumerate(variants):
                values = rows.loc[rows["variant"] == name, column].to_numpy(float)
                values = values[values > 0]
                x, y = cdf_points(values)
                if x.size < 2:
                    continue
                ax.plot(x, y, color=colors[i % len(colors)], lw=1.6,
                        label=f"{name} (n={values.size})")  # fmt: skip
                drawn = True
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=_log_subs(ax)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
            ax.set_yscale("logit")
            ax.set_ylim(0.005, 0.9995)
            ax.set_yticks([0.01, 0.1, 0.5, 0.9, 0.99, 0.999])
            ax.set_yticklabels(["1%", "10%", "50%", "90%", "99%", "99.9%"])
            ax.minorticks_off()
            ax.yaxis.set_minor_formatter(plt.NullFormatter())
            for q in (0.5, 0.9, 0.99):
                ax.axhline(q, color="0.75", lw=0.8, ls=":", zorder=0)
            ax.grid(alpha=0.3, which="major", axis="x")
            ax.set_title(f"{label}, {scope}", fontsize=10)
            ax.set_xlabel(f"{label} (s, log scale)")
            if col == 0:
                ax.set_ylabel("fraction of requests at or below")
            if drawn:
                ax.legend(fontsize=7, loc="upper left")
    # wrapped to the figure's width (one column is narrower than the title)
    fig.suptitle(textwrap.fill(title, width=int(fig.get_figwidth() * _TITLE_CHARS_PER_IN)),
                 fontsize=11)  # fmt: skip
    fig.tight_layout()
    return fig


_TITLE_CHARS_PER_IN = 13  # 11-point text at the report's dpi, with a margin
_DENSE_TICKS_DECADES = 2.5  # 1-2-5 labels up to this many decades a panel, else powers of 10


def _log_subs(ax: Any) -> tuple[float, ...]:
    """Tick multiples for a log axis: 1, 2 and 5 of each decade when the data span few
    decades, else only the powers of ten, so the labels of a 4-inch panel never overlap."""
    lo, hi = ax.dataLim.intervalx
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo <= 0 or hi <= lo:
        return (1.0, 2.0, 5.0)
    return (1.0, 2.0, 5.0) if math.log10(hi / lo) <= _DENSE_TICKS_DECADES else (1.0,)


def _latency_cdfs(
    plt: Any, plots_dir: Path, ok: pd.DataFrame, variants: Sequence[str], classes: list[str]
) -> list[tuple[str, str]]:
    written: list[tuple[str, str]] = []
    scopes: list[tuple[str, pd.Series | None]] = [("all requests", None)]
    scopes += [(c, ok["class"] == c) for c in classes]
    title = "Latency CDFs per variant (successful requests, each variant's own classes)"
    fig = _cdf_grid(plt, ok, variants, scopes, title)
    save(fig, plots_dir / "latency_cdf.png")
    written.append(("TTFT and E2E CDFs, overall and per class (log time axis)",
                    "plots/latency_cdf.png"))  # fmt: skip
    pools = [str(p) for p in ok["source"].astype(str).unique()]
    if len(pools) >= 2:
        pool_scopes: list[tuple[str, pd.Series | None]] = [
            (f"pool {p}", ok["source"].astype(str) == p) for p in pools
        ]
        fig = _cdf_grid(plt, ok, variants, pool_scopes, "Latency CDFs per pool (source)")
        save(fig, plots_dir / "pool_cdf.png")
        written.append(("TTFT and E2E CDFs per pool (log time axis)", "plots/pool_cdf.png"))
    return written


# ---------------------------------------------------------------------------- utilization


def _utilization(
    plt: Any, plots_dir: Path, utilization: pd.DataFrame, variants: Sequence[str]
) -> list[tuple[str, str]]:
    if utilization.empty:
        return []
    unit = utilization["instance"].astype(str) + "/" + utilization["device"].astype(str)
    per_repeat = (
        utilization.assign(unit=unit).groupby(["variant", "repeat", "unit"])["utilization"].mean()
    )
    means = per_repeat.groupby(["variant", "unit"]).mean()
    spread = per_repeat.groupby(["variant", "unit"]).agg(["min", "max"])
    units = sorted({u for _, u in means.index})
    fig, ax = plt.subplots(figsize=(max(6.4, 0.6 * len(units) * max(len(variants), 1)), 4.0))
    width = 0.8 / max(len(variants), 1)
    xs = np.arange(len(units))
    for i, name in enumerate(variants):
        heights = np.array([100 * float(means.get((name, u), 0.0)) for u in units])
        lo = np.array([100 * float(spread["min"].get((name, u), 0.0)) for u in units])
        hi = np.array([100 * float(spread["max"].get((name, u), 0.0)) for u in units])
        ax.bar(xs + i * width, heights, width, label=name,
               yerr=np.clip(np.vstack([heights - lo, hi - heights]), 0, None),
               capsize=2)  # fmt: skip
    ax.set_xticks(xs + width * (len(variants) - 1) / 2, units, rotation=45, ha="right")
    ax.set_ylabel("mean utilization (%)")
    ax.set_title("Utilization per instance (bars: mean over repeats; whiskers: min–max)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    save(fig, plots_dir / "utilization.png")
    return [("Utilization per instance", "plots/utilization.png")]


def write_plots(
    plots_dir: Path,
    records: pd.DataFrame,
    utilization: pd.DataFrame,
    variants: list[str],
    class_names: list[str],
    *,
    all_records: pd.DataFrame | None = None,
    events: pd.DataFrame | None = None,
    excluded: list[tuple[float, float]] | None = None,
) -> list[tuple[str, str]]:
    """Write the plots; return (title, path relative to the run dir) for each one written.
    `records` are the measured ones (CDFs); `all_records` and `events` feed the timeline,
    `excluded` marks the warmup / cooldown of its repeat."""
    plt = pyplot()
    plots_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("ttft_cdf.png", "class_ttft.png", "timeline_zoom.png", "pool_cdf.png"):
        (plots_dir / stale).unlink(missing_ok=True)
    timeline_records = records if all_records is None else all_records

    def timelines() -> list[tuple[str, str]]:
        return write_timelines(plt, plots_dir, timeline_records,
                               events if events is not None else pd.DataFrame(columns=["repeat"]),
                               variants, excluded or [])  # fmt: skip

    # the timelines in a child beside the rest, when a second core is there (`forked`)
    child = forked.start(timelines)
    try:
        written: list[tuple[str, str]] = []
        ok = rows_where(records, records["ok"].astype(bool)) if len(records) else records
        if len(ok):
            present = {str(c) for c in ok["class"].dropna().unique()}
            classes = [c for c in class_names if c in present]
            written += _latency_cdfs(plt, plots_dir, ok, variants, classes)
        written += _utilization(plt, plots_dir, utilization, variants)
        drawn = child.result() if child is not None else None
    finally:
        stop_drawing(child, plots_dir)
    timeline = [(str(t), str(p)) for t, p in drawn] if drawn is not None else timelines()
    return timeline + written
