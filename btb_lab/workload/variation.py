"""Repeats of a trace replay that differ: arrival jitter and window resampling.

A generator draws new requests from each repeat's workload seed; a trace file replays the
same rows every time, so its repeats would only measure the backend's determinism. With
`workload.variation` each repeat draws, from its own seed, which windows it replays
(with replacement) and how far each arrival moves, so the spread between repeats is the
workload's. Pure and seeded: the same seed gives the same requests.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from typing import TYPE_CHECKING

from btb_lab.config.workload import RepeatVariation
from btb_lab.records import Request
from btb_lab.workload.hashing import stable_hashes63

if TYPE_CHECKING:  # numpy loads with the first workload drawn, not at validate time
    import numpy as np

__all__ = ["jitter_arrivals", "resample_windows", "vary_requests"]


def resample_windows(requests: list[Request], rng: np.random.Generator) -> list[Request]:
    """As many windows (trace_ids) as there are, drawn with replacement, in drawn order;
    the k-th copy of a window gets ids, sessions, groups and trace_id suffixed `~k`, and
    new ids for the blocks no other window has (`_copied_blocks`)."""
    windows: dict[str, list[Request]] = {}
    for request in requests:
        windows.setdefault(request.trace_id, []).append(request)
    names = list(windows)
    if len(names) < 2:
        return requests
    drawn = rng.integers(0, len(names), len(names))
    seen: dict[str, int] = {}
    out: list[Request] = []
    private: dict[str, set[int]] | None = None
    for index in drawn:
        name = names[int(index)]
        copy = seen.get(name, 0)
        seen[name] = copy + 1
        if copy == 0:
            out.extend(windows[name])
            continue
        if private is None:
            private = _private_blocks(windows)
        tag = f"~{copy}"
        fresh = _copied_blocks(private[name], tag)
        for r in windows[name]:
            out.append(
                dataclasses.replace(
                    r,
                    request_id=r.request_id + tag,
                    trace_id=r.trace_id + tag,
                    session_id=None if r.session_id is None else r.session_id + tag,
                    group_id=None if r.group_id is None else r.group_id + tag,
                    block_hashes=tuple(map(fresh.get, r.block_hashes, r.block_hashes)),
                )
            )
    return out


def _private_blocks(windows: dict[str, list[Request]]) -> dict[str, set[int]]:
    """Per window, the block ids no other window holds: its own prompts' content."""
    held = {name: set().union(*(r.block_hashes for r in rows)) for name, rows in windows.items()}
    count = Counter(itertools.chain.from_iterable(held.values()))
    return {name: {h for h in ids if count[h] == 1} for name, ids in held.items()}


def _copied_blocks(private: set[int], tag: str) -> dict[int, int]:
    """New ids for a copy's own blocks (the same in every process: `stable_hashes63` of
    the id and the copy's tag). A copy replayed with the original's ids would find its
    twin's KV still cached and replay warm, a repeat that is not a new draw of the
    workload; blocks other windows share (a common system prompt) keep their ids."""
    ordered = sorted(private)
    return dict(zip(ordered, stable_hashes63([f"{h}{tag}" for h in ordered]), strict=True))


def jitter_arrivals(requests: list[Request], jitter_s: float, rng: np.random.Generator) -> None:
    """Move every arrival by uniform(−jitter_s, +jitter_s); within a session the jittered
    times are handed out in the original turn order (in place). Where a draw falls before
    0, every arrival moves later by the same amount: clipping at 0 would pile those
    requests up at 0, a burst the trace does not have."""
    import numpy as np

    if jitter_s <= 0 or not requests:
        return
    moved = np.array([r.arrival_s for r in requests]) + rng.uniform(
        -jitter_s, jitter_s, len(requests)
    )
    earliest = float(moved.min())
    if earliest < 0:
        moved -= earliest
    # a session is per window, as the loaders and the session gate key it: two windows
    # may both have an `s1`, and one session's times must not cross into another window
    sessions: dict[tuple[str, str], list[int]] = {}
    for i, r in enumerate(requests):
        if r.session_id is not None:
            sessions.setdefault((r.trace_id, r.session_id), []).append(i)
    for i, r in enumerate(requests):
        r.arrival_s = float(moved[i])
    for members in sessions.values():
        if len(members) < 2:
            continue
        members.sort(key=lambda i: (requests[i].turn, i))
        times = sorted(requests[i].arrival_s for i in members)
        for i, t in zip(members, times, strict=True):
            requests[i].arrival_s = t


def vary_requests(
    requests: list[Request], variation: RepeatVariation, seed: int, *, stage: str
) -> list[Request]:
    """One stage of the variation: `windows` (before ordering and time scaling) or
    `jitter` (after them). Each stage draws from its own stream of the repeat's seed."""
    import numpy as np

    if stage == "windows":
        if not variation.resample_windows:
            return requests
        return resample_windows(requests, np.random.default_rng([seed, 1]))
    jitter_arrivals(requests, variation.arrival_jitter_s, np.random.default_rng([seed, 2]))
    return sorted(requests, key=lambda r: r.arrival_s)
