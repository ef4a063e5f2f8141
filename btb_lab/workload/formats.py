"""Trace file loaders (`mooncake`, `bursted-art`, `art-chat`) with per-row validation.

Each loader turns a file into `Request`s in file order. A malformed row is a `UserError`
naming the file, the line and the field (`trace.jsonl:17: field 'input_length': must be
≥ 0`), or, with `skip_bad_rows`, is counted in `LoadedTrace.bad_rows` — never dropped
silently. Arrival times stay as the file gives them; time scaling happens in `loader`.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from btb_lab.collector import paused
from btb_lab.config.limits import MAX_TOKENS, MAX_TURN
from btb_lab.errors import UserError
from btb_lab.records import Request
from btb_lab.registry import Registry
from btb_lab.workload.hashing import BlockIdInterner, block_id
from btb_lab.workload.trace_checks import (
    check_trace_input,
    open_trace,
    parquet_rows,
    token_count,
    trace_stem,
)

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
    if not path.is_file():
        raise UserError(
            f"{path}: not a regular file (a pipe or a device); write the trace to a file first"
        )
    if path.suffix == ".parquet":
        yield from enumerate(parquet_rows(path), start=1)
        return
    line_no = 0
    try:
        with open_trace(path) as raw, io.TextIOWrapper(raw, encoding="utf-8-sig") as handle:
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
    except EOFError:
        raise UserError(
            f"{path}:{line_no + 1}: the gzip stream ends early (a cut download?)"
        ) from None


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
        raise BadRow(name, f"{token_count(value)} tokens is more than the limit of {MAX_TOKENS:,}")
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


_ID_TYPES_INT = frozenset({int})
_ID_TYPES_ANY = frozenset({int, str})


def _hash_ids(
    row: dict[str, Any],
    input_tokens: int,
    block_tokens: int,
    interner: BlockIdInterner,
    *,
    allow_str: bool,
) -> tuple[int, ...]:
    value = _require(row, "hash_ids")
    if not isinstance(value, list | tuple):
        raise BadRow("hash_ids", "must be a list")
    # One C-level pass over the types instead of a check per id; only a row with some
    # other type walks its ids to name the first bad one.
    if set(map(type, value)) <= (_ID_TYPES_ANY if allow_str else _ID_TYPES_INT):
        ids = interner.ids(value)
    else:
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int | str):
                raise BadRow("hash_ids", f"ids must be integers or strings, got {item!r}")
            if isinstance(item, str) and not allow_str:
                raise BadRow("hash_ids", f"ids must be integers, got {item!r}")
        ids = tuple(block_id(item) for item in value)  # subclasses of int / str
    limit = math.ceil(input_tokens / block_tokens)
    if len(ids) > limit:
        raise BadRow(
            "hash_ids",
            f"{len(ids)} ids but input_length {input_tokens} at {block_tokens} tokens "
            f"per block allows at most {limit}",
        )
    return ids


class _SessionTurns:
    """Turn order within sessions: earlier turns arrive no later than a turn, later turns
    after it. Keeps each turn's earliest and latest arrival, since one session may hold
    several requests of one turn (a burst job's requests are all its turn 1)."""

    def __init__(self) -> None:
        self._sessions: dict[tuple[str, str], dict[int, tuple[float, float]]] = {}

    def check(self, trace_id: str, session_id: str, turn: int, arrival_s: float) -> None:
        turns = self._sessions.setdefault((trace_id, session_id), {})
        for other_turn, (first_s, last_s) in turns.items():
            if (other_turn < turn and last_s > arrival_s) or (
                other_turn > turn and first_s <= arrival_s
            ):
                raise BadRow(
                    "arrival_s",
                    f"turn {turn} of session {session_id!r} is out of order with turn {other_turn}",
                )
        first_s, last_s = turns.get(turn, (arrival_s, arrival_s))
        turns[turn] = (min(first_s, arrival_s), max(last_s, arrival_s))


def _columnar(
    build: Callable[[Any, Path, int], list[Request]], path: Path, block_tokens: int
) -> LoadedTrace | None:
    """`build`'s requests from the columnar reader, or None where the file needs the row
    loader (see `columnar`: the fast path takes only files every row of which the row
    loader would accept as they are)."""
    if not path.is_file():
        return None
    from btb_lab.workload import columnar

    try:
        return LoadedTrace(build(columnar, path, block_tokens))
    except columnar.Fallback:
        return None
    except (ValueError, OSError, EOFError):  # the row loader says why, with the file
        return None


def _goes_back(timestamp_ms: float, latest_ms: float, latest_line: int) -> str:
    """Why a row is out of arrival order, naming the row it is earlier than: one wrong
    timestamp far ahead puts every later row "earlier", and is the row to mend."""
    return (f"{timestamp_ms:g} is earlier than line {latest_line}'s {latest_ms:g} (file order "
            "is arrival order)")  # fmt: skip


def _non_decreasing(values: list[float], previous: float) -> bool:
    return all(a <= b for a, b in pairwise([previous, *values]))


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

    File order is arrival order, so a timestamp earlier than an earlier row's is an error.
    """
    check_trace_input(path, "mooncake", block_tokens)
    fast = _columnar(_columnar_mooncake, path, block_tokens)
    if fast is not None:
        return fast
    last = (-math.inf, 0)  # the latest timestamp so far, and its line
    interner = BlockIdInterner()
    stem = trace_stem(path)  # once per file, not per row

    def parse(line_no: int, row: dict[str, Any]) -> Request:
        nonlocal last
        timestamp_ms = _time(row, "timestamp")
        input_tokens = _length(row, "input_length")
        output_tokens = _length(row, "output_length")
        hashes = _hash_ids(row, input_tokens, block_tokens, interner, allow_str=False)
        if timestamp_ms < last[0]:
            raise BadRow("timestamp", _goes_back(timestamp_ms, *last))
        last = (timestamp_ms, line_no)
        return Request(
            request_id=f"{stem}-{line_no}",
            arrival_s=timestamp_ms / 1000.0,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            block_hashes=hashes,
            block_tokens=block_tokens,
            source="trace",
        )

    return _run_rows(path, skip_bad_rows, parse)


def _columnar_mooncake(col: Any, path: Path, block_tokens: int) -> list[Request]:
    fields = {"timestamp": "time", "input_length": "length", "output_length": "length"}
    schema = col.schema(fields, col.id_type(path, allow_str=False))
    out: list[Request] = []
    last_ms = -math.inf
    interned: dict[int, int] = {}  # block id -> its one object in the file
    stem = trace_stem(path)
    for batch, _, ids in col.read_batches(path, schema, interned):
        times_ms = col.required_times(batch, "timestamp")
        inputs = col.required_lengths(batch, "input_length")
        outputs = col.required_lengths(batch, "output_length")
        hashes = col.block_id_tuples(batch, inputs, block_tokens, interned=interned, scanned=ids)
        if not _non_decreasing(times_ms, last_ms):
            raise col.Fallback("timestamps go back")
        line_no = len(out)
        for timestamp_ms, input_tokens, output_tokens, blocks in zip(
            times_ms, inputs, outputs, hashes, strict=True
        ):
            line_no += 1
            out.append(
                Request(
                    request_id=f"{stem}-{line_no}",
                    arrival_s=timestamp_ms / 1000.0,
                    input_tokens=input_tokens,
                    output_tokens=output_tokens,
                    block_hashes=blocks,
                    block_tokens=block_tokens,
                    source="trace",
                )
            )
        if times_ms:
            last_ms = times_ms[-1]
    return out


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
    `turn`, turns of one session must arrive in turn order (one turn may hold several
    requests, as a burst job's requests are all its turn 1); a `job_kind` there becomes
    the request's `job_kind`.
    """
    check_trace_input(path, "bursted-art", block_tokens)
    fast = _columnar(_columnar_bursted_art, path, block_tokens)
    if fast is not None:
        return fast
    seen_ids: dict[str, int] = {}
    session_turns = _SessionTurns()
    interner = BlockIdInterner()

    def parse(line_no: int, row: dict[str, Any]) -> Request:
        arrival_s = _time(row, "arrival_s")
        trace_id = _text(row, "trace_id")
        source = _text(row, "source")
        if source not in BURSTED_ART_SOURCES:
            raise BadRow("source", f"must be one of {', '.join(BURSTED_ART_SOURCES)}")
        request_id = _text(row, "request_id")
        input_tokens = _length(row, "input_length")
        output_tokens = _length(row, "output_length")
        hashes = _hash_ids(row, input_tokens, block_tokens, interner, allow_str=True)
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
            if (
                isinstance(turn_value, bool)
                or not isinstance(turn_value, int)
                or not 1 <= turn_value <= MAX_TURN
            ):
                raise BadRow("metadata.turn", f"must be an integer from 1 to {MAX_TURN:,}")
            turn = turn_value
            if session_id is not None:
                session_turns.check(trace_id, session_id, turn, arrival_s)
        job_kind = meta.get("job_kind")
        if job_kind is not None and (not isinstance(job_kind, str) or not job_kind):
            raise BadRow("metadata.job_kind", "must be a non-empty string")
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
            job_kind=job_kind,
        )

    return _run_rows(path, skip_bad_rows, parse)


def _columnar_bursted_art(col: Any, path: Path, block_tokens: int) -> list[Request]:
    fields = {
        "arrival_s": "time", "trace_id": "text", "source": "text", "request_id": "text",
        "input_length": "length", "output_length": "length", "session_id": "text",
        "group_id": "text", "metadata": "metadata",
    }  # fmt: skip
    schema = col.schema(fields, col.id_type(path, allow_str=True))
    seen_ids: set[str] = set()
    session_turns = _SessionTurns()
    out: list[Request] = []
    interned: dict[int, int] = {}  # block id -> its one object in the file
    for batch, null_turn_written, ids in col.read_batches(path, schema, interned):
        arrivals = col.required_times(batch, "arrival_s")
        trace_ids = col.required_text(batch, "trace_id")
        sources = col.required_text(batch, "source")
        if not set(sources) <= set(BURSTED_ART_SOURCES):
            raise col.Fallback("unknown source")
        request_ids = col.required_text(batch, "request_id")
        inputs = col.required_lengths(batch, "input_length")
        outputs = col.required_lengths(batch, "output_length")
        hashes = col.block_id_tuples(batch, inputs, block_tokens, interned=interned, scanned=ids)
        sessions = col.optional_text(batch, "session_id")
        groups = col.optional_text(batch, "group_id")
        turns, has_turn = col.turns(batch, null_turn_written)
        kinds = col.job_kinds(batch)
        rows = zip(
            arrivals, trace_ids, sources, request_ids, inputs, outputs, hashes, sessions,
            groups, turns, has_turn, kinds, strict=True,
        )  # fmt: skip
        for arrival_s, trace_id, source, request_id, input_tokens, output_tokens, blocks, \
                session_id, group_id, turn, turn_given, job_kind in rows:  # fmt: skip
            if request_id in seen_ids:
                raise col.Fallback("a request id repeats")
            if turn_given and session_id is not None:
                try:
                    session_turns.check(trace_id, session_id, turn, arrival_s)
                except BadRow:
                    raise col.Fallback("turns out of order") from None
            seen_ids.add(request_id)
            out.append(
                Request(
                    request_id=request_id,
                    arrival_s=arrival_s,
                    input_tokens=input_tokens,
                    output_tokens=output_tokens,
                    block_hashes=blocks,
                    block_tokens=block_tokens,
                    session_id=session_id,
                    group_id=group_id,
                    trace_id=trace_id,
                    source=source,
                    turn=turn,
                    job_kind=job_kind,
                )
            )
    return out


@FORMATS.register("art-chat")
def load_art_chat(path: Path, block_tokens: int, skip_bad_rows: bool) -> LoadedTrace:
    """ART-Chat rows (`timestamp_ms`, `request_id`, `system_prompt_hash`, lengths, `hash_ids`).

    JSONL or parquet (by suffix). File order is arrival order; `system_prompt_hash`
    becomes the request's `group_id`.
    """
    check_trace_input(path, "art-chat", block_tokens)
    fast = _columnar(_columnar_art_chat, path, block_tokens)
    if fast is not None:
        return fast
    last = (-math.inf, 0)  # the latest timestamp so far, and its line
    seen_ids: dict[str, int] = {}
    interner = BlockIdInterner()

    def parse(line_no: int, row: dict[str, Any]) -> Request:
        nonlocal last
        timestamp_ms = _time(row, "timestamp_ms")
        request_id = _text(row, "request_id")
        system_prompt = _text(row, "system_prompt_hash", required=False)
        input_tokens = _length(row, "input_length")
        output_tokens = _length(row, "output_length")
        hashes = _hash_ids(row, input_tokens, block_tokens, interner, allow_str=True)
        assert request_id is not None
        if request_id in seen_ids:
            raise BadRow("request_id", f"{request_id!r} repeats line {seen_ids[request_id]}")
        if timestamp_ms < last[0]:
            raise BadRow("timestamp_ms", _goes_back(timestamp_ms, *last))
        last = (timestamp_ms, line_no)
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


def _columnar_art_chat(col: Any, path: Path, block_tokens: int) -> list[Request]:
    fields = {
        "timestamp_ms": "time", "request_id": "text", "system_prompt_hash": "text",
        "input_length": "length", "output_length": "length",
    }  # fmt: skip
    schema = col.schema(fields, col.id_type(path, allow_str=True))
    seen_ids: set[str] = set()
    out: list[Request] = []
    last_ms = -math.inf
    interned: dict[int, int] = {}  # block id -> its one object in the file
    for batch, _, ids in col.read_batches(path, schema, interned):
        times_ms = col.required_times(batch, "timestamp_ms")
        request_ids = col.required_text(batch, "request_id")
        prompts = col.optional_text(batch, "system_prompt_hash")
        inputs = col.required_lengths(batch, "input_length")
        outputs = col.required_lengths(batch, "output_length")
        hashes = col.block_id_tuples(batch, inputs, block_tokens, interned=interned, scanned=ids)
        if not _non_decreasing(times_ms, last_ms):
            raise col.Fallback("timestamps go back")
        before = len(seen_ids)
        seen_ids.update(request_ids)
        if len(seen_ids) != before + len(request_ids):
            raise col.Fallback("a request id repeats")
        for timestamp_ms, request_id, system_prompt, input_tokens, output_tokens, blocks in zip(
            times_ms, request_ids, prompts, inputs, outputs, hashes, strict=True
        ):
            out.append(
                Request(
                    request_id=request_id,
                    arrival_s=timestamp_ms / 1000.0,
                    input_tokens=input_tokens,
                    output_tokens=output_tokens,
                    block_hashes=blocks,
                    block_tokens=block_tokens,
                    group_id=system_prompt,
                    source="art",
                )
            )
        if times_ms:
            last_ms = times_ms[-1]
    return out


def load_trace(
    path: Path, fmt: str, *, block_tokens: int = 512, skip_bad_rows: bool = False
) -> LoadedTrace:
    """Load a trace file with the named format (unknown names list the known ones), the
    cyclic collector paused (the requests and their block-id tuples hold no cycles)."""
    loader = FORMATS.get(fmt)
    with paused():
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
