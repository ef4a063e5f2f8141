"""The seed's burst audit: how many requests share a deep prefix within a short interval.

The deep fan-out counts requests whose first 16 blocks agree and whose arrivals fall
within 10 s of each other (turns of one session count once); the shallow variant uses
8 blocks and 60 s. The seed reports 2 for Mooncake and 25 for ART-Chat, which is why it
built Bursted-ART, whose bursts reach the full burst size.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from btb_lab.records import Request

__all__ = ["BurstAudit", "FanoutResult", "burst_audit", "prefix_fanout"]


@dataclass(frozen=True)
class FanoutResult:
    """Largest synchronized fan-out for one (depth, window) setting."""

    depth_blocks: int
    window_s: float
    max_fanout: int  # most distinct sessions sharing the prefix inside one window
    events: int  # anchored windows with at least `min_fanout` distinct sessions
    min_fanout: int
    prefixes: int  # distinct (trace_id, prefix) keys among requests this deep
    largest_group: str | None  # "trace_id/group_id" (or request id) of the largest fan-out


@dataclass(frozen=True)
class BurstAudit:
    """The seed's two audit settings."""

    deep: FanoutResult
    shallow: FanoutResult

    def to_dict(self) -> dict[str, Any]:
        return {"deep": asdict(self.deep), "shallow": asdict(self.shallow)}


def _session_key(request: Request) -> str:
    return request.session_id if request.session_id is not None else f"req:{request.request_id}"


def prefix_fanout(
    requests: Sequence[Request], *, depth_blocks: int, window_s: float, min_fanout: int = 2
) -> FanoutResult:
    """Sliding-window fan-out per (window, leading `depth_blocks` ids); O(n log n)."""
    groups: dict[tuple[str, tuple[int, ...]], list[Request]] = {}
    for request in requests:
        if len(request.block_hashes) >= depth_blocks:
            key = (request.trace_id, request.block_hashes[:depth_blocks])
            groups.setdefault(key, []).append(request)
    best = 0
    best_label: str | None = None
    events = 0
    for members in groups.values():
        members.sort(key=lambda r: r.arrival_s)
        sessions = [_session_key(r) for r in members]
        times = [r.arrival_s for r in members]
        inside: Counter[str] = Counter()
        left = 0
        for right, session in enumerate(sessions):
            inside[session] += 1
            while times[right] - times[left] > window_s:
                inside[sessions[left]] -= 1
                if inside[sessions[left]] == 0:
                    del inside[sessions[left]]
                left += 1
            if len(inside) > best:
                best = len(inside)
                anchor = members[right]
                best_label = f"{anchor.trace_id}/{anchor.group_id or anchor.request_id}"
        start = 0
        while start < len(members):
            end = start
            while end < len(members) and times[end] - times[start] <= window_s:
                end += 1
            if len(set(sessions[start:end])) >= min_fanout:
                events += 1
            start = end
    return FanoutResult(
        depth_blocks=depth_blocks,
        window_s=window_s,
        max_fanout=best,
        events=events,
        min_fanout=min_fanout,
        prefixes=len(groups),
        largest_group=best_label,
    )


def burst_audit(
    requests: Sequence[Request],
    *,
    deep_blocks: int = 16,
    deep_window_s: float = 10.0,
    shallow_blocks: int = 8,
    shallow_window_s: float = 60.0,
    min_fanout: int = 2,
) -> BurstAudit:
    """Deep (16 blocks, 10 s) and shallow (8 blocks, 60 s) fan-outs of a trace."""
    return BurstAudit(
        deep=prefix_fanout(
            requests, depth_blocks=deep_blocks, window_s=deep_window_s, min_fanout=min_fanout
        ),
        shallow=prefix_fanout(
            requests,
            depth_blocks=shallow_blocks,
            window_s=shallow_window_s,
            min_fanout=min_fanout,
        ),
    )
