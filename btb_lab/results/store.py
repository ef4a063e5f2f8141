"""The results directory: layout, the durable record sink, parquet conversion.

Backends stream finished records into parts (flushed on every write, so Ctrl-C or a
crash loses nothing finished): the simulator into Arrow IPC streams, the cluster into
JSONL that can be read while its servers run. The runner converts the parts to
`requests.parquet` (raw stamps plus the latencies derived from them),
`utilization.parquet` and `events.parquet` at the end, writing each to a temporary file
renamed into place, and readers fall back to the parts when a run never got that far or
a parquet file is unreadable.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import operator
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple, TextIO

import pandas as pd

from btb_lab.errors import OutputError, UserError, describe_os_error
from btb_lab.records import (
    EVENT_COLUMNS,
    RECORD_COLUMNS,
    UTIL_COLUMNS,
    EventRecord,
    RequestRecord,
    UtilSample,
)
from btb_lab.results.parts import (
    ARROW_PART,
    PART_TYPES,
    PARTS_DIR,
    part_schema,
    read_parts,
    typed_events,
    typed_records,
    typed_util,
)

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "RECORD_SINKS",
    "ArrowRecordSink",
    "JsonlRecordSink",
    "StoredFrames",
    "finalize_parquet",
    "new_run_dir",
    "new_run_id",
    "read_events",
    "read_records",
    "read_utilization",
    "record_row",
    "stored_frames",
    "write_atomic",
    "write_events_part",
    "write_json",
    "write_utilization_part",
]

MANIFEST = "manifest.json"  # results.manifest.Manifest reads and writes it


def new_run_id() -> str:
    """`<UTC time>-<short id>`: sorts by start time, unique across concurrent runs."""
    return f"{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(3)}"


def check_out(out: Path) -> None:
    """Refuse an `--out` that is a file or a folder with something in it (a run checks
    before it loads its workload, not only once it has simulated)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} exists and is not empty")


def new_run_dir(
    results_root: Path, hypothesis_id: str, *, out: Path | None = None, run_id: str | None = None
) -> Path:
    """Create `results/<id>/<run id>/` (or `out`, which must be empty). A folder that
    cannot be created (read-only, no permission, a file in the way) is an `OutputError`."""
    if out is not None:
        check_out(out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create --out {out}: {describe_os_error(exc)}") from None
        return out
    while True:
        run_dir = results_root / hypothesis_id / (run_id or new_run_id())
        try:
            run_dir.mkdir(parents=True)
            return run_dir
        except FileExistsError:
            if not (results_root / hypothesis_id).is_dir():
                raise OutputError(f"cannot create {run_dir}: a file is in the way") from None
            run_id = None
            continue
        except OSError as exc:
            raise OutputError(f"cannot create {run_dir}: {describe_os_error(exc)}") from None


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write a file atomically (temp file + rename), so a reader never sees half of it;
    when the write fails (a full disk) the temporary file is removed and the old file,
    if any, is left as it was."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        if isinstance(text, bytes):
            tmp.write_bytes(text)
        else:
            tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (see `write_atomic`)."""
    write_atomic(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def _part_name(variant: str, repeat: int, kind: str, suffix: str = ".jsonl") -> str:
    digest = hashlib.blake2b(variant.encode(), digest_size=4).hexdigest()
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in variant)[:40]
    return f"{kind}-{safe}-{digest}-r{repeat:03d}{suffix}"


_RECORD_FIELDS = tuple("klass" if c == "class" else c for c in RECORD_COLUMNS)
_RECORD_VALUES = operator.attrgetter(*_RECORD_FIELDS)
# one getter per column: a batch's columns read a field at a time (mapping each over the
# batch) cost about two thirds of building every record's row and transposing them
_RECORD_GETTERS = tuple(operator.attrgetter(f) for f in _RECORD_FIELDS)


def record_row(rec: RequestRecord) -> dict[str, Any]:
    """One RequestRecord as a row with the RECORD_COLUMNS names (+ `extra` as JSON)."""
    row: dict[str, Any] = dict(zip(RECORD_COLUMNS, _RECORD_VALUES(rec), strict=True))
    row["extra"] = json.dumps(rec.extra, sort_keys=True) if rec.extra else None
    return row


class JsonlRecordSink:
    """RecordSink writing one JSONL part per variant × repeat; each `write` is flushed
    to the OS before returning (batch records in the caller for speed)."""

    def __init__(self, run_dir: Path, variant: str, repeat: int) -> None:
        parts = run_dir / PARTS_DIR
        parts.mkdir(parents=True, exist_ok=True)
        self.path = parts / _part_name(variant, repeat, "requests")
        self.count = 0
        self._fh: TextIO | None = self.path.open("a", encoding="utf-8")

    def write(self, records: Iterable[RequestRecord]) -> None:
        if self._fh is None:
            raise RuntimeError("write to a closed record sink")
        lines = [json.dumps(record_row(r), allow_nan=True) + "\n" for r in records]
        if not lines:
            return
        self._fh.write("".join(lines))
        self._fh.flush()
        self.count += len(lines)

    def close(self) -> None:
        """Flush and fsync; the file is closed even when that fails (a full disk)."""
        fh, self._fh = self._fh, None
        if fh is not None:
            _close_durably(fh)


def _close_durably(fh: IO[Any]) -> None:
    try:
        fh.flush()
        os.fsync(fh.fileno())
    finally:
        with contextlib.suppress(OSError):  # the flush above raised the same error
            fh.close()


class ArrowRecordSink:
    """RecordSink writing one Arrow IPC stream part per variant × repeat (the simulator's):
    a record batch per `write`, flushed to the OS before returning. Turning a record's
    floats into JSON text cost more than simulating the request; a batch is binary, and
    the parquet conversion reads it back without parsing. A crash mid-write leaves the
    batches before it readable (`_read_arrow_part`)."""

    def __init__(self, run_dir: Path, variant: str, repeat: int) -> None:
        import pyarrow as pa

        parts = run_dir / PARTS_DIR
        parts.mkdir(parents=True, exist_ok=True)
        self.path = parts / _part_name(variant, repeat, "requests", ARROW_PART)
        self.count = 0
        self._schema = part_schema(PART_TYPES["requests"])
        # appending after an earlier stream (`_read_arrow_part` reads them in turn)
        self._fh: IO[bytes] | None = self.path.open("ab")
        self._writer: Any = pa.ipc.new_stream(self._fh, self._schema)

    def write(self, records: Iterable[RequestRecord]) -> None:
        if self._fh is None:
            raise RuntimeError("write to a closed record sink")
        batch = list(records)
        if not batch:
            return
        columns: list[Any] = [list(map(get, batch)) for get in _RECORD_GETTERS]
        columns.append([json.dumps(r.extra, sort_keys=True) if r.extra else None for r in batch])
        self._writer.write_batch(_arrow_batch(self._schema, columns))
        self._fh.flush()
        self.count += len(batch)

    def close(self) -> None:
        """End the stream, flush and fsync; the file is closed even when that fails."""
        fh, self._fh = self._fh, None
        if fh is None:
            return
        try:
            self._writer.close()
        finally:
            _close_durably(fh)


# a backend's `record_format` -> the sink its records go to
RECORD_SINKS: dict[str, type[JsonlRecordSink] | type[ArrowRecordSink]] = {
    "jsonl": JsonlRecordSink,
    "arrow": ArrowRecordSink,
}


def _arrow_batch(schema: Any, columns: list[Any]) -> pa.RecordBatch:
    """A record batch of `schema` from one list of values per column."""
    import pyarrow as pa

    arrays = [pa.array(values, type=f.type) for values, f in zip(columns, schema, strict=True)]
    return pa.record_batch(arrays, schema=schema)


# the fields of a utilization sample and of an event, in UTIL_COLUMNS / EVENT_COLUMNS order
# after `variant` and `repeat`
_UTIL_VALUES = operator.attrgetter(*UTIL_COLUMNS[2:])
_EVENT_VALUES = operator.attrgetter(*EVENT_COLUMNS[2:])


def write_utilization_part(
    run_dir: Path,
    variant: str,
    repeat: int,
    samples: Iterable[UtilSample],
    fmt: str = "jsonl",
) -> None:
    """The utilization samples of one variant × repeat, as a JSONL part or (`fmt`
    "arrow", the simulator's) an Arrow one."""
    _write_part(run_dir, variant, repeat, "util", list(map(_UTIL_VALUES, samples)), fmt)


def write_events_part(
    run_dir: Path,
    variant: str,
    repeat: int,
    events: Iterable[EventRecord],
    fmt: str = "jsonl",
) -> None:
    """The events of one variant × repeat, ordered by time (ties keep their order), as a
    JSONL part or (`fmt` "arrow") an Arrow one."""
    ordered = sorted(events, key=lambda e: e.time_s)
    _write_part(run_dir, variant, repeat, "events", list(map(_EVENT_VALUES, ordered)), fmt)


def _write_part(
    run_dir: Path, variant: str, repeat: int, kind: str, rows: list[tuple[Any, ...]], fmt: str
) -> None:
    """One part of `kind` whose rows are `rows` after `variant` and `repeat`, synced to
    disk. Arrow where asked and every value has its column's type (a value pyarrow would
    refuse, say an integer too wide, goes to JSONL as before); parsing the JSONL text back
    cost more than writing it. A run's parts of one kind are then all Arrow, even empty
    ones, and are read as one table."""
    parts = run_dir / PARTS_DIR
    parts.mkdir(parents=True, exist_ok=True)
    batch = _arrow_rows(kind, variant, repeat, rows) if fmt == "arrow" else None
    suffix = ARROW_PART if batch is not None else ".jsonl"
    with (parts / _part_name(variant, repeat, kind, suffix)).open("wb") as fh:
        if batch is not None:
            import pyarrow as pa

            with pa.ipc.new_stream(fh, batch.schema) as writer:
                writer.write_batch(batch)
        else:
            names = list(PART_TYPES[kind])
            for values in rows:
                row = dict(zip(names, (variant, repeat, *values), strict=True))
                fh.write(json.dumps(row, allow_nan=True).encode() + b"\n")
        fh.flush()
        os.fsync(fh.fileno())


def _arrow_rows(
    kind: str, variant: str, repeat: int, rows: list[tuple[Any, ...]]
) -> pa.RecordBatch | None:
    """`rows` (after `variant` and `repeat`) as a batch of `kind`'s part schema, or None
    where a value does not fit its column's type."""
    import pyarrow as pa

    schema = part_schema(PART_TYPES[kind])
    columns: list[Any] = [[variant] * len(rows), [repeat] * len(rows)]
    columns += [[row[i] for row in rows] for i in range(len(schema) - 2)]
    try:
        return _arrow_batch(schema, columns)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
        return None


def _write_parquet(frame: pd.DataFrame, path: Path) -> None:
    """Temp file + rename: a crash mid-write leaves the old file or none, never half
    (and a failed write, a full disk, removes its temporary file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class StoredFrames(NamedTuple):
    """The frames `finalize_parquet` wrote, for a reader in the same process: what
    `read_records`, `read_utilization` and `read_events` give back, without reading the
    files again; None where reading back could give something else (`_round_trips`)."""

    requests: pd.DataFrame | None
    utilization: pd.DataFrame | None
    events: pd.DataFrame | None


# each kind of part: how its rows are typed, and the parquet file they are stored in
_STORED = (
    ("requests", typed_records, "requests.parquet"),
    ("util", typed_util, "utilization.parquet"),
    ("events", typed_events, "events.parquet"),
)


def finalize_parquet(
    run_dir: Path,
    variant_order: list[str] | None = None,
    classify: Callable[[pd.DataFrame], pd.Series] | None = None,
) -> StoredFrames:
    """Convert the record, utilization and event parts into `requests.parquet`,
    `utilization.parquet` and `events.parquet`; returns what was written. `classify`:
    the records' final classes (the hypothesis's rules), stored in their `class` column,
    so a reader of the file groups by the classes the report shows."""
    written = []
    for kind, typed, name in _STORED:
        frame = typed(read_parts(run_dir, kind, variant_order), variant_order)
        if kind == "requests" and classify is not None and len(frame):
            frame["class"] = classify(frame)
        _write_parquet(frame, run_dir / name)
        written.append(frame if _round_trips(frame) else None)
    import pyarrow as pa

    # the conversion's buffers go back to the system, so that the analysis and plots that
    # follow start from the simulation's footprint instead of stacking on this one's
    pa.default_memory_pool().release_unused()
    return StoredFrames(*written)


def stored_frames(run_dir: Path, variant_order: list[str] | None = None) -> StoredFrames:
    """The frames `finalize_parquet` would store from the parts, each as reading its file
    back gives it (through parquet in memory where `_round_trips` says the frame alone may
    differ), without writing anything: what another process reads while that one writes."""
    import io

    import pandas as pd

    frames = []
    for kind, typed, _ in _STORED:
        frame = typed(read_parts(run_dir, kind, variant_order), variant_order)
        if not _round_trips(frame):
            frame = pd.read_parquet(io.BytesIO(frame.to_parquet(None, index=False)))
        frames.append(frame)
    return StoredFrames(*frames)


def _round_trips(frame: pd.DataFrame) -> bool:
    """Whether the frame's parquet file reads back as this frame: rows, and no Python
    objects but None (`extra` holding dicts comes back as structs, every key in each)."""
    if frame.empty:
        return False
    return all(
        frame[name].dtype != object or bool(frame[name].isna().all()) for name in frame.columns
    )


def _read_parquet(path: Path) -> pd.DataFrame | None:
    """The parquet file, or None when it is absent or unreadable (cut short by a crash)."""
    if not path.is_file():
        return None
    import pyarrow as pa

    try:
        return pd.read_parquet(path)
    except (OSError, pa.ArrowException):
        return None


def read_records(run_dir: Path, variant_order: list[str] | None = None) -> pd.DataFrame:
    """All records of a run: the parquet file, or the parts (Arrow or JSONL) of an
    unfinished run."""
    frame = _read_parquet(run_dir / "requests.parquet")
    if frame is not None:
        return frame
    return typed_records(read_parts(run_dir, "requests", variant_order), variant_order)


def read_utilization(run_dir: Path, variant_order: list[str] | None = None) -> pd.DataFrame:
    frame = _read_parquet(run_dir / "utilization.parquet")
    if frame is not None:
        return frame
    return typed_util(read_parts(run_dir, "util", variant_order), variant_order)


def read_events(run_dir: Path, variant_order: list[str] | None = None) -> pd.DataFrame:
    """Every event of a run (EVENT_COLUMNS): `events.parquet`, or the JSONL parts; an empty
    frame for runs stored before events were recorded."""
    frame = _read_parquet(run_dir / "events.parquet")
    if frame is not None:
        return frame
    return typed_events(read_parts(run_dir, "events", variant_order), variant_order)
