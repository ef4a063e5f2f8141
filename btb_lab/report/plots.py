"""Report plots (matplotlib, Agg): TTFT CDF per variant, per-class TTFT bars, per-instance
utilization bars. Written without timestamps so re-rendering gives the same files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["write_plots"]

_META = {"Software": None}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    """PNG bytes rendered in memory, then written atomically (a full disk or a kill never
    leaves half an image)."""
    import io

    from btb_lab.results import write_atomic

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, metadata=_META)
    write_atomic(path, buffer.getvalue())


def write_plots(
    plots_dir: Path,
    records: pd.DataFrame,
    utilization: pd.DataFrame,
    variants: list[str],
    class_names: list[str],
) -> list[tuple[str, str]]:
    """Write the plots; return (title, path relative to the run dir) for each one written."""
    plt = _pyplot()
    plots_dir.mkdir(parents=True, exist_ok=True)
    written: list[tuple[str, str]] = []
    ok = records[records["ok"].astype(bool)] if len(records) else records

    if len(ok):
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for name in variants:
            values = np.sort(ok.loc[ok["variant"] == name, "ttft_s"].dropna().to_numpy(float))
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post",
                        label=name)  # fmt: skip
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("TTFT CDF per variant")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        _save(fig, plots_dir / "ttft_cdf.png")
        plt.close(fig)
        written.append(("TTFT CDF per variant", "plots/ttft_cdf.png"))

    classes = [c for c in class_names if c in set(ok["class"].dropna())] if len(ok) else []
    if classes:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        width = 0.8 / max(len(variants), 1)
        xs = np.arange(len(classes))
        for i, name in enumerate(variants):
            rows = ok[ok["variant"] == name]
            p50 = [rows.loc[rows["class"] == c, "ttft_s"].median() for c in classes]
            p90 = [rows.loc[rows["class"] == c, "ttft_s"].quantile(0.9) for c in classes]
            ax.bar(xs + i * width, p90, width, alpha=0.35, label=f"{name} p90")
            ax.bar(xs + i * width, p50, width, label=f"{name} p50")
        ax.set_xticks(xs + width * (len(variants) - 1) / 2, classes)
        ax.set_ylabel("TTFT (s)")
        ax.set_title("TTFT per class (p50 solid, p90 light)")
        ax.legend(fontsize="small")
        fig.tight_layout()
        _save(fig, plots_dir / "class_ttft.png")
        plt.close(fig)
        written.append(("TTFT per class", "plots/class_ttft.png"))

    if len(utilization):
        unit = utilization["instance"].astype(str) + "/" + utilization["device"].astype(str)
        means = utilization.assign(unit=unit).groupby(["variant", "unit"])["utilization"].mean()
        units = sorted({u for _, u in means.index})
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        width = 0.8 / max(len(variants), 1)
        xs = np.arange(len(units))
        for i, name in enumerate(variants):
            heights = [100 * float(means.get((name, u), 0.0)) for u in units]
            ax.bar(xs + i * width, heights, width, label=name)
        ax.set_xticks(xs + width * (len(variants) - 1) / 2, units, rotation=45, ha="right")
        ax.set_ylabel("mean utilization (%)")
        ax.set_title("Utilization per instance")
        ax.legend(fontsize="small")
        fig.tight_layout()
        _save(fig, plots_dir / "utilization.png")
        plt.close(fig)
        written.append(("Utilization per instance", "plots/utilization.png"))
    return written
