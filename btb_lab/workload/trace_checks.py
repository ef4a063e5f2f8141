"""Checks a trace load makes before it reads a row, and the wording of token counts.

A block size below one token cannot cut a prompt into blocks (the id-count check divides
by it), and a parquet file without a column the format needs would otherwise load as an
empty trace when it has no rows, or fail on row 1 with a message about one row. The CLI
and the generators use the same checks, so a flag, a library call and a hypothesis field
are refused alike. Kept apart from `formats` so that module stays under 600 lines.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

from btb_lab.config.limits import MAX_BLOCK_TOKENS
from btb_lab.errors import UserError

__all__ = [
    "REQUIRED_COLUMNS",
    "block_size_hint",
    "check_block_tokens",
    "check_trace_input",
    "milliseconds_hint",
    "open_trace",
    "parquet_rows",
    "token_count",
    "trace_stamp",
    "trace_stem",
    "unreadable_parquet",
]

# What each format's row loader requires of every row (`formats._require`, `_text`).
REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "mooncake": ("timestamp", "input_length", "output_length", "hash_ids"),
    "bursted-art": (
        "arrival_s", "trace_id", "source", "request_id", "input_length", "output_length",
        "hash_ids",
    ),
    "art-chat": ("timestamp_ms", "request_id", "input_length", "output_length", "hash_ids"),
}  # fmt: skip


GZIP_MAGIC = b"\x1f\x8b"


def open_trace(path: Path) -> BinaryIO:
    """A JSONL trace's bytes, decompressed where the file is gzip (by its first bytes, not
    its name: `trace.jsonl.gz` as published, or renamed). A truncated gzip stream raises
    `EOFError` on the read that reaches its end."""
    import gzip

    handle = path.open("rb")
    if handle.read(2) == GZIP_MAGIC:
        handle.close()
        return gzip.open(path, "rb")  # type: ignore[return-value]  # a GzipFile reads bytes
    handle.seek(0)
    return handle


def trace_stem(path: Path) -> str:
    """The file's name without its suffix, and without `.gz` before that: the request ids
    of `conv.jsonl.gz` are those of `conv.jsonl`."""
    return Path(path.stem).stem if path.suffix == ".gz" else path.stem


def check_block_tokens(block_tokens: object, where: str = "block_tokens") -> None:
    """Refuse a block size below 1 token (`where` names the flag or field): a prompt of n
    tokens has ceil(n / block_tokens) blocks, which 0 cannot give and a negative size
    turns into a negative count; and one above MAX_BLOCK_TOKENS, past int64 arithmetic."""
    if (
        isinstance(block_tokens, bool)
        or not isinstance(block_tokens, int)
        or not 1 <= block_tokens <= MAX_BLOCK_TOKENS
    ):
        raise UserError(
            f"{where} must be an integer from 1 to {MAX_BLOCK_TOKENS:,} (got {block_tokens!r})"
        )


def unreadable_parquet(path: Path, exc: BaseException) -> UserError:
    """The one-line error for a file pyarrow cannot read as parquet."""
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return UserError(f"{path}: not a readable parquet file ({reason})")


def check_trace_input(path: Path, fmt: str, block_tokens: int) -> None:
    """What every loader checks first: the block size, and that a parquet file has every
    column `fmt` requires (`FILE: field 'NAME': no such column; ...`). JSONL has no
    schema: its rows name a missing field themselves."""
    check_block_tokens(block_tokens)
    required = REQUIRED_COLUMNS.get(fmt)
    if required is None or path.suffix != ".parquet" or not path.is_file():
        return  # a missing file or folder: `iter_rows` says which
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
    except (pa.ArrowException, OSError) as exc:
        raise unreadable_parquet(path, exc) from None
    missing = [name for name in required if name not in names]
    if missing:
        has = ", ".join(names) if names else "none"
        raise UserError(
            f"{path}: field {missing[0]!r}: no such column; a {fmt} trace needs "
            f"{', '.join(required)} (columns in the file: {has})"
        )


def token_count(value: float) -> str:
    """A token count as written: `20,000,000` for an integer (or an integral float that
    is exact), `1e+29` for a float too large to be exact."""
    if isinstance(value, float) and not (value.is_integer() and abs(value) <= 2**53):
        return f"{value:g}"
    return f"{int(value):,}"


def block_size_hint(lengths: Iterable[tuple[int, int]], block_tokens: int) -> str | None:
    """What to say when a trace's rows, as (input tokens, block ids), carry one id per
    k × `block_tokens` tokens (k ≥ 2): each id then stands for `block_tokens` tokens, and
    every cached prefix counts 1/k of its length (a 512-token trace read at 256). A row
    with more ids than its prompt allows is refused by the loader; this is the other side.
    Only rows of two or more ids decide, and only when every one of them agrees."""
    rows = [(tokens, n) for tokens, n in lengths if n >= 2 and tokens > 0]
    if not rows or any(-(-tokens // block_tokens) == n for tokens, n in rows):
        return None
    for k in (2, 4, 8, 16, 32, 64):
        size = k * block_tokens
        if all(-(-tokens // size) == n for tokens, n in rows):
            return (
                f"every row carries one block id per {size} tokens, but workload.block_tokens "
                f"is {block_tokens}: each id stands for {block_tokens} tokens, so cached "
                f"prefixes count 1/{k} of their length (workload.block_tokens: {size})"
            )
    return None


# Mooncake's timestamps are milliseconds; a trace whose requests arrive faster than this
# once read so was most likely written in seconds (the published traces: a few per second).
SECONDS_LIKELY_PER_S = 1000.0


def milliseconds_hint(fmt: str, requests: int, span_s: float, time_scale: float) -> str | None:
    """What to say when a Mooncake-format trace of `requests` spanning `span_s` (after
    `time_scale`) arrives too fast for milliseconds: seconds read as milliseconds replay
    the trace a thousand times denser, with nothing else amiss to give it away. Nothing
    once `time_scale` makes the replay's rate plausible: the advice was taken."""
    if fmt != "mooncake" or requests < 100:
        return None
    raw_span_s = span_s / time_scale
    for span in (raw_span_s, span_s):
        if span > 0 and requests / span <= SECONDS_LIKELY_PER_S:
            return None
    rate = f"{requests / raw_span_s:,.0f} requests/s" if raw_span_s > 0 else "all at once"
    return (
        f"Mooncake timestamps are milliseconds; read so, {requests:,} requests arrive in "
        f"{raw_span_s:.3g} s ({rate}) before time_scale. If this file's timestamps are "
        f"seconds, multiply time_scale by 1000 (time_scale: {time_scale * 1000:g})"
    )


STAMP_EDGE_BYTES = 1 << 20
STAMP_CHUNK_BYTES = 1 << 22  # the CRC's reads


def trace_stamp(path: Path) -> dict[str, object]:
    """What tells a trace file's contents apart: its size, a digest of its first and last
    MiB, and a CRC-32 of the whole file (zlib's, about 0.1 s for a 160 MB trace: an edit
    in the middle that keeps the size is seen too). Not its modification time, so a copy
    on another machine stamps the same. A run records it; a sweep reruns a point, and
    compare refuses a pair, whose trace it no longer matches (`results.manifest.same_contents`)."""
    import hashlib
    import zlib

    size = path.stat().st_size
    digest = hashlib.blake2b(digest_size=16)
    crc = 0
    with path.open("rb") as handle:
        while chunk := handle.read(STAMP_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
        handle.seek(0)
        digest.update(handle.read(STAMP_EDGE_BYTES))
        if size > STAMP_EDGE_BYTES:
            handle.seek(max(STAMP_EDGE_BYTES, size - STAMP_EDGE_BYTES))
            digest.update(handle.read(STAMP_EDGE_BYTES))
    return {
        "path": str(path.resolve()), "bytes": size, "edges_blake2b": digest.hexdigest(),
        "crc32": f"{crc:08x}",
    }  # fmt: skip


def parquet_rows(path: Path) -> list[dict[str, Any]]:
    """A parquet trace's rows as dicts, for the row loader."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise unreadable_parquet(path, exc) from None
    rows = table.to_pylist()
    # a struct column has every field in every row: a null field is one the row does
    # not have (as the columnar reader reads it), not a written null
    for row in rows:
        meta = row.get("metadata")
        if isinstance(meta, dict) and None in meta.values():
            row["metadata"] = {k: v for k, v in meta.items() if v is not None}
    return rows
