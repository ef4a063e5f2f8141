"""Trace statistics for `btb-lab trace inspect`: size, span, rates, lengths, reuse.

Also `ideal_cached_tokens`: the prefix a perfect, unbounded cache would hold for each
request given everything that arrived before it — the upper bound any router can reach,
used to check the agentic mix (most HEAVY requests are cold first turns).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from btb_lab.records import Request

__all__ = ["ideal_cached_tokens", "trace_summary"]

_PERCENTILES = (50, 90, 99)


def ideal_cached_tokens(requests: Sequence[Request]) -> list[int]:
    """Per request (in the given order, which should be arrival order): leading tokens
    whose full blocks already appeared in an earlier request."""
    seen: set[int] = set()
    cached: list[int] = []
    for request in requests:
        full = min(len(request.block_hashes), request.input_tokens // request.block_tokens)
        hits = 0
        while hits < full and request.block_hashes[hits] in seen:
            hits += 1
        cached.append(hits * request.block_tokens)
        seen.update(request.block_hashes[:full])
    return cached


def _percentiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {f"p{q}": 0.0 for q in _PERCENTILES}
    arr = np.asarray(values, dtype=float)
    return {f"p{q}": float(np.percentile(arr, q)) for q in _PERCENTILES} | {
        "mean": float(arr.mean()),
        "max": float(arr.max()),
    }


def trace_summary(requests: Sequence[Request], *, top_windows: int = 10) -> dict[str, Any]:
    """Everything `trace inspect` prints, as plain JSON-ready values."""
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    times = [r.arrival_s for r in ordered]
    span_s = (times[-1] - times[0]) if times else 0.0
    total_blocks = sum(len(r.block_hashes) for r in ordered)
    seen: set[int] = set()
    reused = 0
    for request in ordered:
        for block in request.block_hashes:
            if block in seen:
                reused += 1
            else:
                seen.add(block)
    windows = Counter(r.trace_id for r in ordered)
    sources = Counter(r.source for r in ordered)
    # sessions are per window, as replay and the turn checks key them
    sessions = {(r.trace_id, r.session_id) for r in ordered if r.session_id is not None}
    turns = Counter(r.turn for r in ordered)
    return {
        "rows": len(ordered),
        "span_s": span_s,
        "arrival_rate_per_s": (len(ordered) - 1) / span_s if span_s > 0 else None,
        "input_tokens": _percentiles([r.input_tokens for r in ordered]),
        "output_tokens": _percentiles([r.output_tokens for r in ordered]),
        "blocks": total_blocks,
        "distinct_blocks": len(seen),
        "block_reuse_ratio": reused / total_blocks if total_blocks else 0.0,
        "sessions": len(sessions),
        "turns": {str(k): v for k, v in sorted(turns.items())},
        "windows": len(windows),
        "per_window": dict(windows.most_common(top_windows)),
        "per_source": dict(sorted(sources.items())),
    }
