"""Columnar reading of trace files: pyarrow's JSON and parquet readers, checks on whole
columns, block ids converted once per distinct id.

This is the fast path of the loaders in `formats`. It takes a file only when every row
would pass the row-by-row loader unchanged; anything it cannot vouch for (a row that
fails a check, a type the row loader would coerce, a line the two parsers could read
differently) raises `Fallback`, and the row loader reads the whole file instead, so
error messages, skipped rows and ids stay exactly what they were.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from btb_lab.config.limits import MAX_TOKENS, MAX_TURN
from btb_lab.workload.hashing import stable_hashes63
from btb_lab.workload.trace_checks import open_trace

__all__ = [
    "CHUNK_BYTES",
    "PARQUET_ROWS",
    "Fallback",
    "block_id_tuples",
    "id_type",
    "optional_text",
    "read_batches",
    "required_lengths",
    "required_text",
    "required_times",
    "schema",
    "turns",
]

CHUNK_BYTES = 1 << 22  # JSON read 4 MiB at a time, the next chunk parsed on a thread
PARQUET_ROWS = 16_384  # rows a parquet batch reads
_BOM = b"\xef\xbb\xbf"
_T = TypeVar("_T")


class Fallback(Exception):
    """The file needs the row-by-row loader (the reason is for debugging only)."""


_NULL_TURN = re.compile(rb'"turn" *: *null')


def _line_chunks(path: Path) -> Iterator[bytes]:
    """The file in chunks of about `CHUNK_BYTES` that end at a line's end (the last one
    may lack its newline)."""
    rest = b""
    with open_trace(path) as handle:
        while data := handle.read(CHUNK_BYTES):
            data = rest + data
            cut = data.rfind(b"\n") + 1
            rest = data[cut:]
            if cut:
                yield data[:cut]
    if rest:
        yield rest


def _first_row(path: Path) -> dict[str, Any]:
    with open_trace(path) as handle:
        line = handle.readline()
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise Fallback("first line is not JSON") from None
    if not isinstance(row, dict):
        raise Fallback("first line is not an object")
    return row


def id_type(path: Path, allow_str: bool) -> pa.DataType:
    """The type of `hash_ids` values: string or int64, from the first row (JSONL) or the
    file's schema (parquet). Mixed or other types take the row loader."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        schema = pq.read_schema(path)
        if "hash_ids" not in schema.names:
            raise Fallback("no hash_ids column")
        field_type = schema.field("hash_ids").type
        if not (pa.types.is_list(field_type) or pa.types.is_large_list(field_type)):
            raise Fallback("hash_ids is not a list column")
        value_type = field_type.value_type
        if pa.types.is_integer(value_type) and value_type != pa.uint64():
            return pa.int64()
        if allow_str and (pa.types.is_string(value_type) or pa.types.is_large_string(value_type)):
            return pa.string()
        raise Fallback("hash_ids values are neither integers nor strings")
    value = _first_row(path).get("hash_ids")
    if not isinstance(value, list):
        raise Fallback("first row's hash_ids is not a list")
    kinds = set(map(type, value))
    if kinds <= {int}:
        return pa.int64()
    if allow_str and kinds == {str}:
        return pa.string()
    raise Fallback("first row's ids mix types")


_KINDS: dict[str, pa.DataType] = {
    "time": pa.float64(),
    "length": pa.int64(),
    "text": pa.string(),
    "metadata": pa.struct([("turn", pa.int64()), ("job_kind", pa.string())]),
}


def schema(fields: dict[str, str], ids: pa.DataType) -> pa.Schema:
    """The columns a format reads: `time`, `length`, `text` or `metadata` per field name,
    plus `hash_ids` as a list of `ids`."""
    return pa.schema([(name, _KINDS[kind]) for name, kind in fields.items()]).append(
        pa.field("hash_ids", pa.list_(ids))
    )


Rows = list[tuple[int, ...]]


def read_batches(
    path: Path, schema: pa.Schema, interned: dict[int, int]
) -> Iterator[tuple[pa.RecordBatch, bool, Rows | None]]:
    """Record batches of `schema`'s columns (absent ones all null), in file order, each
    with whether a null `metadata.turn` under present metadata in it may be a written
    null (`{"turn": null}`, which the row loader rejects) rather than no turn at all, and
    its rows' block ids where the compiled scanner read them (`block_id_tuples` takes
    them; the batch then has no `hash_ids` column). `interned`: the file's id objects.

    JSONL: parsed a chunk of whole lines at a time (several blocks of a chunk in
    parallel); every line holds exactly one row, so row k is line k + 1, and the only
    control byte is the newline (`json.loads` rejects raw control characters in strings,
    `\\r` would split lines differently); no byte-order mark. Parquet: columns are
    widened to `schema` only where that cannot change a value. A JSONL file's next chunk
    is parsed on a thread while the caller builds requests from this one's batches.
    """
    if path.suffix == ".parquet":  # decoding is a small part of a parquet load: in turn
        for batch in _parquet_batches(path, schema):
            # a struct has every field in every row: a null turn is no turn, not a written
            # null (the row loader reads parquet so too)
            yield batch, False, None
        return
    for batches, null_turn in _ahead(_json_chunks(path, schema, interned)):
        for batch, ids in batches:
            yield batch, null_turn, ids


def _json_chunks(
    path: Path, schema: pa.Schema, interned: dict[int, int]
) -> Iterator[tuple[list[tuple[pa.RecordBatch, Rows | None]], bool]]:
    """Each chunk's record batches with their rows' ids where the scanner read them (the
    work a thread does ahead of the caller). The scanner reads a chunk's ids and hands
    pyarrow the chunk with each id array written as `null`: the arrays are most of a
    long-prefix trace's bytes, which pyarrow would otherwise tokenize only to drop them.
    Both let go of the interpreter. The scanner takes only arrays that are valid JSON of
    the schema's id type; pyarrow checks the rest of every line."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.json as pj

    read_options = pj.ReadOptions(block_size=max(1 << 20, CHUNK_BYTES // 2), use_threads=True)
    one_thread = pj.ReadOptions(block_size=CHUNK_BYTES, use_threads=False)
    full = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    scanner = _scanner(schema, interned)
    # with a scanner pyarrow parses everything but the ids (written as null)
    parse = pj.ParseOptions(
        explicit_schema=schema.remove(schema.get_field_index("hash_ids")),
        unexpected_field_behavior="ignore",
    )
    with ThreadPoolExecutor(1, thread_name_prefix="btb-lab-scan") as scans:
        chunks = _checked_chunks(path)
        after = next(chunks, None)
        # the next chunk is scanned on a thread while pyarrow parses this one
        scanning = (
            None if scanner is None or after is None else scans.submit(scanner.scan, after[0])
        )
        while after is not None:
            chunk, rows = after
            after = next(chunks, None)
            scanned = scanning.result() if scanning is not None else None
            if scanner is not None and after is not None:
                scanning = scans.submit(scanner.scan, after[0])
            if scanned is not None and len(scanned[0]) == rows:
                ids, stripped = scanned  # a few times smaller: faster on one thread
                table = _parse_json(stripped, one_thread, parse, rows)
            else:  # no scanner, or a line it does not read: the parser decides
                ids = None
                table = _parse_json(chunk, read_options, full, rows)
            # a key written with escapes (`"tu\\u0072n"`) is one the search cannot see
            null_turn = _turnless_metadata(table) and (
                _NULL_TURN.search(chunk) is not None or b"\\u" in chunk
            )
            yield _split(table.to_batches(), ids), null_turn


def _checked_chunks(path: Path) -> Iterator[tuple[bytes, int]]:
    """Chunks of whole lines with their row counts; a byte-order mark or a control byte
    other than the newline sends the file to the row loader."""
    for index, chunk in enumerate(_line_chunks(path)):
        if index == 0 and chunk.startswith(_BOM):
            raise Fallback("byte-order mark")
        newlines = chunk.count(b"\n")
        if int(np.count_nonzero(np.frombuffer(chunk, np.uint8) < 0x20)) != newlines:
            raise Fallback("control bytes other than newlines")
        yield chunk, newlines + (not chunk.endswith(b"\n"))


def _parse_json(chunk: bytes, read: Any, parse: Any, rows: int) -> pa.Table:
    import pyarrow.json as pj

    try:
        table = pj.read_json(pa.BufferReader(chunk), read_options=read, parse_options=parse)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise Fallback(str(exc)) from None
    if table.num_rows != rows:
        raise Fallback("blank lines or several objects on one line")
    return table


def _scanner(schema: pa.Schema, interned: dict[int, int]) -> Any:
    """The compiled `hash_ids` reader for `schema`'s id type, or None (no C build)."""
    if _IdScanner is None:
        return None
    strings = pa.types.is_string(schema.field("hash_ids").type.value_type)
    return _IdScanner(interned, strings=strings)


def _split(
    batches: list[pa.RecordBatch], ids: Rows | None
) -> list[tuple[pa.RecordBatch, Rows | None]]:
    """Each batch with its slice of the chunk's `ids`."""
    if ids is None:
        return [(batch, None) for batch in batches]
    out: list[tuple[pa.RecordBatch, Rows | None]] = []
    start = 0
    for batch in batches:
        out.append((batch, ids[start : start + batch.num_rows]))
        start += batch.num_rows
    return out


_DONE: Any = object()


def _ahead(items: Iterator[_T]) -> Iterator[_T]:
    """`items`, the next one made on a thread while the caller uses this one (pyarrow's
    parse lets go of the interpreter, and the caller's per-row Python work is
    most of a load). The thread ends with the generator."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="btb-lab-read") as pool:
        future = pool.submit(next, items, _DONE)
        while (item := future.result()) is not _DONE:
            future = pool.submit(next, items, _DONE)
            yield item


def _turnless_metadata(table: pa.Table) -> bool:
    """Whether some row has metadata but a null turn (only then is the chunk searched
    for a written `"turn": null`)."""
    if "metadata" not in table.column_names:
        return False
    metadata = table.column("metadata")
    return bool(pc.struct_field(metadata, "turn").null_count > metadata.null_count)


def _parquet_batches(path: Path, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    import pyarrow.parquet as pq

    handle = pq.ParquetFile(path)
    present = set(handle.schema_arrow.names)
    for name in schema.names:
        if name in present and not _widens(
            handle.schema_arrow.field(name).type, schema.field(name).type
        ):
            raise Fallback(f"parquet column {name} has a type the row loader reads differently")
    columns = [name for name in schema.names if name in present]
    for batch in handle.iter_batches(batch_size=PARQUET_ROWS, columns=columns):
        arrays = []
        for name in schema.names:
            target = schema.field(name).type
            if name not in present:
                arrays.append(pa.nulls(batch.num_rows, target))
                continue
            try:
                arrays.append(batch.column(name).cast(target))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                raise Fallback(f"parquet column {name}: {exc}") from None
        yield pa.RecordBatch.from_arrays(arrays, schema=schema)


def _widens(source: pa.DataType, target: pa.DataType) -> bool:
    """Whether casting `source` to `target` keeps every value `to_pylist` would give."""
    if pa.types.is_null(source):
        return True
    if pa.types.is_list(target):
        return (pa.types.is_list(source) or pa.types.is_large_list(source)) and _widens(
            source.value_type, target.value_type
        )
    if pa.types.is_struct(target):
        if not pa.types.is_struct(source):
            return False
        names = {source.field(i).name: source.field(i).type for i in range(source.num_fields)}
        return all(
            target.field(i).name not in names
            or _widens(names[target.field(i).name], target.field(i).type)
            for i in range(target.num_fields)
        )
    if target == pa.int64():
        return pa.types.is_integer(source) and source != pa.uint64()
    if target == pa.float64():  # integers as `float(value)`; a cast that would round fails
        return (pa.types.is_floating(source) and source != pa.float16()) or (
            pa.types.is_integer(source) and source != pa.uint64()
        )
    if target == pa.string():
        return pa.types.is_string(source) or pa.types.is_large_string(source)
    return False


def _no_nulls(array: pa.Array, name: str) -> None:
    if array.null_count:
        raise Fallback(f"{name}: missing in some row")


def required_times(batch: pa.RecordBatch, name: str) -> list[float]:
    """A number column every row has, finite and ≥ 0 (as `formats._time`)."""
    array = batch.column(name)
    _no_nulls(array, name)
    values = array.to_numpy(zero_copy_only=False)
    if not bool(np.all(np.isfinite(values) & (values >= 0))):
        raise Fallback(f"{name}: not a finite number ≥ 0 in some row")
    return array.to_pylist()


def required_lengths(batch: pa.RecordBatch, name: str) -> list[int]:
    """An integer column every row has, from 0 to MAX_TOKENS (as `formats._length`; one
    vectorized min and max per column)."""
    array = batch.column(name)
    _no_nulls(array, name)
    if len(array):
        bounds = pc.min_max(array)
        if int(bounds["min"].as_py()) < 0:
            raise Fallback(f"{name}: negative in some row")
        if int(bounds["max"].as_py()) > MAX_TOKENS:
            raise Fallback(f"{name}: more than MAX_TOKENS in some row")
    return array.to_pylist()


def required_text(batch: pa.RecordBatch, name: str) -> list[str]:
    array = batch.column(name)
    _no_nulls(array, name)
    return array.to_pylist()


def optional_text(batch: pa.RecordBatch, name: str) -> list[str | None]:
    return batch.column(name).to_pylist()


def turns(
    batch: pa.RecordBatch, null_turn_written: bool, name: str = "metadata"
) -> tuple[list[int], list[bool]]:
    """`metadata.turn` per row (1 where there is none, each an integer ≥ 1) and whether
    the row carries one.

    Present metadata with a null turn is `{}` (no turn: turn 1) unless the file may hold
    a written `"turn": null`, which the row loader rejects: then the file falls back.
    """
    metadata = batch.column(name)
    turn = pc.struct_field(metadata, "turn")
    if null_turn_written and turn.null_count != metadata.null_count:
        raise Fallback("a null metadata.turn in some row")
    if turn.null_count < len(turn) and not (
        int(pc.min(turn).as_py()) >= 1 and int(pc.max(turn).as_py()) <= MAX_TURN
    ):
        raise Fallback("metadata.turn out of range in some row")
    return pc.fill_null(turn, 1).to_pylist(), turn.is_valid().to_pylist()


def job_kinds(batch: pa.RecordBatch, name: str = "metadata") -> list[str | None]:
    """`metadata.job_kind` per row (None where there is none); an empty one, which the
    row loader rejects, sends the file there."""
    kinds = pc.struct_field(batch.column(name), "job_kind").to_pylist()
    if "" in kinds:
        raise Fallback("an empty metadata.job_kind in some row")
    return kinds


def block_id_tuples(
    batch: pa.RecordBatch,
    input_tokens: list[int],
    block_tokens: int,
    name: str = "hash_ids",
    interned: dict[int, int] | None = None,
    scanned: Rows | None = None,
) -> list[tuple[int, ...]]:
    """Each row's block ids as a tuple. Each distinct id of the batch is converted once
    (strings hashed as `block_id` hashes them) and is one int object that all its
    occurrences share: in the batch, and with `interned` (one dict for the whole file)
    in every batch, so the simulator's caches match a burst's shared prefix by identity
    instead of hashing and comparing each block. `scanned`: the rows the compiled
    scanner read (`read_batches`), checked here as the column would be."""
    limits = -(-np.asarray(input_tokens, dtype=np.int64) // block_tokens)
    if scanned is not None:
        counts = np.fromiter(map(len, scanned), np.int64, len(scanned))
        if bool(np.any(counts > limits)):
            raise Fallback(f"{name}: more ids than the prompt has blocks in some row")
        return scanned
    lists = batch.column(name)
    _no_nulls(lists, name)
    offsets = lists.offsets.to_numpy()
    counts = np.diff(offsets)
    if bool(np.any(counts > limits)):
        raise Fallback(f"{name}: more ids than the prompt has blocks in some row")
    values = lists.flatten()
    if values.null_count:
        raise Fallback(f"{name}: a null id in some row")
    encoded = pc.dictionary_encode(values)
    distinct = encoded.dictionary.to_pylist()
    converted = stable_hashes63(distinct) if pa.types.is_string(values.type) else distinct
    if interned is not None:
        converted = _interned(interned, converted)
    indices = encoded.indices.to_numpy(zero_copy_only=False)  # int32: the loops take it
    return _rows_of_ids(converted, indices, (offsets - offsets[0]).astype(np.int64, copy=False))


def python_interned(table: dict[Any, Any], values: list[Any]) -> list[Any]:
    """`table.setdefault(v, v)` for each value: one object per distinct id of the file."""
    return [table.setdefault(v, v) for v in values]


def python_rows_of_ids(
    ids: list[Any], indices: np.ndarray, bounds: np.ndarray
) -> list[tuple[Any, ...]]:
    """Row r: the ids at `indices[bounds[r]:bounds[r + 1]]`, as a tuple."""
    if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= len(ids)):
        raise ValueError("rows_of_ids: an index out of range")
    column = np.empty(len(ids), dtype=object)
    column[:] = ids
    flat = tuple(column[indices].tolist())
    return [flat[a:b] for a, b in pairwise(bounds.tolist())]


try:  # the same loops in C (`_hashc.c`), where the install could build it
    from btb_lab.workload._hashc import interned as _interned
    from btb_lab.workload._hashc import rows_of_ids as _rows_of_ids
except ImportError:  # pragma: no cover - installs without a C compiler
    _interned, _rows_of_ids = python_interned, python_rows_of_ids
_IdScanner: Any  # without it pyarrow parses the ids (the same rows: test_workload_columnar)
try:
    from btb_lab.workload._hashc import IdScanner as _IdScanner
except ImportError:  # pragma: no cover - installs without a C compiler
    _IdScanner = None
