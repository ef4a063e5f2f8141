"""Trace file loaders (`mooncake`, `bursted-art`, `art-chat`) with per-row validation.

Each loader turns a file into `Request`s in file order. A malformed row is a `UserError`
naming the file, the line and the field (`trace.jsonl:17: field 'input_length': must be
≥ 0`), or, with `skip_bad_rows`, is counted in `LoadedTrace.bad_rows` — never dropped
silently. Arrival times stay as the file gives them; time scaling happens in `loader`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from btb_lab.config.limits import MAX_TOKENS
from btb_lab.errors import UserError
from btb_lab.records import Request
from btb_lab.registry import Registry
from btb_lab.workload.hashing import block_id

__all__ = [
    "FORMATS",
    "BadRow",
    "LoadedTrace",
    "TraceLoader",
    "detect_format",
    "iter_rows",
    "load_trace",
]

BURSTED_ART_SOURCES = ("art", "synthetic")


class BadRow(Exception):
    """One problem in one row; the loader adds file and line."""

    def __init__(self, field_name: str | None, message: str) -> None:
        self.field_name = field_name
        self.message = message
        super().__init__(message)


@dataclass
class LoadedTrace:
    """Requests in file order plus one message per skipped malformed row."""

    requests: list[Request]
    bad_rows: list[str] = field(default_factory=list)


TraceLoader = Callable[[Path, int, bool], LoadedTrace]
FORMATS: Registry[TraceLoader] = Registry("trace format")


def iter_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | BadRow]]:
    """(line number, row) for a JSONL or parquet file; unparsable lines come as `BadRow`.

    Parquet rows are numbered from 1 in file order, like lines. A file that cannot be
    read at all (missing, a folder, no permission, not UTF-8 text, not parquet) is a
    `UserError` naming it.
    """
    if not path.exists():
        raise UserError(f"{path}: trace file not found")
    if path.is_dir():
        raise UserError(f"{path}: is a directory, not a trace file")
    if path.suffix == ".parquet":
        yield from enumerate(_parquet_rows(path), start=1)
        return
    line_no = 0
    try:
        with path.open("r", encoding="utf-8") as handle:
            for line_no, line in enumerate(handle, start=1):
                text = line.strip()
                if not text:
                    continue
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as exc:
                    yield line_no, BadRow(None, f"not valid JSON ({exc.msg})")
                    continue
                except RecursionError:
                    yield line_no, BadRow(None, "not valid JSON (nested too deeply)")
                    continue
                if not isinstance(row, dict):
                    yield line_no, BadRow(None, "expected a JSON object")
                    continue
                yield line_no, row
    except UnicodeDecodeError:
        raise UserError(f"{path}:{line_no + 1}: not UTF-8 text (a binary file?)") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _parquet_rows(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{path}: not a readable parquet file ({reason})") from None
    return table.to_pylist()


def _require(row: dict[str, Any], name: str) -> Any:
    if name not in row or row[name] is None:
        raise BadRow(name, "missing")
    return row[name]


def _length(row: dict[str, Any], name: str) -> int:
    value = _require(row, name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRow(name, f"must be an integer, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise BadRow(name, f"must be an integer, got {value!r}")
    if value < 0:
        raise BadRow(name, "must be ≥ 0")
    if value > MAX_TOKENS:
        raise BadRow(name, f"{value:g} tokens is more than the limit of {MAX_TOKENS:,}")
    return int(value)


def _time(row: dict[str, Any], name: str) -> float:
    value = _require(row, name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRow(name, f"must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise BadRow(name, "must be a finite number ≥ 0")
    return float(value)


def _text(row: dict[str, Any], name: str, *, required: bool = True) -> str | None:
    value = row.get(name)
    if value is None:
        if required:
            raise BadRow(name, "missing")
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise BadRow(name, f"must be a string, got {value!r}")
    return str(value)


def _hash_ids(
    row: dict[str, Any], input_tokens: int, block_tokens: int, *, allow_str: bool
) -> tuple[int, ...]:
    value = _require(row, "hash_ids")
    if not isinstance(value, list | tuple):
        raise BadRow("hash_ids", "must be a list")
    ids: list[int] = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | str):
            raise BadRow("hash_ids", f"ids must be integers or strings, got {item!r}")
        if isinstance(item, str) and not allow_str:
            raise BadRow("hash_ids", f"ids must be integers, got {item!r}")
        ids.append(block_id(item))
    limit = math.ceil(input_tokens / block_tokens)
    if len(ids) > limit:
        raise BadRow(
            "hash_ids",
            f"{len(ids)} ids but input_length {input_tokens} at {block_tokens} tokens "
            f"per block allows at most {limit}",
        )
    return tuple(ids)


def _run_rows(
    path: Path,
    skip_bad_rows: bool,
    parse: Callable[[int, dict[str, Any]], Request],
) -> LoadedTrace:
    """Drive `parse` over every row, turning `BadRow` into an error or a counted skip."""
    requests: list[Request] = []
    bad: list[str] = []
    for line_no, row in iter_rows(path):
        try:
            if isinstance(row, BadRow):
                raise row
            requests.append(parse(line_no, row))
        except BadRow as exc:
            where = f"field {exc.field_name!r}: " if exc.field_name else ""
            message = f"{path}:{line_no}: {where}{exc.message}"
            if not skip_bad_rows:
                raise UserError(message) from None
            bad.append(message)
    return LoadedTrace(requests, bad)


@FORMATS.register("mooncake")
def load_mooncake(path: Path, block_tokens: int, skip_bad_rows: bool) -> LoadedTrace:
    """Mooncake FAST'25 rows: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`.

    File order is arrival order, so a timestamp earlier than the previous row's is an error.
    """
    last_ms = -math.inf

    def parse(line_no: int, row: dict[str, Any]) -> Request:
        nonlocal last_ms
        timestamp_ms = _time(row, "timestamp")
        input_tokens = _length(row, "input_length")
        output_tokens = _length(row, "output_length")
        hashes = _hash_ids(row, input_tokens, block_tokens, allow_str=False)
        if timestamp_ms < last_ms:
            raise BadRow("timestamp", f"{timestamp_ms:g} is earlier than the previous row's")
        last_ms = timestamp_ms
        return Request(
            request_id=f"{path.stem}-{line_no}",
            arrival_s=timestamp_ms / 1000.0,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            block_hashes=hashes,
            block_tokens=block_tokens,
            source="trace",
        )

    return _run_rows(path, skip_bad_rows, parse)


def _metadata(row: dict[str, Any]) -> dict[str, Any]:
    value = row.get("metadata")
    if value is None or value == "":
        return {}
    if isinstance(value, str):  # parquet exports often keep metadata as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise BadRow("metadata", "must be an object or a JSON object string") from None
    if not isinstance(value, dict):
        raise BadRow("metadata", "must be an object")
    return value


@FORMATS.register("bursted-art")
def load_bursted_art(path: Path, block_tokens: int, skip_bad_rows: bool) -> LoadedTrace:
    """Bursted-ART rows (the BTB seed's schema); `arrival_s` is seconds within the window.

    Windows (`trace_id`) may interleave in the file. Where a row's metadata carries a
    `turn`, turns of one session must arrive in turn order.
    """
    seen_ids: dict[str, int] = {}
    session_turns: dict[tuple[str, str], dict[int, float]] = {}

    def parse(line_no: int, row: dict[str, Any]) -> Request:
        arrival_s = _time(row, "arrival_s")
        trace_id = _text(row, "trace_id")
        source = _text(row, "source")
        if source not in BURSTED_ART_SOURCES:
            raise BadRow("source", f"must be one of {', '.join(BURSTED_ART_SOURCES)}")
        request_id = _text(row, "request_id")
        input_tokens = _length(row, "input_length")
        output_tokens = _length(row, "output_length")
        hashes = _hash_ids(row, input_tokens, block_tokens, allow_str=True)
        session_id = _text(row, "session_id", required=False)
        group_id = _text(row, "group_id", required=False)
        meta = _metadata(row)
        assert trace_id is not None
        assert request_id is not None
        if request_id in seen_ids:
            raise BadRow("request_id", f"{request_id!r} repeats line {seen_ids[request_id]}")
        turn = 1
        if "turn" in meta:
            turn_value = meta["turn"]
            if isinstance(turn_value, bool) or not isinstance(turn_value, int) or turn_value < 1:
                raise BadRow("metadata.turn", "must be an integer ≥ 1")
            turn = turn_value
            if session_id is not None:
                turns = session_turns.setdefault((trace_id, session_id), {})
                for other_turn, other_arrival_s in turns.items():
                    if (other_turn < turn) != (other_arrival_s <= arrival_s):
                        raise BadRow(
                            "arrival_s",
                            f"turn {turn} of session {session_id!r} is out of order with "
                            f"turn {other_turn}",
                        )
                turns[turn] = arrival_s
        seen_ids[request_id] = line_no
        return Request(
            request_id=request_id,
            arrival_s=arrival_s,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            block_hashes=hashes,
            block_tokens=block_tokens,
            session_id=session_id,
            group_id=group_id,
            trace_id=trace_id,
            source=source,
            turn=turn,
        )

    return _run_rows(path, skip_bad_rows, parse)


@FORMATS.register("art-chat")
def load_art_chat(path: Path, block_tokens: int, skip_bad_rows: bool) -> LoadedTrace:
    """ART-Chat rows (`timestamp_ms`, `request_id`, `system_prompt_hash`, lengths, `hash_ids`).

    JSONL or parquet (by suffix). File order is arrival order; `system_prompt_hash`
    becomes the request's `group_id`.
    """
    last_ms = -math.inf
    seen_ids: dict[str, int] = {}

    def parse(line_no: int, row: dict[str, Any]) -> Request:
        nonlocal last_ms
        timestamp_ms = _time(row, "timestamp_ms")
        request_id = _text(row, "request_id")
        system_prompt = _text(row, "system_prompt_hash", required=False)
        input_tokens = _length(row, "input_length")
        output_tokens = _length(row, "output_length")
        hashes = _hash_ids(row, input_tokens, block_tokens, allow_str=True)
        assert request_id is not None
        if request_id in seen_ids:
            raise BadRow("request_id", f"{request_id!r} repeats line {seen_ids[request_id]}")
        if timestamp_ms < last_ms:
            raise BadRow("timestamp_ms", f"{timestamp_ms:g} is earlier than the previous row's")
        last_ms = timestamp_ms
        seen_ids[request_id] = line_no
        return Request(
            request_id=request_id,
            arrival_s=timestamp_ms / 1000.0,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            block_hashes=hashes,
            block_tokens=block_tokens,
            group_id=system_prompt,
            source="art",
        )

    return _run_rows(path, skip_bad_rows, parse)


def load_trace(
    path: Path, fmt: str, *, block_tokens: int = 512, skip_bad_rows: bool = False
) -> LoadedTrace:
    """Load a trace file with the named format (unknown names list the known ones)."""
    loader = FORMATS.get(fmt)
    return loader(path, block_tokens, skip_bad_rows)


_FORMAT_KEYS = (
    ("arrival_s", "bursted-art"),
    ("timestamp_ms", "art-chat"),
    ("timestamp", "mooncake"),
)


def detect_format(path: Path) -> str:
    """Guess the format from the first row's keys (for CLI commands with `--format auto`)."""
    for line_no, row in iter_rows(path):
        if isinstance(row, BadRow):
            raise UserError(f"{path}:{line_no}: {row.message}; pass --format")
        for key, name in _FORMAT_KEYS:
            if key in row:
                return name
        raise UserError(
            f"{path}:{line_no}: cannot tell the format from fields {sorted(row)}; pass --format"
        )
    raise UserError(f"{path}: trace file is empty")
