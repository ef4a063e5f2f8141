"""The run's timeline figures (`timeline.png`, and `timeline_zoom.png` around the first
burst): per variant, one lane per instance with each request's arrival coloured by its
route, burst windows shaded, burst detections, warm copies (source → target, landing
marked) and KV transfers; below it each instance's queue depth and running batch over
time; one block per variant on a shared time axis. Drawn from `events.parquet`
(reconstructed from the records where a backend did not record a kind).

Drawing cost is kept off the per-event path: spans, lines, arrows and transfers are one
collection per panel rather than one artist each, and the zoom redraws only its arrivals,
burst note and title on the whole timeline's figure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from btb_lab.analysis.scopes import rows_where, variant_rows
from btb_lab.analysis.timeline import burst_windows, route_counts, timeline_events
from btb_lab.report import forked
from btb_lab.report.png import save, stop_drawing

__all__ = ["write_timelines"]

_TICK_LIMIT = 6000  # arrivals drawn one by one up to this many per panel, else binned
_ROUTE_COLORS = (
    "#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C",
    "#CCB974", "#64B5CD",
)  # fmt: skip
_DETECT = "#C0392B"
_LANDED = "#1E8449"
_TRANSFER = "#7D3C98"
_BURST = "#F5CBA7"


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


def _step_xy(runs: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """A counter's outline from its runs (time_s, end_s, value): flat at each run's value,
    down to zero across every gap between runs (a run starting where the last one ended
    joins it directly)."""
    runs = runs.sort_values("time_s")
    t0 = runs["time_s"].to_numpy(float)
    t1 = runs["end_s"].to_numpy(float)
    v = runs["value"].to_numpy(float)
    before = np.concatenate([t0[:1], t1[:-1]])  # where the previous run ended
    gap = np.ones(t0.size, bool)
    gap[1:] = t0[1:] > t1[:-1] + 1e-9
    zero = np.zeros_like(v)
    # four corners per run, (previous end, 0) and (start, 0) kept only after a gap
    xs = np.stack([before, t0, t0, t1], axis=1)
    ys = np.stack([zero, zero, v, v], axis=1)
    keep = np.stack([gap, gap, np.ones_like(gap), np.ones_like(gap)], axis=1)
    return np.append(xs[keep], t1[-1]), np.append(ys[keep], 0.0)


def _step(ax: Any, runs: pd.DataFrame, color: str, label: str) -> float:
    """A counter drawn from its runs, zero between runs; returns its peak."""
    if runs.empty:
        return 0.0
    xs, ys = _step_xy(runs)
    ax.plot(xs, ys, color=color, lw=1.3, label=label)
    return float(runs["value"].max())


def _spans(ax: Any, spans: Sequence[tuple[float, float]], **style: Any) -> None:
    """Full-height time spans as one collection (one artist, not one patch per span)."""
    from matplotlib.collections import PolyCollection

    if not len(spans):
        return
    verts = [[(a, 0.0), (a, 1.0), (b, 1.0), (b, 0.0)] for a, b in spans]
    ax.add_collection(
        PolyCollection(verts, transform=ax.get_xaxis_transform(), zorder=0, **style),
        autolim=False,
    )


def _vlines(ax: Any, times: Sequence[float], **style: Any) -> None:
    """Full-height vertical lines at `times` as one collection."""
    from matplotlib.collections import LineCollection

    if not len(times):
        return
    segments = [[(t, 0.0), (t, 1.0)] for t in times]
    ax.add_collection(
        LineCollection(segments, transform=ax.get_xaxis_transform(), zorder=3, **style),
        autolim=False,
    )


def _annotate_burst(
    ax: Any, ev: pd.DataFrame, copies: pd.DataFrame, t_lo: float, t_hi: float
) -> Any:
    """In a zoomed view: when the burst was detected and when its copies landed (the text
    artist, None when no detection falls in the window)."""
    detections = ev[(ev["kind"] == "burst_detected") & ev["time_s"].between(t_lo, t_hi)]
    if detections.empty:
        return None
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
    return ax.text(0.995, 1.02, text, transform=ax.transAxes, ha="right", va="bottom",
                   fontsize=8.5, color=_DETECT)  # fmt: skip


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
        origins = sorted(set(events.loc[events["kind"] == kind, "origin"].astype(str).unique()))
        if origins:
            text = ", ".join(_SHORT_ORIGINS.get(o, o) for o in origins)
            if kind == "warm_copy" and "policy" in origins:
                text += " (landing: cost model's transfer time)"
            parts.append(f"{label}: {text}")
    return "Sources — " + "; ".join(parts)


def _arrows(
    ax: Any, tails: np.ndarray, heads: np.ndarray, dpi: float, *, color: str, lw: float
) -> list[Any]:
    """Arrows tail → head (data coordinates) as two collections, shafts and filled heads,
    shaped like annotate's "-|>" (ends 2 pt short, head 4 pt long and 4 pt wide) but one
    artist each instead of an annotation per arrow. Computed in display space, so call it
    after the axes' limits and the figure's layout are final (a savefig at another dpi
    scales the whole figure, these arrows included)."""
    from matplotlib.collections import LineCollection, PolyCollection

    px_per_pt = dpi / 72
    to_px = ax.transData
    p0, p1 = to_px.transform(tails), to_px.transform(heads)
    length = np.hypot(*(p1 - p0).T)
    unit = (p1 - p0) / np.maximum(length, 1e-9)[:, None]
    normal = np.column_stack([-unit[:, 1], unit[:, 0]])
    shrink, head_len, head_half = 2 * px_per_pt, 4 * px_per_pt, 2 * px_per_pt
    # annotate pulls the tip back by half the edge width over the head's half-angle sine
    pad = 0.5 * lw * px_per_pt * math.hypot(4, 2) / 2
    tip = p1 - unit * (shrink + pad)
    base = tip - unit * head_len
    to_data = to_px.inverted()
    shafts = np.stack([to_data.transform(p0 + unit * shrink), to_data.transform(tip)], axis=1)
    wedges = np.stack([to_data.transform(base + normal * head_half), to_data.transform(tip),
                       to_data.transform(base - normal * head_half)], axis=1)  # fmt: skip
    lines = LineCollection(list(shafts), colors=color, lw=lw, capstyle="butt", zorder=3)
    fills = PolyCollection(list(wedges), facecolors=color, edgecolors=color, lw=lw,
                           joinstyle="miter", zorder=3)  # fmt: skip
    return [ax.add_collection(c, autolim=False) for c in (lines, fills)]


class _Timeline:
    """One timeline figure, drawn once and saved for each time window (the whole run, then
    the first burst): spans, detections, copies, transfers, queues, batches, legends and
    layout are the same in every window, so only the arrivals (binned or one tick per
    request, by how many the window holds), the burst note and the title are redrawn."""

    def __init__(
        self,
        plt: Any,
        records: pd.DataFrame,
        events: pd.DataFrame,
        variants: Sequence[str],
        repeat: int,
        excluded: list[tuple[float, float]],
    ) -> None:
        instances = _instance_order(records, events)
        lane = {name: i for i, name in enumerate(instances)}
        inst_colors = plt.get_cmap("tab10")
        routes = sorted(records["route"].astype(str).unique())
        self.route_color = {r: _ROUTE_COLORS[i % len(_ROUTE_COLORS)] for i, r in enumerate(routes)}
        self.lane = lane
        self.variants = list(variants)
        self.repeat = repeat
        self._drawn: list[Any] = []  # the window's own artists, removed before the next one
        self._copies: list[tuple[Any, np.ndarray, np.ndarray]] = []  # (axes, tails, heads)
        lane_h = 0.5 + 0.28 * len(instances)
        ratios: list[float] = []
        for block in range(len(variants)):
            ratios += ([0.45] if block else []) + [lane_h, 1.35, 1.35]
        fig = plt.figure(figsize=(12, sum(ratios) + 2.0))
        slots = fig.add_gridspec(len(ratios), 1, height_ratios=ratios, hspace=0.12)
        spacers = {4 * block - 1 for block in range(1, len(variants))}
        # no axes in the spacer rows, and no shared x axis: show() sets every panel's
        # limits, and only the bottom panel labels its ticks (what sharex=True would give)
        axes = [fig.add_subplot(slots[i]) for i in range(len(ratios)) if i not in spacers]
        for ax in axes[:-1]:
            ax.tick_params(labelbottom=False)
        self.fig = fig
        self.axes = axes
        shown = rows_where(records, records["repeat"] == repeat)
        self.shown = shown
        self.t_lo = float(shown["arrival_s"].min()) if len(shown) else 0.0
        # failed requests have no finish: the view ends at the last arrival or finish
        ends = shown[["arrival_s", "finish_s"]].to_numpy(float)
        self.t_hi = float(np.nanmax(ends)) if len(shown) else 1.0
        if not self.t_hi > self.t_lo:  # one instant (a single request that failed)
            self.t_hi = self.t_lo + 1.0
        bursts = burst_windows(records, variants[0], repeat) if variants else pd.DataFrame()
        burst_spans = list(zip(bursts["start_s"], bursts["end_s"], strict=True))
        self.events: dict[str, pd.DataFrame] = {}
        peak_wait = peak_run = 1.0
        for block, name in enumerate(variants):
            ax_lane, ax_wait, ax_run = axes[3 * block : 3 * block + 3]
            ev = events[(events["variant"] == name) & (events["repeat"] == repeat)]
            self.events[name] = ev
            detections = ev.loc[ev["kind"] == "burst_detected", "time_s"].to_list()
            for ax in (ax_lane, ax_wait, ax_run):
                _spans(ax, burst_spans, color=_BURST, alpha=0.45, lw=0)
                _spans(ax, excluded, facecolor="none", edgecolor="0.6", hatch="//", lw=0,
                       hatchcolors="0.6")  # fmt: skip
                _vlines(ax, detections, color=_DETECT, linestyles="--", lw=1.1)
            # warm copies: an arrow source → target lane, a diamond where it landed
            copies = ev[ev["kind"] == "warm_copy"]
            target = copies["instance"].astype(str).map(lane)
            source = copies["peer"].astype(str).map(lane).fillna(target)
            landed = target.notna() & copies["end_s"].notna()
            pending = target.notna() & copies["end_s"].isna()
            if landed.any():
                start = copies.loc[landed, "time_s"].to_numpy(float)
                end = copies.loc[landed, "end_s"].to_numpy(float)
                y1 = target[landed].to_numpy(float)
                tails = np.column_stack([start, source[landed].to_numpy(float)])
                self._copies.append((ax_lane, tails, np.column_stack([end, y1])))
                ax_lane.scatter(end, y1, marker="D", s=28, color=_LANDED, zorder=4)
            if pending.any():
                ax_lane.scatter(copies.loc[pending, "time_s"].to_numpy(float),
                                target[pending].to_numpy(float), marker="x", s=28,
                                color=_LANDED, zorder=4)  # fmt: skip
            landings = sorted(set(copies["end_s"].dropna().round(6)))
            for ax in (ax_wait, ax_run):
                _vlines(ax, landings, color=_LANDED, linestyles=":", lw=1.1)
            transfers = ev[ev["kind"] == "kv_transfer"]
            to = transfers["instance"].astype(str).map(lane)
            drawn = to.notna() & transfers["end_s"].notna()
            if drawn.any():
                from matplotlib.collections import LineCollection

                frm = transfers["peer"].astype(str).map(lane).fillna(to)[drawn].to_numpy(float)
                segments = np.stack([
                    np.stack([transfers.loc[drawn, "time_s"].to_numpy(float), frm], axis=1),
                    np.stack([transfers.loc[drawn, "end_s"].to_numpy(float),
                              to[drawn].to_numpy(float)], axis=1),
                ], axis=1)  # fmt: skip
                ax_lane.add_collection(
                    LineCollection(list(segments), color=_TRANSFER, lw=0.9, alpha=0.8, zorder=2),
                    autolim=False,
                )
            ax_lane.set_yticks(range(len(instances)), instances)
            ax_lane.set_ylim(len(instances) - 0.4, -0.6)
            ax_lane.set_ylabel("arrivals\nby route", fontsize=9)
            ax_lane.set_title(f"{name}", loc="left", fontsize=11, fontweight="bold")
            counters = ev[ev["kind"].isin(("waiting", "running"))]
            by_series = dict(list(counters.groupby(["kind", "instance"], sort=False)))
            empty = counters.iloc[:0]
            for inst in instances:
                color = inst_colors(lane[inst] % 10)
                waiting = by_series.get(("waiting", inst), empty)
                running = by_series.get(("running", inst), empty)
                peak_wait = max(peak_wait, _step(ax_wait, waiting, color, inst))
                peak_run = max(peak_run, _step(ax_run, running, color, inst))
            ax_wait.set_ylabel("queue depth\n(waiting)", fontsize=9)
            ax_run.set_ylabel("running\nbatch", fontsize=9)
            for ax in (ax_lane, ax_wait, ax_run):
                ax.grid(alpha=0.25)
        for block in range(len(variants)):
            axes[3 * block + 1].set_ylim(0, peak_wait * 1.12)
            axes[3 * block + 2].set_ylim(0, peak_run * 1.12)
        axes[-1].set_xlabel("time on the run's clock (s)")
        # one legend for routes and marks, one for instances
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        marks: list[Any] = [
            Line2D([], [], color=self.route_color[r], marker="|", ls="", ms=10, mew=2, label=r)
            for r in routes
        ]
        kinds = set(events["kind"].unique()) if not events.empty else set()
        if len(bursts):
            marks.append(Patch(color=_BURST, alpha=0.6, label="burst window (workload)"))
        if "burst_detected" in kinds:
            marks.append(Line2D([], [], color=_DETECT, ls="--", label="burst detected"))
        if "warm_copy" in kinds:
            marks.append(
                Line2D([], [], color=_LANDED, marker="D", ls=":", label="warm copy landed")
            )
        if "kv_transfer" in kinds:
            marks.append(Line2D([], [], color=_TRANSFER, label="KV transfer (offload)"))
        if excluded:
            marks.append(Patch(facecolor="none", edgecolor="0.6", hatch="//", label="excluded"))
        # two legend rows above the plots: routes and marks, then instances
        height = fig.get_figheight()
        self._title_y = 1 - 0.06 / height
        fig.legend(handles=marks, loc="upper left", ncol=min(len(marks), 7), fontsize=8,
                   bbox_to_anchor=(0.06, 1 - 0.32 / height), frameon=False)  # fmt: skip
        rows_marks = math.ceil(len(marks) / 7)
        insts = [Line2D([], [], color=inst_colors(lane[i] % 10), label=i) for i in instances]
        fig.legend(handles=insts, loc="upper left", ncol=min(len(insts), 10), fontsize=8,
                   bbox_to_anchor=(0.06, 1 - (0.4 + 0.2 * rows_marks) / height),
                   frameon=False, title="instances (queue depth, running batch)",
                   title_fontsize=8, alignment="left")  # fmt: skip
        note = _provenance(events)
        if note:
            fig.text(0.08, 0.08 / height, note, fontsize=7.5, color="0.35", ha="left",
                     va="bottom")  # fmt: skip
        top = (0.4 + 0.2 * rows_marks + 0.75) / height
        fig.subplots_adjust(left=0.08, right=0.99, top=1 - top, bottom=0.75 / height)

    def show(self, window: tuple[float, float] | None, title: str) -> Any:
        """The figure for `window` (None: the whole run), arrivals redrawn for it."""
        for artist in self._drawn:
            artist.remove()
        self._drawn = []
        t_lo, t_hi = (self.t_lo, self.t_hi) if window is None else window
        span = max(t_hi - t_lo, 1e-6)
        bin_s = max(span / 400, 0.05)
        shown, lane, repeat = self.shown, self.lane, self.repeat
        for block, name in enumerate(self.variants):
            ax_lane = self.axes[3 * block]
            mine = variant_rows(
                shown, name, ["variant", "repeat", "arrival_s", "route", "instance"]
            )
            mine = mine[(mine["arrival_s"] >= t_lo - bin_s) & (mine["arrival_s"] <= t_hi + bin_s)]
            if len(mine) <= _TICK_LIMIT:
                for route, rows in mine.groupby(mine["route"].astype(str), sort=True):
                    y = rows["instance"].astype(str).map(lane).to_numpy(float)
                    self._drawn.append(ax_lane.scatter(
                        rows["arrival_s"].to_numpy(float), y, marker="|", s=70, lw=1.1,
                        color=self.route_color[str(route)], label=str(route), zorder=1,
                    ))  # fmt: skip
            else:
                # many requests: one mark per (instance, route, bin), darker where that route
                # took a larger share of the bin's arrivals on that instance
                counts = route_counts(mine, name, repeat, bin_s)
                total = counts.groupby(["instance", "bin_start_s"])["requests"].transform("sum")
                for route_name, rows in counts.groupby("route", sort=True):
                    y = rows["instance"].map(lane).to_numpy(float)
                    alpha = (rows["requests"] / total.loc[rows.index]).clip(0.15, 1).to_numpy()
                    self._drawn.append(ax_lane.scatter(
                        rows["bin_start_s"].to_numpy(float) + bin_s / 2, y, marker="s", s=12,
                        color=self.route_color[str(route_name)], alpha=alpha,
                        label=str(route_name), zorder=1,
                    ))  # fmt: skip
            if window is not None:
                ev = self.events[name]
                note = _annotate_burst(ax_lane, ev, ev[ev["kind"] == "warm_copy"], t_lo, t_hi)
                if note is not None:
                    self._drawn.append(note)
        for ax in self.axes:
            ax.set_xlim(t_lo, t_hi)
        for ax, tails, heads in self._copies:  # their heads' shape depends on the limits
            self._drawn += _arrows(ax, tails, heads, self.fig.dpi, color=_LANDED, lw=1.2)
        self.fig.suptitle(title, fontsize=11, y=self._title_y, x=0.06, ha="left", va="top")
        return self.fig


def write_timelines(
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
    shown = rows_where(records, records["repeat"] == repeat)
    events = timeline_events(shown, events[events["repeat"] == repeat] if len(events) else events)
    timeline = _Timeline(plt, shown, events, variants, repeat, excluded)
    bursts = burst_windows(shown, variants[0], repeat)
    zoom: Callable[[], list[tuple[str, str]]] | None = None
    child: forked.Forked | None = None
    if len(bursts):
        first = bursts.iloc[0]
        length = float(first["end_s"] - first["start_s"])
        window = (float(first["start_s"]) - max(1.0, 0.15 * length),
                  float(first["end_s"]) + max(6.0, 0.9 * length))  # fmt: skip
        title = (f"First burst ({first['group_id']}, {int(first['requests'])} requests), "
                 f"{which}: detection, warm copies landing, queues")  # fmt: skip

        def zoom() -> list[tuple[str, str]]:
            save(timeline.show(window, title), plots_dir / "timeline_zoom.png", dpi=90)
            return [("Timeline around the first burst", "plots/timeline_zoom.png")]

        # the zoom in a child of its own, beside the whole view (the same figure drawn
        # fresh or reused gives the same bytes); a failed child leaves it to this process
        child = forked.start(zoom)
    try:
        fig = timeline.show(None, f"Timeline, {which}: arrivals by route, queue depth and "
                                  "running batch per instance")  # fmt: skip
        save(fig, plots_dir / "timeline.png", dpi=90, close=zoom is None)
        drawn = child.result() if child is not None else None
    finally:  # this drawing failed or was stopped: so is the child's
        stop_drawing(child, plots_dir)
    written = [(f"Timeline ({which})", "plots/timeline.png")]
    if zoom is not None:
        if drawn is None:
            written += zoom()
        else:
            plt.close(fig)
            written += [(str(name), str(path)) for name, path in drawn]
    return written
