"""The sweep's outputs: one table (CSV and markdown) and one plot, built from the
`summary.json` of every point's run directory, never from live state, so they can be
rebuilt at any time and are identical whichever executor produced the runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from btb_lab.sweep.plan import SweepPoint
from btb_lab.sweep.spec import TableSpec

if TYPE_CHECKING:
    import pandas as pd

    from btb_lab.analysis.models import Summary

__all__ = [
    "build_table",
    "metric_value",
    "reduction_column",
    "table_markdown",
    "value_column",
    "write_outputs",
]


def value_column(variant: str, metric: str) -> str:
    """Column name of one variant's metric."""
    return f"{variant} {metric}"


def reduction_column(variant: str, baseline: str, metric: str) -> str:
    """Column name of a variant's relative reduction of a metric vs the baseline."""
    return f"{metric} reduction % ({variant} vs {baseline})"


def metric_value(summary: Summary | None, variant: str, metric: str, scope: str) -> float:
    """One number out of a run's summary.json; NaN when absent (e.g. no HEAVY requests)."""
    block = summary.variants.get(variant) if summary is not None else None
    if block is None:
        return math.nan
    value = block.value(metric, scope)
    return math.nan if value is None else float(value)


def build_table(
    points: Sequence[SweepPoint],
    summaries: Mapping[str, Summary | None],
    table: TableSpec,
    baseline: str,
) -> pd.DataFrame:
    """One row per point: its labels, each variant's metrics, the reductions vs the
    baseline and the run's verdict. A point without a summary shows status `failed`."""
    import pandas as pd

    variants = list(table.variants or [])
    if not variants:
        for summary in summaries.values():
            for name in summary.variants if summary is not None else ():
                if name not in variants:
                    variants.append(name)
    if baseline in variants:  # baseline first, the others in their order
        variants.remove(baseline)
        variants.insert(0, baseline)
    rows: list[dict[str, Any]] = []
    for point in points:
        summary = summaries.get(point.point_id)
        row: dict[str, Any] = dict(point.labels)
        row["point_id"] = point.point_id
        row["status"] = "ok" if summary is not None else "failed"
        for metric in table.metrics:
            values = {v: metric_value(summary, v, metric, table.scope) for v in variants}
            for v in variants:
                row[value_column(v, metric)] = values[v]
            if table.reductions and baseline in values:
                base = values[baseline]
                for v in variants:
                    if v == baseline:
                        continue
                    red = (base - values[v]) / base * 100.0 if base else math.nan
                    row[reduction_column(v, baseline, metric)] = red
        row["verdict"] = summary.verdict.word if summary is not None else ""
        rows.append(row)
    df = pd.DataFrame(rows)
    df.attrs["variants"] = variants
    if table.rename:
        df = df.rename(columns=table.rename)
        df.attrs["variants"] = variants
    if table.reference is not None:
        ref = table.reference
        df[ref.name] = [ref.values.get(str(label), math.nan) for label in df[ref.axis]]
        gap = df[ref.column] - df[ref.name]
        df[f"{ref.column}_gap_pp"] = gap
        df[f"{ref.column}_within"] = gap.abs() <= ref.tolerance
    return df


def _fmt(value: Any, column: str) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        if "reduction %" in column:
            return f"{value:+.1f}%"
        return f"{value:.4g}"
    return str(value)


def table_markdown(df: pd.DataFrame, *, title: str | None = None) -> str:
    """A GitHub-flavoured markdown table (no extra dependency), numbers at 4 digits,
    reductions as signed percentages."""
    columns = [c for c in df.columns if c != "point_id"]
    lines = [f"# {title}", ""] if title else []
    lines.append("| " + " | ".join(columns) + " |")
    import pandas as pd

    numeric = {c: pd.api.types.is_numeric_dtype(df[c]) for c in columns}
    lines.append("|" + "|".join("---:" if numeric[c] else "---" for c in columns) + "|")
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(_fmt(row[c], c) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _plot(df: pd.DataFrame, label_columns: list[str], variants: list[str], metric: str,
          path: Path) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [" / ".join(str(row[c]) for c in label_columns) for _, row in df.iterrows()]
    n = max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * n * max(len(variants), 1)), 4.5))
    x = np.arange(n)
    width = 0.8 / max(len(variants), 1)
    for i, v in enumerate(variants):
        col = value_column(v, metric)
        heights = df[col].to_numpy(dtype=float) if col in df else np.full(n, np.nan)
        ax.bar(x + (i - (len(variants) - 1) / 2) * width, heights, width, label=v)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(metric)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def write_outputs(
    df: pd.DataFrame,
    out_dir: Path,
    table: TableSpec,
    *,
    label_columns: list[str],
    variants: list[str],
    title: str,
) -> dict[str, Path]:
    """Write table.csv, table.md and plot.png into the sweep directory."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "csv": out_dir / "table.csv",
        "markdown": out_dir / "table.md",
        "plot": out_dir / "plot.png",
    }
    df.to_csv(paths["csv"], index=False, float_format="%.6g")
    paths["markdown"].write_text(table_markdown(df, title=title), encoding="utf-8")
    _plot(df, label_columns, variants, table.plot_metric or table.metrics[0], paths["plot"])
    return paths
