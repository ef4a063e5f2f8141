"""The results store: durable JSONL and Arrow parts, parquet conversion, run-dir
resolution."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from btb_lab.errors import UserError
from btb_lab.records import RECORD_COLUMNS, STORED_COLUMNS, RequestRecord, UtilSample
from btb_lab.results import (
    ArrowRecordSink,
    JsonlRecordSink,
    Manifest,
    finalize_parquet,
    new_run_dir,
    read_events,
    read_records,
    read_utilization,
    resolve_run_dir,
    stored_frames,
    write_utilization_part,
)


def rec(i: int, variant: str = "v") -> RequestRecord:
    return RequestRecord(
        variant=variant, repeat=0, request_id=f"r{i}", trace_id="t", source="gen",
        session_id=None, instance="C0", route="COLO", arrival_s=float(i), sent_s=float(i),
        first_token_s=i + 0.5, finish_s=i + 1.0, input_tokens=100, output_tokens=5,
        klass="WARM", extra={"k": 1},
    )  # fmt: skip


SINKS = [JsonlRecordSink, ArrowRecordSink]
Sink = type[JsonlRecordSink] | type[ArrowRecordSink]


@pytest.mark.parametrize("sink_cls", SINKS)
def test_sink_flushes_every_write_and_parquet_has_record_columns(
    tmp_path: Path, sink_cls: Sink
) -> None:
    sink = sink_cls(tmp_path, "v", 0)
    sink.write([rec(0), rec(1)])
    # readable before close: a crash now loses nothing already written
    assert len(read_records(tmp_path)) == 2
    sink.write([rec(2)])
    sink.close()
    write_utilization_part(tmp_path, "v", 0, [UtilSample(0.0, "C0", "sim", 0.5)])
    finalize_parquet(tmp_path, ["v"])
    frame = read_records(tmp_path)
    assert list(frame.columns) == [*STORED_COLUMNS, "extra"]
    assert set(RECORD_COLUMNS) < set(STORED_COLUMNS)
    # the latencies are stored, derived from the stamps (no always-empty column)
    assert frame["ttft_s"].tolist() == [0.5, 0.5, 0.5]
    assert frame["e2e_s"].tolist() == [1.0, 1.0, 1.0]
    assert frame["tpot_s"].tolist() == [0.125, 0.125, 0.125]
    assert frame["request_id"].tolist() == ["r0", "r1", "r2"]
    assert frame["class"].tolist() == ["WARM"] * 3
    assert frame["first_token_s"].tolist() == [0.5, 1.5, 2.5]


def test_truncated_last_line_is_skipped(tmp_path: Path) -> None:
    sink = JsonlRecordSink(tmp_path, "v", 0)
    sink.write([rec(0)])
    sink.close()
    with sink.path.open("a") as fh:
        fh.write('{"variant": "v", "repe')  # a write cut short by a crash
    assert read_records(tmp_path)["request_id"].tolist() == ["r0"]


def test_a_cut_arrow_part_keeps_the_batches_before_the_cut(tmp_path: Path) -> None:
    sink = ArrowRecordSink(tmp_path, "v", 0)
    sink.write([rec(0), rec(1)])
    sink.write([rec(2)])
    sink.close()
    again = ArrowRecordSink(tmp_path, "v", 0)  # a second stream appended to the part
    again.write([rec(3)])
    again.close()
    assert read_records(tmp_path)["request_id"].tolist() == ["r0", "r1", "r2", "r3"]
    data = sink.path.read_bytes()
    sink.path.write_bytes(data[:-12])  # the last batch cut short by a crash
    assert read_records(tmp_path)["request_id"].tolist() == ["r0", "r1", "r2"]
    # a kill before the stream's end marker: every batch flushed is there
    open_sink = ArrowRecordSink(tmp_path, "w", 0)
    open_sink.write([rec(7, "w")])
    assert read_records(tmp_path)["request_id"].tolist() == ["r0", "r1", "r2", "r7"]


def test_arrow_and_jsonl_parts_store_the_same_parquet(tmp_path: Path) -> None:
    """The simulator's binary parts are a faster way to the same stored records."""
    odd = [rec(i) for i in range(5)]
    odd[1].first_token_s = odd[1].finish_s = None  # a failed request
    odd[1].ok, odd[1].error, odd[1].klass, odd[1].extra = False, 'refused: "x"\n', None, {}
    odd[2].queue_s = math.nan
    odd[3].arrival_s = 3  # an int in a float column
    odd[4].session_id, odd[4].turn, odd[4].extra = "s/é", 2, {"b": [1, 2], "a": None}
    stored = []
    for sink_cls in SINKS:
        run_dir = tmp_path / sink_cls.__name__
        for variant in ("b", "a"):
            sink = sink_cls(run_dir, variant, 0)
            sink.write(odd[:2])
            sink.write(odd[2:])
            sink.close()
        finalize_parquet(run_dir, ["b", "a"])
        stored.append((run_dir / "requests.parquet").read_bytes())
    assert stored[0] == stored[1]


@pytest.mark.parametrize("sink_cls", SINKS)
def test_the_frames_written_are_what_reading_back_gives(tmp_path: Path, sink_cls: Sink) -> None:
    """The report of a run that just stored itself takes `finalize_parquet`'s frames
    instead of reading the files again: they must be the frames the readers give, value
    for value and type for type; a frame that might not be (none here: no rows) is None."""
    import pandas as pd

    odd = [rec(i) for i in range(5)]
    odd[1].first_token_s = odd[1].finish_s = None
    odd[1].ok, odd[1].error, odd[1].klass, odd[1].extra = False, "refused", None, {}
    odd[2].queue_s = math.nan
    odd[4].session_id, odd[4].turn, odd[4].extra = "s/é", 2, {"b": [1, 2], "a": None}
    for variant in ("b", "a"):
        sink = sink_cls(tmp_path, variant, 0)
        sink.write(odd)
        sink.close()
    write_utilization_part(tmp_path, "a", 0, [UtilSample(0.0, "C0", "sim", 0.5)])
    frames = finalize_parquet(tmp_path, ["b", "a"])
    assert frames.events is None  # no events: the reader's empty frame is its own
    for frame, read in ((frames.requests, read_records), (frames.utilization, read_utilization)):
        assert frame is not None
        again = read(tmp_path)
        assert list(frame.dtypes) == list(again.dtypes)
        pd.testing.assert_frame_equal(frame, again, check_exact=True)
    assert frames.requests is not None
    assert len(frames.requests) == 10
    # what another process draws from while this one writes: each frame as read back
    for frame, read in zip(
        stored_frames(tmp_path, ["b", "a"]), (read_records, read_utilization, read_events),
        strict=True,
    ):  # fmt: skip
        again = read(tmp_path)
        assert list(frame.dtypes) == list(again.dtypes)
        pd.testing.assert_frame_equal(frame, again, check_exact=True)


def test_jsonl_and_arrow_parts_side_by_side_are_both_read(tmp_path: Path) -> None:
    for sink_cls, name in ((JsonlRecordSink, "a"), (ArrowRecordSink, "b")):
        sink = sink_cls(tmp_path, name, 0)
        sink.write([rec(0, name), rec(1, name)])
        sink.close()
    frame = read_records(tmp_path, ["b", "a"])
    assert frame["variant"].tolist() == ["b", "b", "a", "a"]
    assert frame["extra"].tolist() == ['{"k": 1}'] * 4


@pytest.mark.parametrize("sink_cls", SINKS)
def test_variant_order_is_kept(tmp_path: Path, sink_cls: Sink) -> None:
    for name in ("zeta", "alpha"):
        sink = sink_cls(tmp_path, name, 0)
        sink.write([rec(0, name)])
        sink.close()
    finalize_parquet(tmp_path, ["zeta", "alpha"])
    assert read_records(tmp_path)["variant"].tolist() == ["zeta", "alpha"]


def test_rows_go_by_variant_order_then_repeat_one_not_named_last(tmp_path: Path) -> None:
    for name, repeats in (("b", (1, 1, 0)), ("x", (0,)), ("a", (2, 0))):
        sink = ArrowRecordSink(tmp_path, name, 0)
        records = [rec(i, name) for i in range(len(repeats))]
        for record, repeat in zip(records, repeats, strict=True):
            record.repeat = repeat
        sink.write(records)
        sink.close()
    frame = read_records(tmp_path, ["b", "a"])
    assert list(zip(frame["variant"], frame["repeat"], frame["request_id"], strict=True)) == [
        ("b", 0, "r2"), ("b", 1, "r0"), ("b", 1, "r1"), ("a", 0, "r1"), ("a", 2, "r0"),
        ("x", 0, "r0"),
    ]  # fmt: skip


def manifest(run_dir: Path, hid: str = "H1", **fields: object) -> Manifest:
    data: dict[str, object] = {
        "run_id": run_dir.name, "run_dir": str(run_dir), "hypothesis_id": hid,
        "hypothesis_file": "h.yaml", "hypothesis": {}, "backend": "sim", "variants": ["a"],
        "repeats": 1, "master_seed": 0, "runs_planned": 1, "started": "now",
        "finished": "later", "complete": True,
    }  # fmt: skip
    data.update(fields)
    m = Manifest.model_validate(data)
    m.save(run_dir)
    return m


def test_run_dirs_and_resolution(tmp_path: Path) -> None:
    a = new_run_dir(tmp_path, "H1")
    b = new_run_dir(tmp_path, "H1")
    assert a != b
    assert a.parent == tmp_path / "H1"
    for d in (a, b):
        manifest(d)
    assert resolve_run_dir("H1", tmp_path) == max(a, b)
    assert resolve_run_dir(a, tmp_path) == a
    with pytest.raises(UserError, match="neither a run directory"):
        resolve_run_dir("H9", tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    with pytest.raises(UserError, match="not empty"):
        new_run_dir(tmp_path, "H1", out=tmp_path / "out")


def test_parts_read_as_columns_give_the_frames_the_line_reader_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pyarrow reads whole parts as columns; the frames (values and dtypes) are those of
    reading every line with json.loads, including NaN, infinities, missing stamps, failed
    requests, integers in float columns and `extra`."""
    import math

    import pandas as pd

    from btb_lab.records import EventRecord
    from btb_lab.results import parts, store

    odd = [
        rec(0),
        RequestRecord(
            variant="v", repeat=1, request_id="r-fail", trace_id="t", source="gen",
            session_id="s1", instance="C1", route="HEAVY_OFFLOAD", arrival_s=3, sent_s=3.25,
            first_token_s=None, finish_s=math.nan, input_tokens=0, output_tokens=1,
            ok=False, error="timeout", klass=None, prefill_instance="P0", cache_tier="ram",
            queue_s=math.inf, extra={},
        ),
        RequestRecord(
            variant="w/2", repeat=0, request_id="r2", trace_id="t2", source="art",
            session_id=None, instance="C0", route="COLO", arrival_s=1e-300, sent_s=1.0,
            first_token_s=2.000000000000001, finish_s=2.5, input_tokens=10**9,
            output_tokens=7, cached_tokens=512, turn=3, group_id="g", decode_s=-math.inf,
            extra={"steps": 4, "why": "x"},
        ),
    ]  # fmt: skip
    for variant, records in (("v", odd[:2]), ("w/2", odd[2:])):
        sink = JsonlRecordSink(tmp_path, variant, 0)
        sink.write(records)
        sink.close()
    write_utilization_part(tmp_path, "v", 0, [UtilSample(0.0, "C0", "sim", 0.5, 3)])
    store.write_events_part(tmp_path, "v", 0, [
        EventRecord(1.0, "warm_copy", "C1", "C0", "r2", 4096.0, math.nan, "rdma", "policy"),
        EventRecord(0.5, "waiting", "C0", value=2),
    ])  # fmt: skip
    read = {
        "requests": lambda: parts.typed_records(parts.read_parts(tmp_path, "requests"), ["v"]),
        "util": lambda: parts.typed_util(parts.read_parts(tmp_path, "util"), ["v"]),
        "events": lambda: parts.typed_events(parts.read_parts(tmp_path, "events"), ["v"]),
    }
    import pyarrow as pa

    for kind, frame_of in read.items():
        assert isinstance(parts.read_parts(tmp_path, kind), pa.Table)  # the columnar reader
        columnar = frame_of()
        with monkeypatch.context() as patch:
            patch.setattr(parts, "_read_parts_columnar", lambda files, types: None)
            assert isinstance(parts.read_parts(tmp_path, kind), list)
            lines = frame_of()
        pd.testing.assert_frame_equal(columnar, lines, check_exact=True)
    assert len(read["requests"]()) == 3


def test_arrow_util_and_event_parts_read_back_as_the_jsonl_ones(tmp_path: Path) -> None:
    """The simulator writes its utilization and event parts as Arrow: the frames read from
    them (NaN, None, integers in float columns, ties in time, a variant without events)
    equal those of JSONL parts, every part of a run is in one format, and a value Arrow
    refuses sends that part to JSONL instead of failing the run."""
    import math

    import pandas as pd

    from btb_lab.records import EventRecord
    from btb_lab.results import store

    samples = [UtilSample(0.0, "C0", "sim", 0.5, 3), UtilSample(0.25, "C1", "sim", 1, math.nan)]
    events = [
        EventRecord(1.0, "warm_copy", "C1", "C0", "r2", 4096.0, math.nan, "rdma", "policy"),
        EventRecord(0.5, "waiting", "C0", value=2),
        EventRecord(0.5, "running", None, value=1, end_s=math.inf),
    ]  # fmt: skip
    frames = {}
    for fmt in ("jsonl", "arrow"):
        run_dir = tmp_path / fmt
        write_utilization_part(run_dir, "v", 2, samples, fmt)
        store.write_events_part(run_dir, "v", 2, events, fmt)
        frames[fmt] = (read_utilization(run_dir, ["v"]), read_events(run_dir, ["v"]))
        # a variant with no events: an empty part in the same format as the others
        store.write_events_part(run_dir, "w", 0, [], fmt)
        frames[fmt] += (read_events(run_dir, ["v", "w"]),)
    for jsonl, arrow in zip(frames["jsonl"], frames["arrow"], strict=True):
        pd.testing.assert_frame_equal(jsonl, arrow, check_exact=True)
    assert len(frames["arrow"][2]) == 3
    for fmt in ("jsonl", "arrow"):
        suffixes = {part.suffix for part in (tmp_path / fmt / "parts").iterdir()}
        assert suffixes == {".jsonl" if fmt == "jsonl" else ".arrows"}
    empty = {}
    for fmt in ("jsonl", "arrow"):  # every variant without events
        store.write_events_part(tmp_path / "empty" / fmt, "w", 0, [], fmt)
        empty[fmt] = read_events(tmp_path / "empty" / fmt, ["w"])
    pd.testing.assert_frame_equal(empty["jsonl"], empty["arrow"], check_exact=True)
    assert frames["arrow"][1]["kind"].tolist() == ["waiting", "running", "warm_copy"]
    wide = [UtilSample(0.0, "C0", "sim", 0.5, 10**400)]  # no float64 holds it
    write_utilization_part(tmp_path / "wide", "v", 0, wide, "arrow")
    assert [p.suffix for p in (tmp_path / "wide" / "parts").iterdir()] == [".jsonl"]


def test_record_row_names_every_column_in_order() -> None:
    from btb_lab.results.store import record_row

    row = record_row(rec(3))
    assert list(row) == [*RECORD_COLUMNS, "extra"]
    assert row["class"] == "WARM"
    assert (row["request_id"], row["first_token_s"], row["ok"]) == ("r3", 3.5, True)
    assert row["extra"] == '{"k": 1}'
    assert row["error"] is None
