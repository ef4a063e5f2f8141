"""Repeats that mean something (auto repeats, trace variation) and the event records the
timeline is drawn from (counter runs, reconstruction, storage, the simulator's events)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from btb_lab.analysis.timeline import (
    burst_windows,
    reconstruct_events,
    route_counts,
    timeline_events,
)
from btb_lab.config.workload import RepeatVariation, WorkloadSpec
from btb_lab.events import EventLog, interval_runs, step_runs
from btb_lab.records import EVENT_COLUMNS, EventRecord, Request
from btb_lab.results import read_events, write_events_part
from btb_lab.results.store import finalize_parquet
from btb_lab.workload import load_requests
from btb_lab.workload.variation import jitter_arrivals, resample_windows
from tests.unit.test_runner_fake import HYPOTHESIS, fake_effects, run_fake, write_hypothesis

__all__ = ["fake_effects"]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "workload"


# ---------------------------------------------------------------------------- counters


def test_step_runs_keep_each_interval_s_peak() -> None:
    # [0.1, 0.6), [0.2, 1.1), [1.0, 1.2) on a 0.25 s grid
    runs = interval_runs(np.array([0.1, 0.2, 1.0]), np.array([0.6, 1.1, 1.2]), 0.25)
    assert runs == [(0.0, 0.75, 2.0), (0.75, 1.0, 1.0), (1.0, 1.25, 2.0)]
    # a finish and an admission at the same instant are no peak
    assert interval_runs(np.array([0.0, 0.5]), np.array([0.5, 0.9]), 0.25) == [(0.0, 1.0, 1.0)]
    assert step_runs(np.array([]), np.array([])) == []


def test_step_runs_cost_the_changes_not_the_span() -> None:
    # two busy spells a billion seconds apart: the grid between them held 4e9 bins (a
    # MemoryError of 30 GiB); the bins without a change keep the value before them
    runs = step_runs(np.array([0.1, 0.3, 0.6, 1e9, 1e9 + 0.1]), np.array([1, 1, -1, 1, -2]), 0.25)
    assert runs == [(0.0, 0.25, 1.0), (0.25, 0.75, 2.0), (0.75, 1e9, 1.0), (1e9, 1e9 + 0.25, 2.0)]
    # a counter back to zero between spells: the zero run between them stays
    runs = step_runs(np.array([0.0, 0.5, 10.0, 10.2]), np.array([1, -1, 1, -1]), 0.25)
    assert runs == [(0.0, 0.5, 1.0), (0.5, 10.0, 0.0), (10.0, 10.25, 1.0)]


def test_event_log_turns_counter_changes_into_runs() -> None:
    log = EventLog("engine", interval_s=1.0)
    for t, d in ((0.2, 1), (0.4, 1), (1.5, -1), (2.5, -1)):
        log.change("C0", "waiting", t, d)
    log.warm_copy(3.0, 3.1, "C1", "C0", 4096, request_id="r1")
    events = log.records()
    waiting = [(e.time_s, e.end_s, e.value) for e in events if e.kind == "waiting"]
    assert waiting == [(0.0, 2.0, 2.0), (2.0, 3.0, 1.0)]
    (copy,) = [e for e in events if e.kind == "warm_copy"]
    assert (copy.instance, copy.peer, copy.end_s, copy.origin) == ("C1", "C0", 3.1, "engine")


def test_counter_appenders_give_the_runs_change_gives() -> None:
    """The engine's rise/fall appenders and `change` build the same runs, mixed or not,
    whatever order the changes at one instant come in."""
    rng = np.random.default_rng(3)
    times = np.round(rng.uniform(0, 20, 400), 1).tolist()  # many changes share an instant
    deltas = [1 if i % 3 else -1 for i in range(400)]
    by_change = EventLog("engine")
    by_counter = EventLog("engine")
    mixed = EventLog("engine")
    rise, fall = by_counter.counter("C0", "running")
    mixed_rise, mixed_fall = mixed.counter("C0", "running")
    for i, (t, d) in enumerate(zip(times, deltas, strict=True)):
        by_change.change("C0", "running", t, d)
        (rise if d > 0 else fall)(t)
        if i % 2:
            mixed.change("C0", "running", t, d)
        else:
            (mixed_rise if d > 0 else mixed_fall)(t)
    expected = by_change.records()
    assert len(expected) > 10
    assert by_counter.records() == expected
    assert mixed.records() == expected
    idle = EventLog("engine")
    idle.counter("C1", "waiting")  # a counter that never moves stores nothing
    assert idle.records() == []


def test_events_round_trip_through_parts_and_parquet(tmp_path: Path) -> None:
    events = [
        EventRecord(time_s=2.0, kind="burst_detected", label="ab", value=2, origin="policy"),
        EventRecord(time_s=1.0, kind="warm_copy", instance="C1", peer="C0", end_s=None),
    ]
    write_events_part(tmp_path, "btb", 0, events)
    parts = read_events(tmp_path)  # before the parquet exists: the JSONL parts
    assert list(parts.columns) == list(EVENT_COLUMNS)
    assert list(parts["time_s"]) == [1.0, 2.0]  # ordered by time
    assert np.isnan(parts["end_s"].iloc[0])  # a copy that never landed
    finalize_parquet(tmp_path, ["btb"])
    stored = read_events(tmp_path)
    pd.testing.assert_frame_equal(stored, parts)
    assert read_events(tmp_path / "nothing").empty  # runs from before events: empty


# ---------------------------------------------------------------------------- reconstruction


def _record(**kw: object) -> dict[str, object]:
    row = {"variant": "v", "repeat": 0, "request_id": "r", "instance": "C0", "ok": True,
           "prefill_instance": None, "sent_s": 0.0, "arrival_s": 0.0, "queue_s": 0.0,
           "prefill_s": 0.0, "kv_load_s": 0.0, "kv_transfer_s": 0.0, "first_token_s": 1.0,
           "finish_s": 2.0, "input_tokens": 100, "group_id": None}  # fmt: skip
    row.update(kw)
    return row


def test_queue_and_batch_are_rebuilt_from_simulator_stamps() -> None:
    records = pd.DataFrame([
        # waits 1 s, prefills 0.5 s (first token at 1.5), decodes until 3
        _record(request_id="a", queue_s=1.0, prefill_s=0.5, first_token_s=1.5, finish_s=3.0),
        # offloaded: waits and prefills on C1 until 2.0, KV moves 0.5 s, decodes on C0
        _record(request_id="b", prefill_instance="C1", queue_s=0.5, prefill_s=1.5,
                kv_transfer_s=0.5, first_token_s=2.5, finish_s=4.0),
    ])  # fmt: skip
    ev = reconstruct_events(records, "v", 0, interval_s=0.5)
    assert set(ev["origin"]) == {"records"}

    def runs(kind: str, inst: str) -> list[tuple[float, float, float]]:
        rows = ev[(ev["kind"] == kind) & (ev["instance"] == inst)]
        return list(zip(rows["time_s"], rows["end_s"], rows["value"], strict=True))

    assert runs("waiting", "C0") == [(0.0, 1.0, 1.0)]
    assert runs("running", "C0") == [(1.0, 2.5, 1.0), (2.5, 3.0, 2.0), (3.0, 4.0, 1.0)]
    assert runs("waiting", "C1") == [(0.0, 0.5, 1.0)]
    assert runs("running", "C1") == [(0.5, 2.0, 1.0)]
    (transfer,) = ev[ev["kind"] == "kv_transfer"].itertuples()
    assert (transfer.time_s, transfer.end_s, transfer.instance, transfer.peer) == (
        2.0, 2.5, "C0", "C1"
    )  # fmt: skip


def test_a_run_where_every_request_was_offloaded_is_rebuilt_too() -> None:
    """Full PD separation: no request is co-located, so C0 only ever decodes."""
    records = pd.DataFrame([
        _record(request_id="b", prefill_instance="PS1", queue_s=0.5, prefill_s=1.5,
                kv_transfer_s=0.5, first_token_s=2.5, finish_s=4.0),
    ])  # fmt: skip
    ev = reconstruct_events(records, "v", 0, interval_s=0.5)
    running = ev[ev["kind"] == "running"]
    assert set(running["instance"]) == {"PS1", "C0"}
    assert list(running.loc[running["instance"] == "C0", "time_s"]) == [2.5]
    assert len(ev[ev["kind"] == "kv_transfer"]) == 1


def test_only_a_named_prefill_instance_makes_a_request_offloaded() -> None:
    """None, NaN and an empty name (JSONL parts, older parquet files) are co-located."""
    records = pd.DataFrame([
        _record(request_id=str(i), prefill_instance=p, queue_s=0.5, prefill_s=0.5)
        for i, p in enumerate([None, float("nan"), "", "PS0"])
    ])  # fmt: skip
    ev = reconstruct_events(records, "v", 0, interval_s=0.5)
    (transfer,) = ev[ev["kind"] == "kv_transfer"].itertuples()
    assert (transfer.request_id, transfer.peer) == ("3", "PS0")
    assert set(ev.loc[ev["kind"] == "waiting", "instance"]) == {"C0", "PS0"}


def test_stored_kinds_are_not_reconstructed_again() -> None:
    records = pd.DataFrame([_record(queue_s=0.5, prefill_s=0.5)])
    stored = pd.DataFrame([{"variant": "v", "repeat": 0, "time_s": 0.0, "kind": "waiting",
                            "instance": "C0", "peer": "", "request_id": "", "value": 3.0,
                            "end_s": 1.0, "label": "", "origin": "engine"}])  # fmt: skip
    merged = timeline_events(records, stored)
    assert set(merged.loc[merged["kind"] == "waiting", "origin"]) == {"engine"}
    assert set(merged.loc[merged["kind"] == "running", "origin"]) == {"records"}


def test_route_counts_are_a_groupby_of_instance_route_and_bin() -> None:
    rng = np.random.default_rng(3)
    rows = [
        _record(request_id=str(i), instance=f"C{rng.integers(0, 11)}", arrival_s=a,
                route=str(rng.choice(["COLD", "CACHE_HIT", "BALANCE"])))
        for i, a in enumerate(rng.uniform(0, 100, 400))
    ]  # fmt: skip
    rows += [_record(request_id="x", arrival_s=float("nan"), route="COLD")]
    rows += [_record(request_id="y", variant="w", route="COLD")]  # another variant: left out
    records = pd.DataFrame(rows)
    mine = records[records["variant"] == "v"]
    bins = np.floor(mine["arrival_s"].to_numpy(float) / 7.5) * 7.5
    expected = (
        pd.DataFrame({"instance": mine["instance"], "route": mine["route"], "bin_start_s": bins})
        .groupby(["instance", "route", "bin_start_s"], sort=True)
        .size()
        .rename("requests")
        .reset_index()
    )
    counts = route_counts(records, "v", 0, 7.5)
    pd.testing.assert_frame_equal(counts, expected)  # C10 sorts before C2, as text
    assert counts["requests"].sum() == 400


def test_burst_windows_are_dense_groups() -> None:
    rows = [_record(request_id=f"b{i}", group_id="job", arrival_s=10 + 0.1 * i) for i in range(9)]
    rows += [_record(request_id=f"s{i}", group_id="system", arrival_s=20.0 * i) for i in range(9)]
    rows += [_record(request_id="d", group_id="decoy", arrival_s=5.0)]
    windows = burst_windows(pd.DataFrame(rows), "v", 0)
    assert list(windows["group_id"]) == ["job"]
    assert windows["start_s"].iloc[0] == 10
    assert windows["end_s"].iloc[0] == pytest.approx(10.8)


# ---------------------------------------------------------------------------- the simulator


def test_simulator_stores_detections_and_warm_copies(tmp_path: Path) -> None:
    from btb_lab.runner import RunOptions, run_hypothesis

    root = Path(__file__).resolve().parents[2]
    outcome = run_hypothesis(
        root / "hypotheses" / "btb.yaml",
        RunOptions(out=tmp_path / "run", repeats=1, progress=False,
                   overrides={"workload.generator.params.windows": 1}),
    )  # fmt: skip
    events = read_events(outcome.run_dir)
    btb = events[events["variant"] == "btb"]
    (detected,) = btb[btb["kind"] == "burst_detected"].itertuples()
    copies = btb[btb["kind"] == "warm_copy"]
    assert len(copies) == 3  # M = 4 warm replicas: the holder plus three copies
    assert (copies["time_s"] > detected.time_s).all()  # KV must exist before it is copied
    assert (copies["end_s"] > copies["time_s"]).all()
    # the engine records every variant's queue and batch; only BTB detects and warms
    cache_aware = events[events["variant"] == "cache_aware"]
    assert set(cache_aware["kind"]) == {"waiting", "running"}
    assert set(events.loc[events["kind"].isin(["waiting", "running"]), "origin"]) == {"engine"}
    assert (outcome.run_dir / "plots" / "timeline_zoom.png").is_file()


# ---------------------------------------------------------------------------- repeats


def test_auto_repeats_add_repeats_until_the_interval_is_tight(tmp_path, fake_effects) -> None:
    fake_effects["fast"] = 0.5
    text = HYPOTHESIS.replace("repeats: 1\n", "repeats: auto\nauto_repeats: {min: 2, max: 6, "
                              "half_width: 0.02}\n")  # fmt: skip
    path = write_hypothesis(tmp_path, text)
    from btb_lab.runner import RunOptions, run_hypothesis

    outcome = run_hypothesis(path, RunOptions(backend="fake", out=tmp_path / "run",
                                              progress=False))  # fmt: skip
    manifest = json.loads((outcome.run_dir / "manifest.json").read_text())
    # a 2-point half-width on 120 requests per repeat is out of reach: the cap
    assert manifest["repeats"] == 6
    assert manifest["runs_planned"] == 12
    assert manifest["complete"] is True
    assert manifest["hypothesis"]["repeats"] == "auto"
    report = (outcome.run_dir / "report.md").read_text()
    assert "repeats 6 (auto: 2 to 6" in report
    primary = outcome.summary.verdict.variants["fast"].primary
    assert len(primary.repeat_changes) == 6
    # an explicit count wins over `repeats: auto`
    again = run_hypothesis(path, RunOptions(backend="fake", out=tmp_path / "fixed", repeats=2,
                                            progress=False))  # fmt: skip
    assert json.loads((again.run_dir / "manifest.json").read_text())["repeats"] == 2


def test_auto_repeats_stop_at_the_minimum_when_tight(tmp_path, fake_effects) -> None:
    fake_effects["fast"] = 0.5
    text = HYPOTHESIS.replace("repeats: 1\n", "repeats: auto\nauto_repeats: {min: 2, max: 6, "
                              "half_width: 0.5}\n")  # fmt: skip
    from btb_lab.runner import RunOptions, run_hypothesis

    options = RunOptions(backend="fake", out=tmp_path / "run", progress=False)
    outcome = run_hypothesis(write_hypothesis(tmp_path, text), options)
    assert json.loads((outcome.run_dir / "manifest.json").read_text())["repeats"] == 2


def test_generator_repeats_draw_new_workloads(tmp_path, fake_effects) -> None:
    from tests.unit.test_runner_fake import SEEN

    run_fake(tmp_path, repeats=2)
    by_repeat = {rep: arrivals for _, rep, _, arrivals in SEEN}
    assert by_repeat[0] != by_repeat[1]


def test_a_trace_is_parsed_once_for_all_repeats(
    tmp_path: Path, fake_effects, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every repeat replays what loading the trace afresh for its seed gives (the run
    keeps the parsed file: `WorkloadCache`), and the file is parsed once."""
    from btb_lab.runner import RunOptions, derive_seed, run_hypothesis
    from btb_lab.workload import loader
    from tests.unit.test_runner_fake import SEEN

    parses: list[Path] = []
    parse = loader.load_trace

    def counted(path: Path, *args: object, **kwargs: object) -> object:
        parses.append(path)
        return parse(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loader, "load_trace", counted)
    trace = FIXTURES / "bursted_art_small.jsonl"
    text = HYPOTHESIS.replace(
        "  generator:\n    kind: poisson\n    params: {requests: 120, rate_per_s: 4.0}\n",
        f"  trace: {{path: {trace}, format: bursted-art}}\n"
        "  variation: {arrival_jitter_s: 0.5, resample_windows: true}\n",
    ).replace("repeats: 1\n", "repeats: 3\n")
    run_hypothesis(write_hypothesis(tmp_path, text),
                   RunOptions(backend="fake", out=tmp_path / "run", progress=False))  # fmt: skip
    assert parses == [trace]
    spec = _trace_spec(arrival_jitter_s=0.5, resample_windows=True)
    replayed = {(rep, arrivals) for _, rep, _, arrivals in SEEN}
    expected = set()
    for rep in range(3):
        fresh = load_requests(spec, base_dir=FIXTURES, seed=derive_seed(3, "workload", rep))
        expected.add((rep, tuple((r.request_id, r.arrival_s) for r in fresh)))
    assert replayed == expected
    assert len({arrivals for _, arrivals in replayed}) == 3


def _trace_spec(**variation: object) -> WorkloadSpec:
    return WorkloadSpec.model_validate({
        "trace": {"path": str(FIXTURES / "bursted_art_small.jsonl"), "format": "bursted-art"},
        "variation": variation or None,
    })  # fmt: skip


def test_trace_replays_repeat_exactly_without_variation() -> None:
    spec = _trace_spec()
    a = load_requests(spec, base_dir=FIXTURES, seed=1)
    b = load_requests(spec, base_dir=FIXTURES, seed=2)
    assert [(r.request_id, r.arrival_s) for r in a] == [(r.request_id, r.arrival_s) for r in b]


def test_trace_variation_is_seeded_and_differs_between_repeats() -> None:
    spec = _trace_spec(arrival_jitter_s=0.5, resample_windows=True)
    a = load_requests(spec, base_dir=FIXTURES, seed=1)
    again = load_requests(spec, base_dir=FIXTURES, seed=1)
    b = load_requests(spec, base_dir=FIXTURES, seed=2)
    key = [(r.request_id, r.arrival_s) for r in a]
    assert key == [(r.request_id, r.arrival_s) for r in again]
    assert key != [(r.request_id, r.arrival_s) for r in b]
    assert len({r.request_id for r in a}) == len(a)  # a window drawn twice gets new ids
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)


def test_resampled_windows_are_drawn_with_replacement() -> None:
    requests = [Request(request_id=f"{w}-{i}", arrival_s=float(i), input_tokens=1,
                        output_tokens=1, trace_id=w, session_id=f"{w}-s")
                for w in ("A", "B", "C") for i in range(2)]  # fmt: skip
    drawn = resample_windows(requests, np.random.default_rng(3))  # draws C, A, A
    assert [r.trace_id for r in drawn] == ["C", "C", "A", "A", "A~1", "A~1"]
    assert [r.request_id for r in drawn[4:]] == ["A-0~1", "A-1~1"]
    assert {r.session_id for r in drawn[4:]} == {"A-s~1"}  # a copy is its own session


def test_a_window_drawn_twice_gets_new_ids_for_its_own_blocks() -> None:
    """The copy of A would find A's KV still cached and replay warm (a repeat whose
    spread measures that, not the workload); block 7, which B has too (a shared system
    prompt), keeps its id, so the copy still shares it as any window does."""
    blocks = {"A": (7, 100, 101), "B": (7, 200), "C": (300, 301)}
    requests = [Request(request_id=f"{w}-{i}", arrival_s=float(i), input_tokens=1024,
                        output_tokens=1, trace_id=w, block_hashes=blocks[w][: 2 + i])
                for w in ("A", "B", "C") for i in range(2)]  # fmt: skip
    drawn = resample_windows(requests, np.random.default_rng(3))  # draws C, A, A
    original, copy = drawn[2:4], drawn[4:]
    assert [r.block_hashes for r in original] == [(7, 100), (7, 100, 101)]
    first, second = copy[0].block_hashes, copy[1].block_hashes
    assert first[0] == second[0] == 7  # shared with B: kept
    assert second[:2] == first
    assert len(set(second)) == 3
    assert not set(second[1:]) & {100, 101, 200, 300, 301}  # new ids for its own blocks
    again = resample_windows(requests, np.random.default_rng(3))
    assert [r.block_hashes for r in again] == [r.block_hashes for r in drawn]  # stable


def test_jitter_keeps_session_turns_in_order() -> None:
    requests = [
        Request(request_id=f"t{t}", arrival_s=float(t) * 0.1, input_tokens=1, output_tokens=1,
                session_id="s", turn=t + 1)
        for t in range(20)
    ]  # fmt: skip
    jitter_arrivals(requests, 1.0, np.random.default_rng(0))
    times = [r.arrival_s for r in sorted(requests, key=lambda r: r.turn)]
    assert times == sorted(times)
    assert min(times) >= 0
    assert RepeatVariation(arrival_jitter_s=1.0).resample_windows is False


def test_jitter_past_the_start_shifts_arrivals_instead_of_piling_them_at_zero() -> None:
    # a jitter far larger than the trace: clipping at 0 put about half the requests at 0
    requests = [
        Request(request_id=f"r{i}", arrival_s=float(i), input_tokens=1, output_tokens=1)
        for i in range(91)
    ]
    draws = np.random.default_rng(5).uniform(-1e6, 1e6, len(requests))
    jitter_arrivals(requests, 1e6, np.random.default_rng(5))
    times = np.array([r.arrival_s for r in requests])
    assert (times == 0).sum() == 1
    assert times.min() == 0
    # the gaps between jittered arrivals are the draws' own: one shift for all
    expected = np.arange(91.0) + draws
    np.testing.assert_allclose(times, expected - expected.min(), rtol=0, atol=1e-6)


def test_jitter_keeps_each_windows_sessions_in_their_window() -> None:
    # windows A and B both have a session `s1` (ids are per window): a 1 s jitter handed
    # A's second turn B's time, about 100 s later
    requests = [
        Request(request_id=f"{w}{t}", arrival_s=base + 10.0 * (t - 1), input_tokens=1,
                output_tokens=1, trace_id=w, session_id="s1", turn=t)
        for w, base in (("A", 0.0), ("B", 110.0)) for t in (1, 2)
    ]  # fmt: skip
    jitter_arrivals(requests, 1.0, np.random.default_rng(0))
    moved = {r.request_id: r.arrival_s for r in requests}
    for rid, original in (("A1", 0.0), ("A2", 10.0), ("B1", 110.0), ("B2", 120.0)):
        assert abs(moved[rid] - original) <= 2.0, (rid, moved)
