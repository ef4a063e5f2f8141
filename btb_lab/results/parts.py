"""The parts read back: every part of a kind as one Arrow table (Arrow parts, or JSONL
ones pyarrow parses) or one dict per line, then as typed frames in the run's variant
order, for the parquet conversion (`store.finalize_parquet`) and for readers of a run
that never got that far.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import pandas as pd

from btb_lab.records import (
    EVENT_COLUMNS,
    RECORD_COLUMNS,
    STORED_COLUMNS,
    UTIL_COLUMNS,
    derive_timings,
)

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "ARROW_PART",
    "PARTS_DIR",
    "PART_TYPES",
    "Rows",
    "part_schema",
    "read_parts",
    "typed_events",
    "typed_records",
    "typed_util",
]

PARTS_DIR = "parts"
ARROW_PART = ".arrows"  # an Arrow IPC stream (ArrowRecordSink); the other parts are JSONL
_FLOAT_COLUMNS = (
    "arrival_s", "sent_s", "first_token_s", "finish_s", "queue_s", "kv_load_s",
    "kv_transfer_s", "prefill_s", "decode_s",
)  # fmt: skip
_INT_COLUMNS = ("repeat", "input_tokens", "output_tokens", "cached_tokens", "turn")


# what `read_parts` gives: one table of every part, or a dict per line of JSONL parts
Rows: TypeAlias = "pa.Table | list[dict[str, Any]]"


def read_parts(run_dir: Path, kind: str, order: list[str] | None = None) -> Rows:
    """The rows of every `kind` part in order: as one Arrow table when pyarrow reads every
    part with the column types below, else as one dict per line (stopping a part at a line
    cut short by a crash). Either becomes a frame in `_frame`. Arrow parts come in
    `order`'s variant order, then by repeat, as `_in_variant_order` leaves the rows."""
    folder = run_dir / PARTS_DIR
    parts = sorted([*folder.glob(f"{kind}-*.jsonl"), *folder.glob(f"{kind}-*{ARROW_PART}")])
    if parts and all(p.suffix == ARROW_PART for p in parts):
        return _read_arrow_parts(parts, PART_TYPES[kind], order)
    mixed = any(p.suffix == ARROW_PART for p in parts)
    table = _read_parts_columnar(parts, PART_TYPES[kind]) if parts and not mixed else None
    if table is not None:
        return table
    rows: list[dict[str, Any]] = []
    for part in parts:
        if part.suffix == ARROW_PART:  # beside JSONL parts (a directory older versions began)
            rows.extend(_read_arrow_parts([part], PART_TYPES[kind]).to_pylist())
            continue
        with part.open(encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a line cut short by a crash: everything before it is intact
    return rows


def _frame(rows: Rows, columns: list[str]) -> pd.DataFrame:
    """`read_parts`' rows as a frame of `columns`: an Arrow table column by column, without
    a Python object per value."""
    if isinstance(rows, list):
        return pd.DataFrame(rows, columns=columns)
    # one chunk per column, as reordering rows gave them: the parquet writer's pages
    # (where its dictionary stops) depend on the chunks, not only on the values
    rows = rows.combine_chunks()
    n = rows.num_rows
    frame = {}
    for name in columns:
        column = rows.column(name)
        # a column of nulls only is an object column of None, as pandas makes one from
        # rows (its parquet type stays `null`: the same file either way)
        nulls = column.null_count == n
        frame[name] = pd.Series([None] * n, dtype=object) if nulls else column.to_pandas()
    return pd.DataFrame(frame)


def _part_types(
    columns: Iterable[str], floats: Iterable[str], ints: Iterable[str]
) -> dict[str, str]:
    floats, ints = set(floats), set(ints)
    return {
        c: "float" if c in floats else "int" if c in ints else "bool" if c == "ok" else "str"
        for c in columns
    }


PART_TYPES = {
    "requests": _part_types([*RECORD_COLUMNS, "extra"], _FLOAT_COLUMNS, _INT_COLUMNS),
    "util": _part_types(UTIL_COLUMNS, ("time_s", "utilization", "memory_bytes"), ("repeat",)),
    "events": _part_types(EVENT_COLUMNS, ("time_s", "value", "end_s"), ("repeat",)),
}


def _read_parts_columnar(parts: list[Path], types: dict[str, str]) -> pa.Table | None:
    """`parts` as one Arrow table of `types` (JSON numbers in a float column as floats), or
    None when some part needs the line reader: a line cut short, a value of another type."""
    import pyarrow as pa
    import pyarrow.json as pj

    schema = part_schema(types)
    options = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    tables = []
    for part in parts:
        try:
            tables.append(pj.read_json(part, parse_options=options).select(list(types)))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
    return pa.concat_tables(tables)


def part_schema(types: dict[str, str]) -> Any:
    import pyarrow as pa

    kinds = {"float": pa.float64(), "int": pa.int64(), "bool": pa.bool_(), "str": pa.string()}
    return pa.schema([(name, kinds[kind]) for name, kind in types.items()])


def _read_arrow_parts(
    parts: list[Path], types: dict[str, str], order: list[str] | None = None
) -> pa.Table:
    """The Arrow parts as one table, as `_read_parts_columnar` gives it; with `order`, the
    parts (each one variant × repeat) by its variants, then repeat, ties as listed: the
    rows then need no reordering, which on Arrow-backed columns cost a gather per value."""
    import pyarrow as pa

    read = [_read_arrow_part(part) for part in parts]
    if order:
        rank = {v: i for i, v in enumerate(order)}

        def key(batches: list[Any]) -> tuple[int, int]:
            first = next((b for b in batches if b.num_rows), None)
            if first is None:
                return (-1, -1)  # no rows: where it goes changes nothing
            variant, repeat = first.column("variant")[0].as_py(), first.column("repeat")[0]
            return rank.get(variant, len(rank)), repeat.as_py()

        read.sort(key=key)
    batches = [batch for part in read for batch in part]
    return pa.Table.from_batches(batches, schema=part_schema(types))


def _read_arrow_part(path: Path) -> list[Any]:
    """The record batches of one Arrow part: its streams one after another, up to a batch
    cut short by a crash (everything before it is intact)."""
    import pyarrow as pa

    batches: list[Any] = []
    # mapped, not read: the batches point into the file's pages (read() copied them all)
    with pa.memory_map(str(path)) as fh:
        size = fh.size()
        while fh.tell() < size:
            try:
                reader = pa.ipc.open_stream(fh)
                while True:
                    try:
                        batches.append(reader.read_next_batch())
                    except StopIteration:
                        break
            except (pa.ArrowInvalid, OSError):
                break
    return batches


def _in_variant_order(frame: pd.DataFrame, order: list[str] | None) -> pd.DataFrame:
    """The rows by `order`'s variants (one it lacks last), then repeat, ties as they were;
    each variant's rank found once per distinct name, not per row."""
    if not order:
        return frame
    import numpy as np
    import pandas as pd

    rank = {v: i for i, v in enumerate(order)}
    codes = pd.Index(list(rank)).get_indexer(pd.Index(frame["variant"]))  # -1: not in it
    ranks = np.append(np.fromiter(rank.values(), np.int64, len(rank)), len(rank))[codes]
    perm = np.lexsort((frame["repeat"].to_numpy(), ranks))
    if bool(np.all(perm == np.arange(len(perm)))):  # in order already (`_read_arrow_parts`)
        return frame
    return frame.iloc[perm]


def typed_records(rows: Rows, order: list[str] | None) -> pd.DataFrame:
    """Rows of the parts as a typed frame with STORED_COLUMNS (+ `extra`)."""
    frame = _frame(rows, [*RECORD_COLUMNS, "extra"])
    for column in _FLOAT_COLUMNS:
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("float64")
    for column in _INT_COLUMNS:
        frame[column] = pd.to_numeric(frame[column], errors="coerce").fillna(0).astype("int64")
    frame["ok"] = frame["ok"].fillna(False).astype(bool)
    for column in ("variant", "request_id", "trace_id", "source", "instance", "route"):
        frame[column] = frame[column].astype(str)
    frame = _in_variant_order(frame, order)
    frame = derive_timings(frame.reset_index(drop=True))
    return frame[[*STORED_COLUMNS, "extra"]]


def typed_util(rows: Rows, order: list[str] | None) -> pd.DataFrame:
    frame = _frame(rows, list(UTIL_COLUMNS))
    for column in ("time_s", "utilization", "memory_bytes"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("float64")
    frame["repeat"] = pd.to_numeric(frame["repeat"], errors="coerce").fillna(0).astype("int64")
    for column in ("variant", "instance", "device", "source"):
        frame[column] = frame[column].astype(str)
    frame = _in_variant_order(frame, order)
    return frame.reset_index(drop=True)


def typed_events(rows: Rows, order: list[str] | None) -> pd.DataFrame:
    frame = _frame(rows, list(EVENT_COLUMNS))
    for column in ("time_s", "value", "end_s"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("float64")
    frame["repeat"] = pd.to_numeric(frame["repeat"], errors="coerce").fillna(0).astype("int64")
    for column in ("variant", "kind", "instance", "peer", "request_id", "label", "origin"):
        frame[column] = frame[column].fillna("").astype(str)
    frame = _in_variant_order(frame, order)
    return frame.reset_index(drop=True)
