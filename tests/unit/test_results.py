"""The results store: durable JSONL parts, parquet conversion, run-dir resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from btb_lab.errors import UserError
from btb_lab.records import RECORD_COLUMNS, STORED_COLUMNS, RequestRecord, UtilSample
from btb_lab.results import (
    JsonlRecordSink,
    Manifest,
    finalize_parquet,
    new_run_dir,
    read_records,
    resolve_run_dir,
    write_utilization_part,
)


def rec(i: int, variant: str = "v") -> RequestRecord:
    return RequestRecord(
        variant=variant, repeat=0, request_id=f"r{i}", trace_id="t", source="gen",
        session_id=None, instance="C0", route="COLO", arrival_s=float(i), sent_s=float(i),
        first_token_s=i + 0.5, finish_s=i + 1.0, input_tokens=100, output_tokens=5,
        klass="WARM", extra={"k": 1},
    )  # fmt: skip


def test_sink_flushes_every_write_and_parquet_has_record_columns(tmp_path: Path) -> None:
    sink = JsonlRecordSink(tmp_path, "v", 0)
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


def test_variant_order_is_kept(tmp_path: Path) -> None:
    for name in ("zeta", "alpha"):
        sink = JsonlRecordSink(tmp_path, name, 0)
        sink.write([rec(0, name)])
        sink.close()
    finalize_parquet(tmp_path, ["zeta", "alpha"])
    assert read_records(tmp_path)["variant"].tolist() == ["zeta", "alpha"]


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
