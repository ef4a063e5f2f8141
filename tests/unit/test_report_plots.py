"""Report plots: the counter outline, the zoom drawn on the whole timeline's figure, and
byte-for-byte re-rendering of every PNG, in one process or with the timelines drawn in a
forked child."""

from __future__ import annotations

import io
import itertools
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from btb_lab.records import EVENT_COLUMNS
from btb_lab.report import forked, plots, png, timeline_plot


def test_step_outline_drops_to_zero_only_across_gaps() -> None:
    runs = pd.DataFrame({"time_s": [3.0, 0.0, 1.0], "end_s": [4.0, 1.0, 2.0],
                         "value": [1.0, 2.0, 3.0]})  # fmt: skip
    xs, ys = timeline_plot._step_xy(runs)
    assert xs.tolist() == [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert ys.tolist() == [0, 0, 2, 2, 3, 3, 0, 0, 1, 1, 0]


def _run() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Two variants on two instances, a burst of 40 requests at 10–14 s among 200 spread
    ones; the second variant detects it and warms a copy C0 → C1, and one copy never lands."""
    rng = np.random.default_rng(3)
    rows = []
    for variant in ("base", "warm"):
        arrivals = np.concatenate([np.sort(rng.uniform(0, 60, 200)), np.linspace(10, 14, 40)])
        for i, t in enumerate(arrivals):
            burst = i >= 200
            rows.append({
                "variant": variant, "repeat": 0, "request_id": f"{variant}{i}",
                "instance": "C0" if burst or i % 2 else "C1", "prefill_instance": None,
                "route": "HIT" if burst else ("COLD", "BALANCE")[i % 2],
                "arrival_s": t, "finish_s": t + 0.5, "group_id": "job" if burst else None,
                "ok": True, "class": "ALL", "source": "trace", "ttft_s": 0.1 + i / 1000,
                "e2e_s": 0.5 + i / 1000,
            })  # fmt: skip
    events = []
    for variant in ("base", "warm"):
        for inst in ("C0", "C1"):
            for kind in ("waiting", "running"):
                for k in range(0, 60, 3):
                    events.append((variant, 0, float(k), kind, inst, "", "", float(k % 5),
                                   k + 2.0, "", "engine"))  # fmt: skip
    events += [
        ("warm", 0, 10.5, "burst_detected", "C0", "", "", 1.0, np.nan, "", "policy"),
        ("warm", 0, 10.7, "warm_copy", "C1", "C0", "", 1.0, 11.2, "", "engine"),
        ("warm", 0, 12.0, "warm_copy", "C1", "", "", 1.0, np.nan, "", "engine"),
    ]
    return pd.DataFrame(rows), pd.DataFrame(events, columns=list(EVENT_COLUMNS))


def _png(fig: object) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=60, metadata=png.META)  # type: ignore[attr-defined]
    return buffer.getvalue()


def test_zoom_on_the_reused_figure_matches_a_fresh_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timeline_plot, "_TICK_LIMIT", 100)  # whole run binned, the zoom per request
    plt = png.pyplot()
    records, events = _run()
    window = (9.0, 20.0)
    reused = timeline_plot._Timeline(plt, records, events, ["base", "warm"], 0, [(0.0, 2.0)])
    whole = _png(reused.show(None, "whole run"))
    zoom = _png(reused.show(window, "zoom"))
    fresh = timeline_plot._Timeline(plt, records, events, ["base", "warm"], 0, [(0.0, 2.0)])
    assert zoom == _png(fresh.show(window, "zoom"))  # nothing of the whole view is left
    assert zoom != whole
    assert [len(ax.collections) for ax in reused.axes] == [len(ax.collections)
                                                           for ax in fresh.axes]  # fmt: skip
    note = reused.axes[3].texts  # the detecting variant's lanes carry the burst note
    assert len(note) == 1
    assert note[0].get_text().startswith("burst detected at 10.50 s")
    plt.close(reused.fig)
    plt.close(fresh.fig)


def test_plots_rerender_byte_for_byte(tmp_path: Path) -> None:
    records, events = _run()
    utilization = pd.DataFrame({"variant": ["base", "base", "warm", "warm"], "repeat": 0,
                                "instance": ["C0", "C1"] * 2, "device": "0",
                                "utilization": [0.5, 0.3, 0.4, 0.4]})  # fmt: skip

    def render(out: Path) -> dict[str, bytes]:
        written = plots.write_plots(out, records, utilization, ["base", "warm"], ["ALL"],
                                    events=events)  # fmt: skip
        return {path: (tmp_path / out.name / Path(path).name).read_bytes()
                for _, path in written}  # fmt: skip

    first = render(tmp_path / "a")
    assert set(first) == {"plots/timeline.png", "plots/timeline_zoom.png",
                          "plots/latency_cdf.png", "plots/utilization.png"}  # fmt: skip
    assert first == render(tmp_path / "b") == render(tmp_path / "a")


@pytest.mark.parametrize("decades", [1, 4, 7])
def test_cdf_labels_and_title_fit_a_one_column_figure(decades: int) -> None:
    """Latencies over `decades` decades in the narrowest grid (one scope): no two tick
    labels overlap and the title stays inside the figure."""
    ttft = np.logspace(-3, -3 + decades, 500)
    frame = pd.DataFrame({"variant": "v", "ttft_s": ttft, "e2e_s": ttft * 2})
    plt = png.pyplot()
    title = "Latency CDFs per variant (successful requests, each variant's own classes)"
    fig = plots._cdf_grid(plt, frame, ["v"], [("all requests", None)], title)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels()
                     if t.get_visible() and t.get_text()]  # fmt: skip
            boxes = [b for b in boxes if ax.bbox.x0 - 1 <= b.x0 and b.x1 <= ax.bbox.x1 + 1]
            assert len(boxes) >= 2
            for left, right in itertools.pairwise(boxes):
                assert left.x1 <= right.x0, f"tick labels overlap over {decades} decades"
        title_box = fig._suptitle.get_window_extent(renderer)
        assert fig.bbox.x0 <= title_box.x0
        assert title_box.x1 <= fig.bbox.x1
    finally:
        plt.close(fig)


def _render_all(out: Path) -> tuple[list[tuple[str, str]], dict[str, bytes]]:
    records, events = _run()
    utilization = pd.DataFrame({"variant": ["base", "warm"], "repeat": 0, "instance": "C0",
                                "device": "0", "utilization": [0.5, 0.4]})  # fmt: skip
    written = plots.write_plots(out, records, utilization, ["base", "warm"], ["ALL"],
                                events=events)  # fmt: skip
    return written, {path: (out / Path(path).name).read_bytes() for _, path in written}


def _counting_children(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Forks allowed from here on; the list gets each child `forked.start` makes in this
    process."""
    children: list[object] = []
    start = forked.start

    def counted(work: object) -> object:
        child = start(work)  # type: ignore[arg-type]
        children.append(child)
        return child

    monkeypatch.setattr(forked, "fork_allowed", lambda: True)
    monkeypatch.setattr(forked, "start", counted)
    return children


def test_timelines_drawn_in_a_child_are_the_same_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(forked, "fork_allowed", lambda: False)
    alone = _render_all(tmp_path / "alone")
    children = _counting_children(monkeypatch)
    beside = _render_all(tmp_path / "beside")
    assert len(children) == 1
    assert isinstance(children[0], forked.Forked)
    assert beside == alone
    assert [path for _, path in beside[0]][:2] == ["plots/timeline.png", "plots/timeline_zoom.png"]


def _timelines(out: Path) -> tuple[list[tuple[str, str]], dict[str, bytes]]:
    records, events = _run()
    written = timeline_plot.write_timelines(png.pyplot(), out, records, events,
                                            ["base", "warm"], [])  # fmt: skip
    return written, {path: (out / Path(path).name).read_bytes() for _, path in written}


def test_the_zoom_drawn_in_its_own_child_is_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zoom is drawn in a child beside the whole timeline, on a fresh copy of the
    figure; a child that fails leaves it to the process that drew the whole view."""
    (tmp_path / "alone").mkdir()
    monkeypatch.setattr(forked, "fork_allowed", lambda: False)
    alone = _timelines(tmp_path / "alone")
    assert [path for _, path in alone[0]] == ["plots/timeline.png", "plots/timeline_zoom.png"]
    children = _counting_children(monkeypatch)
    (tmp_path / "beside").mkdir()
    assert _timelines(tmp_path / "beside") == alone
    assert len(children) == 1
    assert isinstance(children[0], forked.Forked)
    parent = os.getpid()
    save = timeline_plot.save

    def fails_in_the_child(fig: object, path: Path, *args: object, **kwargs: object) -> None:
        if os.getpid() != parent:
            raise RuntimeError("the child's drawing failed")
        save(fig, path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(timeline_plot, "save", fails_in_the_child)
    (tmp_path / "after").mkdir()
    assert _timelines(tmp_path / "after") == alone


def test_a_failed_timeline_stops_the_child_drawing_its_zoom(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole view fails to save (a full disk, a Ctrl-C): the zoom's child is stopped
    and reaped there, not left drawing into the directory."""
    children = _counting_children(monkeypatch)
    parent = os.getpid()
    save = timeline_plot.save

    def fails_in_the_parent(fig: object, path: Path, *args: object, **kwargs: object) -> None:
        if os.getpid() == parent and path.name == "timeline.png":
            raise OSError(28, "No space left on device")
        if os.getpid() != parent:
            time.sleep(60)  # the child is still drawing
        save(fig, path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(timeline_plot, "save", fails_in_the_parent)
    (tmp_path / "out").mkdir()
    with pytest.raises(OSError, match="No space left"):
        _timelines(tmp_path / "out")
    assert len(children) == 1
    assert isinstance(children[0], forked.Forked)
    with pytest.raises(ChildProcessError):  # reaped: not running, not a zombie either
        os.waitpid(children[0].pid, os.WNOHANG)


def test_a_failed_child_leaves_the_timelines_to_the_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(forked, "fork_allowed", lambda: False)
    alone = _render_all(tmp_path / "alone")
    parent = os.getpid()
    draw = plots.write_timelines

    def fails_in_the_child(*args: object) -> object:
        if os.getpid() != parent:
            raise RuntimeError("the child's drawing failed")
        return draw(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(forked, "fork_allowed", lambda: True)
    monkeypatch.setattr(plots, "write_timelines", fails_in_the_child)
    assert _render_all(tmp_path / "after") == alone


def test_forked_child_answers_fails_or_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forked, "fork_allowed", lambda: True)
    child = forked.start(lambda: [["a", 1], {"pid": os.getpid()}])
    assert child is not None
    answer = child.result()
    assert answer[0] == ["a", 1]
    assert answer[1]["pid"] != os.getpid()

    def boom() -> None:
        raise ValueError("no answer")

    failing = forked.start(boom)
    assert failing is not None
    assert failing.result() is None
    sleeping = forked.start(lambda: time.sleep(60))
    assert sleeping is not None
    sleeping.close()  # killed and reaped: no child is left
    with pytest.raises(ChildProcessError):
        os.waitpid(sleeping.pid, os.WNOHANG)
    monkeypatch.undo()
    monkeypatch.setenv(forked.ENV, "0")
    assert not forked.fork_allowed()
