"""Report plots (matplotlib, Agg), written without timestamps so re-rendering gives the same
files, and built from aggregates so a million-request run renders as fast as a small one:

- `timeline.png` (and `timeline_zoom.png` around the first burst): per variant, one lane
  per instance with each request's arrival coloured by its route, burst windows shaded,
  burst detections, warm copies (source → target, landing marked) and KV transfers; below
  it each instance's queue depth and running batch over time; one block per variant on a
  shared time axis. Drawn from `events.parquet` (reconstructed from the records where a
  backend did not record a kind).
- `latency_cdf.png`: TTFT and E2E CDFs per variant, overall and per class, on a log time
  axis and a logit fraction axis so the tail (p90, p99, p99.9) gets as much room as the
  median; `pool_cdf.png` the same per pool when there are several.
- `utilization.png`: mean utilization per instance, with the spread across repeats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from btb_lab.analysis.timeline import burst_windows, route_counts, timeline_events

__all__ = ["cdf_points", "write_plots"]

_META = {"Software": None}
_TICK_LIMIT = 6000  # arrivals drawn one by one up to this many per panel, else binned
_ROUTE_COLORS = (
    "#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C",
    "#CCB974", "#64B5CD",
)  # fmt: skip
_DETECT = "#C0392B"
_LANDED = "#1E8449"
_TRANSFER = "#7D3C98"
_BURST = "#F5CBA7"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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


def _save(fig: Any, path: Path, dpi: int = 100) -> None:
    """PNG bytes rendered in memory, then written atomically (a full disk or a kill never
    leaves half an image); the figure is closed."""
    import io

    from btb_lab.results import write_atomic

    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=dpi, metadata=_META)
    finally:
        _pyplot().close(fig)
    write_atomic(path, buffer.getvalue())


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
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
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
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def _latency_cdfs(
    plt: Any, plots_dir: Path, ok: pd.DataFrame, variants: Sequence[str], classes: list[str]
) -> list[tuple[str, str]]:
    written: list[tuple[str, str]] = []
    scopes: list[tuple[str, pd.Series | None]] = [("all requests", None)]
    scopes += [(c, ok["class"] == c) for c in classes]
    title = "Latency CDFs per variant (successful requests, each variant's own classes)"
    fig = _cdf_grid(plt, ok, variants, scopes, title)
    _save(fig, plots_dir / "latency_cdf.png")
    written.append(("TTFT and E2E CDFs, overall and per class (log time axis)",
                    "plots/latency_cdf.png"))  # fmt: skip
    pools = [str(p) for p in ok["source"].astype(str).unique()]
    if len(pools) >= 2:
        pool_scopes: list[tuple[str, pd.Series | None]] = [
            (f"pool {p}", ok["source"].astype(str) == p) for p in pools
        ]
        fig = _cdf_grid(plt, ok, variants, pool_scopes, "Latency CDFs per pool (source)")
        _save(fig, plots_dir / "pool_cdf.png")
        written.append(("TTFT and E2E CDFs per pool (log time axis)", "plots/pool_cdf.png"))
    return written


# ---------------------------------------------------------------------------- timeline


def _instance_order(records: pd.DataFrame, events: pd.DataFrame) -> list[str]:
    names = {str(n) for n in records["instance"].unique()}
    names |= {str(n) for n in records["prefill_instance"].dropna().unique()} - {""}
    if not events.empty:
        names |= {str(n) for n in events["instance"].unique() if n}
        names |= {str(n) for n in events["peer"].unique() if n}

    def key(name: str) -> tuple[str, int, str]:
        head = name.rstrip("0123456789")
        tail = name[len(head) :]
        return (head, int(tail) if tail else -1, name)

    return sorted(names, key=key)


def _step(ax: Any, runs: pd.DataFrame, color: str, label: str) -> float:
    """A counter drawn from its runs (time_s, end_s, value), zero between runs."""
    if runs.empty:
        return 0.0
    runs = runs.sort_values("time_s")
    t0 = runs["time_s"].to_numpy(float)
    t1 = runs["end_s"].to_numpy(float)
    v = runs["value"].to_numpy(float)
    xs: list[float] = []
    ys: list[float] = []
    last = -math.inf
    for a, b, value in zip(t0, t1, v, strict=True):
        if a > last + 1e-9:
            xs += [last if math.isfinite(last) else a, a]
            ys += [0.0, 0.0]
        xs += [a, b]
        ys += [value, value]
        last = b
    xs.append(last)
    ys.append(0.0)
    ax.plot(xs, ys, color=color, lw=1.3, label=label, drawstyle="default")
    return float(v.max())


def _annotate_burst(
    ax: Any, ev: pd.DataFrame, copies: pd.DataFrame, t_lo: float, t_hi: float
) -> None:
    """In a zoomed view: when the burst was detected and when its copies landed."""
    detections = ev[(ev["kind"] == "burst_detected") & ev["time_s"].between(t_lo, t_hi)]
    if detections.empty:
        return
    t = float(detections["time_s"].iloc[0])
    text = f"burst detected at {t:.2f} s"
    landed = copies[copies["time_s"].between(t, t_hi) & copies["end_s"].notna()]
    if len(landed):
        first = landed[landed["time_s"] == landed["time_s"].min()]
        targets = ", ".join(sorted(first["instance"].astype(str)))
        source = str(first["peer"].iloc[0]) or "recompute"
        end = float(first["end_s"].max())
        text += (
            f"; {len(first)} warm cop{'y' if len(first) == 1 else 'ies'} {source} → {targets} "
            f"started {float(first['time_s'].min()):.2f} s, landed {end:.2f} s "
            f"({end - t:.2f} s after detection)"
        )
    ax.text(0.995, 1.02, text, transform=ax.transAxes, ha="right", va="bottom", fontsize=8.5,
            color=_DETECT)  # fmt: skip


_SHORT_ORIGINS = {
    "engine": "engine",
    "router": "router",
    "policy": "policy decisions",
    "vllm_metrics": "vLLM /metrics",
    "records": "rebuilt from request records",
}


def _provenance(events: pd.DataFrame) -> str:
    """One line under the figure: where each kind of mark came from."""
    if events.empty:
        return ""
    parts = []
    for kind, label in (("waiting", "queue"), ("running", "batch"),
                        ("burst_detected", "detections"), ("warm_copy", "warm copies"),
                        ("kv_transfer", "KV transfers")):  # fmt: skip
        origins = sorted(set(events.loc[events["kind"] == kind, "origin"].astype(str)))
        if origins:
            text = ", ".join(_SHORT_ORIGINS.get(o, o) for o in origins)
            if kind == "warm_copy" and "policy" in origins:
                text += " (landing: cost model's transfer time)"
            parts.append(f"{label}: {text}")
    return "Sources — " + "; ".join(parts)


def _timeline(
    plt: Any,
    records: pd.DataFrame,
    events: pd.DataFrame,
    variants: Sequence[str],
    repeat: int,
    window: tuple[float, float] | None,
    excluded: list[tuple[float, float]],
    title: str,
) -> Any:
    instances = _instance_order(records, events)
    lane = {name: i for i, name in enumerate(instances)}
    inst_colors = plt.get_cmap("tab10")
    routes = sorted(records["route"].astype(str).unique())
    route_color = {r: _ROUTE_COLORS[i % len(_ROUTE_COLORS)] for i, r in enumerate(routes)}
    lane_h = 0.5 + 0.28 * len(instances)
    ratios: list[float] = []
    for block in range(len(variants)):
        ratios += ([0.45] if block else []) + [lane_h, 1.35, 1.35]
    fig, grid = plt.subplots(
        len(ratios), 1, figsize=(12, sum(ratios) + 2.0), sharex=True,
        gridspec_kw={"height_ratios": ratios, "hspace": 0.12},
    )  # fmt: skip
    grid = np.atleast_1d(grid)
    spacers = [4 * block - 1 for block in range(1, len(variants))]
    for i in spacers:
        grid[i].set_visible(False)
    axes = np.array([ax for i, ax in enumerate(grid) if i not in spacers])
    shown = records[records["repeat"] == repeat]
    t_lo = float(shown["arrival_s"].min()) if len(shown) else 0.0
    t_hi = float(np.nanmax(shown["finish_s"].to_numpy(float))) if len(shown) else 1.0
    if window is not None:
        t_lo, t_hi = window
    span = max(t_hi - t_lo, 1e-6)
    bin_s = max(span / 400, 0.05)
    bursts = burst_windows(records, variants[0], repeat) if variants else pd.DataFrame()
    peak_wait = peak_run = 1.0
    for block, name in enumerate(variants):
        ax_lane, ax_wait, ax_run = axes[3 * block : 3 * block + 3]
        ev = events[(events["variant"] == name) & (events["repeat"] == repeat)]
        for ax in (ax_lane, ax_wait, ax_run):
            for _, b in bursts.iterrows():
                ax.axvspan(b["start_s"], b["end_s"], color=_BURST, alpha=0.45, lw=0, zorder=0)
            for a, b_ in excluded:
                ax.axvspan(a, b_, facecolor="none", edgecolor="0.6", hatch="//", lw=0, zorder=0)
        # arrivals by route
        mine = shown[(shown["variant"] == name)]
        mine = mine[(mine["arrival_s"] >= t_lo - bin_s) & (mine["arrival_s"] <= t_hi + bin_s)]
        if len(mine) <= _TICK_LIMIT:
            for route, rows in mine.groupby(mine["route"].astype(str), sort=True):
                y = rows["instance"].astype(str).map(lane).to_numpy(float)
                ax_lane.scatter(rows["arrival_s"], y, marker="|", s=70, lw=1.1,
                                color=route_color[str(route)], label=str(route))  # fmt: skip
        else:
            # many requests: one mark per (instance, route, bin), darker where that route
            # took a larger share of the bin's arrivals on that instance
            counts = route_counts(mine, name, repeat, bin_s)
            total = counts.groupby(["instance", "bin_start_s"])["requests"].transform("sum")
            for route_name, rows in counts.groupby("route", sort=True):
                y = rows["instance"].map(lane).to_numpy(float)
                alpha = (rows["requests"] / total.loc[rows.index]).clip(0.15, 1).to_numpy()
                ax_lane.scatter(rows["bin_start_s"] + bin_s / 2, y, marker="s", s=12,
                                color=route_color[str(route_name)], alpha=alpha,
                                label=str(route_name))  # fmt: skip
        # burst detections, warm copies, KV transfers
        for t in ev.loc[ev["kind"] == "burst_detected", "time_s"]:
            for ax in (ax_lane, ax_wait, ax_run):
                ax.axvline(t, color=_DETECT, ls="--", lw=1.1, zorder=3)
        copies = ev[ev["kind"] == "warm_copy"]
        for _, c in copies.iterrows():
            target = lane.get(str(c["instance"]))
            source = lane.get(str(c["peer"]), target)
            end = c["end_s"]
            if target is None:
                continue
            if pd.notna(end):
                arrow = {"arrowstyle": "-|>", "color": _LANDED, "lw": 1.2}
                ax_lane.annotate("", xy=(end, target), xytext=(c["time_s"], source),
                                 arrowprops=arrow)  # fmt: skip
                ax_lane.scatter([end], [target], marker="D", s=28, color=_LANDED, zorder=4)
            else:
                ax_lane.scatter([c["time_s"]], [target], marker="x", s=28, color=_LANDED)
        for t in sorted(set(copies["end_s"].dropna().round(6))):
            for ax in (ax_wait, ax_run):
                ax.axvline(t, color=_LANDED, ls=":", lw=1.1, zorder=3)
        if window is not None:
            _annotate_burst(ax_lane, ev, copies, t_lo, t_hi)
        transfers = ev[ev["kind"] == "kv_transfer"]
        for _, x in transfers.iterrows():
            target = lane.get(str(x["instance"]))
            source = lane.get(str(x["peer"]), target)
            if target is None or pd.isna(x["end_s"]):
                continue
            ax_lane.plot([x["time_s"], x["end_s"]], [source, target], color=_TRANSFER,
                         lw=0.9, alpha=0.8)  # fmt: skip
        ax_lane.set_yticks(range(len(instances)), instances)
        ax_lane.set_ylim(len(instances) - 0.4, -0.6)
        ax_lane.set_ylabel("arrivals\nby route", fontsize=9)
        ax_lane.set_title(f"{name}", loc="left", fontsize=11, fontweight="bold")
        for inst in instances:
            color = inst_colors(lane[inst] % 10)
            peak_wait = max(peak_wait, _step(
                ax_wait, ev[(ev["kind"] == "waiting") & (ev["instance"] == inst)], color, inst
            ))  # fmt: skip
            peak_run = max(peak_run, _step(
                ax_run, ev[(ev["kind"] == "running") & (ev["instance"] == inst)], color, inst
            ))  # fmt: skip
        ax_wait.set_ylabel("queue depth\n(waiting)", fontsize=9)
        ax_run.set_ylabel("running\nbatch", fontsize=9)
        for ax in (ax_lane, ax_wait, ax_run):
            ax.grid(alpha=0.25)
    for block in range(len(variants)):
        axes[3 * block + 1].set_ylim(0, peak_wait * 1.12)
        axes[3 * block + 2].set_ylim(0, peak_run * 1.12)
    axes[-1].set_xlim(t_lo, t_hi)
    axes[-1].set_xlabel("time on the run's clock (s)")
    # one legend for routes and marks, one for instances
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    marks: list[Any] = [
        Line2D([], [], color=route_color[r], marker="|", ls="", ms=10, mew=2, label=r)
        for r in routes
    ]
    kinds = set(events["kind"]) if not events.empty else set()
    if len(bursts):
        marks.append(Patch(color=_BURST, alpha=0.6, label="burst window (workload)"))
    if "burst_detected" in kinds:
        marks.append(Line2D([], [], color=_DETECT, ls="--", label="burst detected"))
    if "warm_copy" in kinds:
        marks.append(Line2D([], [], color=_LANDED, marker="D", ls=":", label="warm copy landed"))
    if "kv_transfer" in kinds:
        marks.append(Line2D([], [], color=_TRANSFER, label="KV transfer (offload)"))
    if excluded:
        marks.append(Patch(facecolor="none", edgecolor="0.6", hatch="//", label="excluded"))
    # two legend rows above the plots: routes and marks, then instances
    height = fig.get_figheight()
    fig.suptitle(title, fontsize=11, y=1 - 0.06 / height, x=0.06, ha="left", va="top")
    fig.legend(handles=marks, loc="upper left", ncol=min(len(marks), 7), fontsize=8,
               bbox_to_anchor=(0.06, 1 - 0.32 / height), frameon=False)  # fmt: skip
    rows_marks = math.ceil(len(marks) / 7)
    insts = [Line2D([], [], color=inst_colors(lane[i] % 10), label=i) for i in instances]
    fig.legend(handles=insts, loc="upper left", ncol=min(len(insts), 10), fontsize=8,
               bbox_to_anchor=(0.06, 1 - (0.4 + 0.2 * rows_marks) / height), frameon=False,
               title="instances (queue depth, running batch)", title_fontsize=8,
               alignment="left")  # fmt: skip
    note = _provenance(events)
    if note:
        fig.text(0.08, 0.08 / height, note, fontsize=7.5, color="0.35", ha="left", va="bottom")
    top = (0.4 + 0.2 * rows_marks + 0.75) / height
    fig.subplots_adjust(left=0.08, right=0.99, top=1 - top, bottom=0.75 / height)
    return fig


def _timelines(
    plt: Any,
    plots_dir: Path,
    records: pd.DataFrame,
    events: pd.DataFrame,
    variants: Sequence[str],
    excluded: list[tuple[float, float]],
) -> list[tuple[str, str]]:
    if records.empty:
        return []
    repeat = int(records["repeat"].min())
    repeats = records["repeat"].nunique()
    which = f"repeat 1 of {repeats}" if repeats > 1 else "the run"
    shown = records[records["repeat"] == repeat]
    events = timeline_events(shown, events[events["repeat"] == repeat] if len(events) else events)
    written: list[tuple[str, str]] = []
    fig = _timeline(plt, shown, events, variants, repeat, None, excluded,
                    f"Timeline, {which}: arrivals by route, queue depth and running batch "
                    "per instance")  # fmt: skip
    _save(fig, plots_dir / "timeline.png", dpi=90)
    written.append((f"Timeline ({which})", "plots/timeline.png"))
    bursts = burst_windows(shown, variants[0], repeat)
    if len(bursts):
        first = bursts.iloc[0]
        length = float(first["end_s"] - first["start_s"])
        window = (float(first["start_s"]) - max(1.0, 0.15 * length),
                  float(first["end_s"]) + max(6.0, 0.9 * length))  # fmt: skip
        fig = _timeline(plt, shown, events, variants, repeat, window, excluded,
                        f"First burst ({first['group_id']}, {int(first['requests'])} requests), "
                        f"{which}: detection, warm copies landing, queues")  # fmt: skip
        _save(fig, plots_dir / "timeline_zoom.png", dpi=90)
        written.append(("Timeline around the first burst", "plots/timeline_zoom.png"))
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
    _save(fig, plots_dir / "utilization.png")
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
    plt = _pyplot()
    plots_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("ttft_cdf.png", "class_ttft.png", "timeline_zoom.png", "pool_cdf.png"):
        (plots_dir / stale).unlink(missing_ok=True)
    written: list[tuple[str, str]] = []
    timeline_records = records if all_records is None else all_records
    written += _timelines(plt, plots_dir, timeline_records,
                          events if events is not None else pd.DataFrame(columns=["repeat"]),
                          variants, excluded or [])  # fmt: skip
    ok = records[records["ok"].astype(bool)] if len(records) else records
    if len(ok):
        present = {str(c) for c in ok["class"].dropna().unique()}
        classes = [c for c in class_names if c in present]
        written += _latency_cdfs(plt, plots_dir, ok, variants, classes)
    written += _utilization(plt, plots_dir, utilization, variants)
    return written
