"""Sweep plots as labelled series: per point and variant, the plotted metric with its
bootstrap interval and the offered and achieved request rates, read from every point's
stored records (`intervals.csv`); `series.png` draws one line per variant across the
swept value (one panel per combination of the other labels), and `pareto.png`, when the
sweep varies the load, latency against achieved throughput with the Pareto frontier.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from btb_lab.sweep.plan import PointTask

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

__all__ = ["LOAD_HINTS", "is_load_column", "pareto_front", "point_series", "write_series_plots"]

# a label column that names one of these varies the offered load
LOAD_HINTS = ("time_scale", "rate")


def is_load_column(column: str) -> bool:
    return any(hint in column.split(".")[-1] for hint in LOAD_HINTS)


def _rates(records: pd.DataFrame, variant: str) -> tuple[float, float]:
    """Offered (arrivals / arrival span) and achieved (successful requests / send-to-finish
    span) requests per second, averaged over repeats."""
    import numpy as np

    offered, achieved = [], []
    rows = records[records["variant"] == variant]
    for _, rep in rows.groupby("repeat"):
        arrival = rep["arrival_s"].to_numpy(float)
        if arrival.size >= 2 and arrival.max() > arrival.min():
            offered.append((arrival.size - 1) / (arrival.max() - arrival.min()))
        finish = rep["finish_s"].to_numpy(float)
        ok = rep["ok"].astype(bool).to_numpy()
        if ok.any():
            span = np.nanmax(finish[ok]) - float(rep["sent_s"].min())
            if span > 0:
                achieved.append(ok.sum() / span)
    return (
        float(np.mean(offered)) if offered else math.nan,
        float(np.mean(achieved)) if achieved else math.nan,
    )


def point_series(
    tasks: Sequence[PointTask], variants: Sequence[str], metric: str, scope: str
) -> pd.DataFrame:
    """One row per point × variant: labels, the metric, its 95% interval, offered and
    achieved rates. Points without a complete run are left out."""
    import pandas as pd

    from btb_lab.analysis.intervals import metric_units, point_value, value_interval
    from btb_lab.analysis.summary import measured_frames, stored_hypothesis
    from btb_lab.errors import UserError
    from btb_lab.results import Manifest, read_records, read_utilization

    rows: list[dict[str, Any]] = []
    for task in tasks:
        run_dir = Path(task.run_dir)
        try:
            manifest = Manifest.load(run_dir)
        except UserError:
            continue
        if not (run_dir / "requests.parquet").is_file():
            continue
        hyp = stored_hypothesis(manifest, run_dir)
        records, util, _ = measured_frames(
            hyp, read_records(run_dir, manifest.variants), read_utilization(run_dir)
        )
        for variant in variants:
            if variant not in set(records["variant"]):
                continue
            klass = None if scope == "all" or scope.startswith("pool:") else scope
            scoped = records
            if scope.startswith("pool:"):
                scoped = records[records["source"].astype(str) == scope[5:]]
            value = point_value(metric_units(scoped, util, variant, metric, klass), metric)
            low, high = value_interval(records, util, variant, metric, scope, seed=hyp.seed)
            offered, achieved = _rates(records, variant)
            rows.append({
                "point_id": task.point_id, **task.labels, "variant": variant, "metric": metric,
                "value": value, "ci_low": low, "ci_high": high, "offered_rps": offered,
                "achieved_rps": achieved,
            })  # fmt: skip
    return pd.DataFrame(rows)


def _wrap(text: str, width: int = 90) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def _x_column(frame: pd.DataFrame, label_columns: Sequence[str]) -> tuple[str | None, bool]:
    """The swept value on the x axis: a numeric label column with the most values, else
    the label column with the most values; whether it is numeric."""
    import pandas as pd

    best: tuple[int, int, str] | None = None
    for column in label_columns:
        values = frame[column].astype(str)
        numeric = pd.to_numeric(values, errors="coerce").notna().all()
        key = (int(numeric), values.nunique(), column)
        if values.nunique() >= 2 and (best is None or key[:2] > best[:2]):
            best = key
    if best is None:
        return (label_columns[0] if label_columns else None), False
    return best[2], bool(best[0])


def _facets(frame: pd.DataFrame, others: list[str]) -> list[tuple[str, pd.DataFrame]]:
    if not others:
        return [("", frame)]
    out = []
    for key, rows in frame.groupby(others, sort=False):
        parts = key if isinstance(key, tuple) else (key,)
        out.append((" / ".join(f"{c}={v}" for c, v in zip(others, parts, strict=True)), rows))
    return out


def write_series_plots(
    series: pd.DataFrame, out_dir: Path, label_columns: Sequence[str], variants: Sequence[str],
    metric: str, title: str,
) -> dict[str, Path]:  # fmt: skip
    """`intervals.csv`, `series.png` and (for a load sweep) `pareto.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import pandas as pd

    paths: dict[str, Path] = {"intervals": out_dir / "intervals.csv"}
    series.to_csv(paths["intervals"], index=False, float_format="%.6g")
    if series.empty:
        return paths
    x_col, numeric = _x_column(series, label_columns)
    if x_col is None:
        return paths
    others = [c for c in label_columns if c != x_col]
    facets = _facets(series, others)[:12]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    cols = min(3, len(facets))
    rows_n = math.ceil(len(facets) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(max(7.5, 5.2 * cols), 3.8 * rows_n + 0.4),
                             squeeze=False)  # fmt: skip
    order = list(dict.fromkeys(series[x_col].astype(str)))
    for ax, (name, rows) in zip(axes.ravel(), facets, strict=False):
        for i, variant in enumerate(variants):
            mine = rows[rows["variant"] == variant]
            if mine.empty:
                continue
            if numeric:
                x = pd.to_numeric(mine[x_col].astype(str)).to_numpy(float)
            else:
                x = np.array([order.index(str(v)) for v in mine[x_col]], dtype=float)
            sort = np.argsort(x, kind="stable")
            x = x[sort] + (0 if numeric else (i - (len(variants) - 1) / 2) * 0.06)
            y = mine["value"].to_numpy(float)[sort]
            lo = mine["ci_low"].to_numpy(float)[sort]
            hi = mine["ci_high"].to_numpy(float)[sort]
            err = np.clip(np.vstack([y - lo, hi - y]), 0, None)
            err = np.where(np.isfinite(err), err, 0.0)
            ax.errorbar(x, y, yerr=err, color=colors[i % len(colors)], marker="o", ms=4,
                        capsize=3, lw=1.5, label=variant)  # fmt: skip
        if not numeric:
            ax.set_xticks(range(len(order)), order, rotation=30, ha="right", fontsize=8)
        ax.set_xlabel(x_col)
        ax.set_ylabel(metric)
        ax.set_title(name or title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes.ravel()[len(facets) :]:
        ax.set_visible(False)
    fig.suptitle(_wrap(f"{title}: {metric} per variant across {x_col} (whiskers: 95% "
                       "bootstrap intervals)"), fontsize=10)  # fmt: skip
    fig.tight_layout()
    paths["series"] = out_dir / "series.png"
    fig.savefig(paths["series"], dpi=110, metadata={"Software": None})
    plt.close(fig)
    load_cols = [c for c in label_columns if is_load_column(c)]
    if load_cols and series["achieved_rps"].notna().any():
        paths["pareto"] = out_dir / "pareto.png"
        _pareto(plt, series, load_cols[0], label_columns, variants, metric, title,
                paths["pareto"])  # fmt: skip
    return paths


def pareto_front(throughput: np.ndarray, latency: np.ndarray) -> np.ndarray:
    """Which points no other point dominates: none has at least as much throughput and at
    most as much latency, with strictly more of one or less of the other."""
    import numpy as np

    dominated = [
        bool(np.any((throughput >= t) & (latency <= v) & ((throughput > t) | (latency < v))))
        for t, v in zip(throughput, latency, strict=True)
    ]
    return ~np.array(dominated, dtype=bool)


def _pareto(
    plt: Any, series: pd.DataFrame, load: str, label_columns: Sequence[str],
    variants: Sequence[str], metric: str, title: str, path: Path,
) -> None:  # fmt: skip
    """Latency against achieved throughput, one line per variant in order of offered load
    (each point labelled with it), frontier points ringed."""
    import numpy as np

    others = [c for c in label_columns if c != load]
    facets = _facets(series, others)[:12]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    cols = min(3, len(facets))
    rows_n = math.ceil(len(facets) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(max(7.5, 5.4 * cols), 4.0 * rows_n + 0.4),
                             squeeze=False)  # fmt: skip
    for ax, (name, rows) in zip(axes.ravel(), facets, strict=False):
        thr = rows["achieved_rps"].to_numpy(float)
        lat = rows["value"].to_numpy(float)
        frontier = pareto_front(thr, lat)
        ax.scatter(thr[frontier], lat[frontier], s=140, facecolors="none", edgecolors="0.2",
                   lw=1.2, label="Pareto frontier", zorder=4)  # fmt: skip
        for i, variant in enumerate(variants):
            mine = rows[rows["variant"] == variant].sort_values("offered_rps")
            if mine.empty:
                continue
            x = mine["achieved_rps"].to_numpy(float)
            y = mine["value"].to_numpy(float)
            err = np.clip(np.vstack([y - mine["ci_low"].to_numpy(float),
                                     mine["ci_high"].to_numpy(float) - y]), 0, None)  # fmt: skip
            ax.errorbar(x, y, yerr=np.where(np.isfinite(err), err, 0.0), marker="o", ms=4,
                        color=colors[i % len(colors)], capsize=3, label=variant)  # fmt: skip
            for xi, yi, offered in zip(x, y, mine["offered_rps"], strict=True):
                ax.annotate(f"{offered:.2g}/s", (xi, yi), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color="0.35")  # fmt: skip
        ax.set_xlabel("achieved throughput (successful requests/s)")
        ax.set_ylabel(metric)
        ax.set_title(name or title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes.ravel()[len(facets) :]:
        ax.set_visible(False)
    fig.suptitle(_wrap(f"{title}: {metric} against achieved throughput as {load} varies "
                       "(labels: offered requests/s)"), fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
