"""Stored runs: the results directory (`store`: layout, durable record sink, parquet) and
its manifest (`manifest`: the typed model every reader loads)."""

from btb_lab.results.manifest import (
    MANIFEST,
    Manifest,
    RunEntry,
    RunStatus,
    full_runs,
    resolve_run_dir,
    stored_runs,
)
from btb_lab.results.store import (
    RECORD_SINKS,
    ArrowRecordSink,
    JsonlRecordSink,
    check_out,
    finalize_parquet,
    new_run_dir,
    new_run_id,
    read_events,
    read_records,
    read_utilization,
    record_row,
    write_atomic,
    write_events_part,
    write_json,
    write_utilization_part,
)

__all__ = [
    "MANIFEST",
    "RECORD_SINKS",
    "ArrowRecordSink",
    "JsonlRecordSink",
    "Manifest",
    "RunEntry",
    "RunStatus",
    "check_out",
    "finalize_parquet",
    "full_runs",
    "new_run_dir",
    "new_run_id",
    "read_events",
    "read_records",
    "read_utilization",
    "record_row",
    "resolve_run_dir",
    "stored_runs",
    "write_atomic",
    "write_events_part",
    "write_json",
    "write_utilization_part",
]
