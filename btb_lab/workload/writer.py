"""Write requests in the Bursted-ART row schema: JSONL (what `btb-lab trace generate`
emits) and parquet (what `btb-lab trace convert` emits).

JSONL block ids are short per-file strings (base 36 of first appearance), which keeps
samples small; reading them back hashes the strings, so prefix sharing is exactly
preserved while the integer values differ. Parquet block ids are the loaded ids
themselves (integers, which loaders keep as they are), so a converted file loads to the
same requests as its source, without parsing or hashing a string per block.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from btb_lab.records import Request

__all__ = ["bursted_art_rows", "write_bursted_art", "write_bursted_art_parquet"]

_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _base36(value: int) -> str:
    if value == 0:
        return "0"
    out = []
    while value:
        value, digit = divmod(value, 36)
        out.append(_DIGITS[digit])
    return "".join(reversed(out))


def bursted_art_rows(requests: Iterable[Request]) -> Iterable[dict[str, Any]]:
    """One Bursted-ART row per request; `metadata` keeps turn, train/test split and the
    job kind where the request has one."""
    names: dict[int, str] = {}
    for request in requests:
        hash_ids = []
        for block in request.block_hashes:
            name = names.get(block)
            if name is None:
                name = names[block] = _base36(len(names))
            hash_ids.append(name)
        metadata: dict[str, Any] = {"turn": request.turn}
        split = request.trace_id.split("-", 1)[0]
        if split in ("train", "test"):
            metadata["split"] = split
        if request.job_kind is not None:
            metadata["job_kind"] = request.job_kind
        if request.source not in ("art", "synthetic"):
            raise ValueError(f"source {request.source!r} is not art or synthetic")
        yield {
            "arrival_s": round(request.arrival_s, 6),
            "trace_id": request.trace_id,
            "source": request.source,
            "request_id": request.request_id,
            "input_length": request.input_tokens,
            "output_length": request.output_tokens,
            "hash_ids": hash_ids,
            "session_id": request.session_id,
            "group_id": request.group_id,
            "metadata": metadata,
        }


def write_bursted_art(requests: Iterable[Request], path: Path) -> int:
    """Write JSONL rows to `path`; returns the number of rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8") as handle:
        for row in bursted_art_rows(requests):
            handle.write(json.dumps(row, separators=(",", ":")) + "\n")
            count += 1
    return count


def write_bursted_art_parquet(requests: list[Request], path: Path) -> int:
    """Write `requests` as one Bursted-ART parquet file, in row groups of the columnar
    reader's batch size; returns the number of rows.

    `metadata` is null where a request has turn 1 and no job kind, and otherwise carries
    its turn (null for turn 1) and job kind: turns of 1 left unwritten keep the loader's
    turn-order checks a subset of the source's, so a file that loaded once loads again.
    """
    from itertools import chain

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from btb_lab.workload.columnar import PARQUET_ROWS

    counts = np.fromiter((len(r.block_hashes) for r in requests), np.int64, len(requests))
    offsets = np.zeros(len(requests) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    ids = np.fromiter(
        chain.from_iterable(r.block_hashes for r in requests), np.int64, int(offsets[-1])
    )
    small = int(offsets[-1]) < 2**31  # int32 list offsets
    lists, offset_type = (pa.ListArray, np.int32) if small else (pa.LargeListArray, np.int64)
    metadata = [
        None
        if r.turn == 1 and r.job_kind is None
        else {"turn": r.turn if r.turn != 1 else None, "job_kind": r.job_kind}
        for r in requests
    ]

    def text(values: list[str | None]) -> pa.Array:
        return pa.array(values, pa.string())

    table = pa.table(
        {
            "arrival_s": pa.array([r.arrival_s for r in requests], pa.float64()),
            "trace_id": text([r.trace_id for r in requests]),
            "source": text([r.source for r in requests]),
            "request_id": text([r.request_id for r in requests]),
            "input_length": pa.array([r.input_tokens for r in requests], pa.int64()),
            "output_length": pa.array([r.output_tokens for r in requests], pa.int64()),
            "hash_ids": lists.from_arrays(pa.array(offsets.astype(offset_type)), ids),
            "session_id": text([r.session_id for r in requests]),
            "group_id": text([r.group_id for r in requests]),
            "metadata": pa.array(
                metadata, pa.struct([("turn", pa.int64()), ("job_kind", pa.string())])
            ),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=PARQUET_ROWS, compression="zstd")
    return table.num_rows
