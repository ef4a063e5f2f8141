"""Write requests in the Bursted-ART row schema (what `btb-lab trace generate` emits).

Block ids are written as short per-file strings (base 36 of first appearance), which
keeps samples small; reading them back hashes the strings, so prefix sharing is exactly
preserved while the integer values differ.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from btb_lab.records import Request

__all__ = ["bursted_art_rows", "write_bursted_art"]

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
