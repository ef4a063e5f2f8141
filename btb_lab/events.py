"""Recording the events of a run (`EventRecord`) the same way in both worlds.

`EventLog` is what the cluster router and the simulator's engine write into: warm copies
and KV transfers as they start and land, and queue depth / running batch per instance as
step changes. Queue and batch changes are kept compactly:
`step_runs` turns a step function into runs of its per-interval maximum on a fixed grid
(`LOAD_INTERVAL_S`), so a million-request run stores a few rows per instance-second,
not one per change, and a burst's peak is never averaged away.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from btb_lab.records import EventRecord

__all__ = [
    "LOAD_INTERVAL_S",
    "EventLog",
    "interval_arrays",
    "interval_runs",
    "step_arrays",
    "step_runs",
]

LOAD_INTERVAL_S = 0.25


def step_runs(
    times: np.ndarray, deltas: np.ndarray, interval_s: float = LOAD_INTERVAL_S
) -> list[tuple[float, float, float]]:
    """`step_arrays` as (start_s, end_s, max) tuples."""
    starts, ends, peaks = step_arrays(times, deltas, interval_s)
    return [
        (float(a), float(b), float(v))
        for a, b, v in zip(starts.tolist(), ends.tolist(), peaks.tolist(), strict=True)
    ]


def step_arrays(
    times: np.ndarray, deltas: np.ndarray, interval_s: float = LOAD_INTERVAL_S
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start_s, end_s, max) runs of a counter that changes by `deltas[i]` at `times[i]`
    (starting from 0): on a grid of `interval_s`, each bin's value is the largest the
    counter took in it; consecutive bins with the same value merge. Changes at the same
    instant apply together (a finish and an admission at one time are no peak). Only bins
    with changes are computed (a bin without one keeps the value before it), so memory
    follows the changes, not the span (windows a day apart cost nothing)."""
    if times.size == 0:
        return np.empty(0), np.empty(0), np.empty(0)
    order = np.argsort(times, kind="stable")
    t = times[order]
    d = deltas[order].astype(np.int64)
    # merge simultaneous changes: the value after each distinct time
    last = np.r_[t[1:] != t[:-1], True]
    value = np.cumsum(d)[last]
    t = t[last]
    bins, local = np.unique(np.floor(t / interval_s).astype(np.int64), return_inverse=True)
    n = bins.size
    peak = np.full(n, np.iinfo(np.int64).min)
    np.maximum.at(peak, local, value)
    last_in_bin = np.empty(n, dtype=np.int64)
    last_in_bin[local] = np.arange(local.size)  # later indices overwrite earlier ones
    after = value[last_in_bin]  # the value each bin ends with
    start = np.r_[0, after[:-1]]  # ... and starts with, carried from the bin before
    # a change exactly at a bin's start replaces the carried value for the whole bin
    first_in_bin = np.empty(n, dtype=np.int64)
    first_in_bin[local[::-1]] = np.arange(local.size)[::-1]
    start[t[first_in_bin] <= bins * interval_s] = np.iinfo(np.int64).min
    peak = np.maximum(peak, start)
    # the bins between two with changes hold the earlier one's last value
    gap = bins[1:] > bins[:-1] + 1
    seg_bins = np.r_[bins, (bins[:-1] + 1)[gap]]
    seg_values = np.r_[peak, after[:-1][gap]]
    order = np.argsort(seg_bins, kind="stable")
    seg_bins, seg_values = seg_bins[order], seg_values[order]
    cut = np.flatnonzero(np.r_[True, seg_values[1:] != seg_values[:-1]])
    begins = seg_bins[cut]
    ends = np.r_[begins[1:], bins[-1] + 1]
    values = seg_values[cut].astype(float)
    keep = np.ones(cut.size, dtype=bool)
    if values.size and values[-1] == 0:  # back to zero after the last change
        keep[-1] = False
    return (
        (begins * interval_s)[keep].astype(float),
        (ends * interval_s)[keep].astype(float),
        values[keep],
    )


def interval_runs(
    starts: np.ndarray, ends: np.ndarray, interval_s: float = LOAD_INTERVAL_S
) -> list[tuple[float, float, float]]:
    """`step_runs` of how many of the intervals [starts[i], ends[i]) are open."""
    a, b, v = interval_arrays(starts, ends, interval_s)
    return [(float(x), float(y), float(z)) for x, y, z in zip(a, b, v, strict=True)]


def interval_arrays(
    starts: np.ndarray, ends: np.ndarray, interval_s: float = LOAD_INTERVAL_S
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`step_arrays` of how many of the intervals [starts[i], ends[i]) are open."""
    keep = np.isfinite(starts) & np.isfinite(ends) & (ends > starts)
    s, e = starts[keep], ends[keep]
    times = np.concatenate([s, e])
    deltas = np.concatenate([np.ones(s.size), -np.ones(e.size)])
    return step_arrays(times, deltas, interval_s)


class EventLog:
    """Events of one variant × repeat as they happen; `records()` at the end."""

    def __init__(self, origin: str, *, interval_s: float = LOAD_INTERVAL_S) -> None:
        self.origin = origin
        self.interval_s = interval_s
        self.events: list[EventRecord] = []
        # (instance, kind) -> change times and deltas of the queue / batch counters
        self._changes: dict[tuple[str, str], tuple[list[float], list[int]]] = {}
        # (instance, kind) -> times the counter rose and fell by one (`counter`)
        self._steps: dict[tuple[str, str], tuple[list[float], list[float]]] = {}

    def warm_copy(
        self, start_s: float, end_s: float | None, target: str, source: str, tokens: float,
        *, mode: str = "rdma", request_id: str = "",
    ) -> None:  # fmt: skip
        """A prefix copy to `target` (from `source`), resident at `end_s` (None: never)."""
        self.events.append(
            EventRecord(
                time_s=start_s,
                kind="warm_copy",
                instance=target,
                peer=source,
                request_id=request_id,
                value=float(tokens),
                end_s=end_s,
                label=mode,
                origin=self.origin,
            )
        )

    def cache_action(
        self, start_s: float, end_s: float, instance: str, kind: str, tokens: float,
        request_id: str = "",
    ) -> None:  # fmt: skip
        """A policy's cache action (`kind`: evict, demote, promote) on `instance`, moving
        or freeing `tokens` of KV from `start_s` to `end_s`."""
        self.events.append(
            EventRecord(
                time_s=start_s,
                kind="cache_action",
                instance=instance,
                request_id=request_id,
                value=float(tokens),
                end_s=end_s,
                label=kind,
                origin=self.origin,
            )
        )

    def kv_transfer(
        self, start_s: float, end_s: float | None, decode: str, prefill: str, tokens: float,
        *, request_id: str = "",
    ) -> None:  # fmt: skip
        """An offloaded request's KV moving from its prefill to its decode instance."""
        self.events.append(
            EventRecord(
                time_s=start_s,
                kind="kv_transfer",
                instance=decode,
                peer=prefill,
                request_id=request_id,
                value=float(tokens),
                end_s=end_s,
                origin=self.origin,
            )
        )

    def change(self, instance: str, kind: str, time_s: float, delta: int) -> None:
        """The `waiting` or `running` counter of `instance` moved by `delta` at `time_s`."""
        times, deltas = self._changes.setdefault((instance, kind), ([], []))
        times.append(time_s)
        deltas.append(delta)

    def counter(
        self, instance: str, kind: str
    ) -> tuple[Callable[[float], None], Callable[[float], None]]:
        """`change` by +1 and by -1 as two `list.append`s of the time: the engine moves
        its counters a few times per request, and a bound append costs no Python frame."""
        rises, falls = self._steps.setdefault((instance, kind), ([], []))
        return rises.append, falls.append

    def counters(
        self, instances: Sequence[str], kind: str
    ) -> tuple[list[Callable[[float], None]], list[Callable[[float], None]]]:
        """`counter` of each instance: (rise appenders, fall appenders), in order."""
        pairs = [self.counter(instance, kind) for instance in instances]
        return [rise for rise, _ in pairs], [fall for _, fall in pairs]

    def extend(self, events: Sequence[EventRecord]) -> None:
        self.events.extend(events)

    def records(self) -> list[EventRecord]:
        """Every event, queue and batch counters as runs of their per-interval maximum."""
        out = list(self.events)
        for instance, kind in sorted(self._changes.keys() | self._steps.keys()):
            times, deltas = self._changes.get((instance, kind), ([], []))
            rises, falls = self._steps.get((instance, kind), ([], []))
            # the order of changes at one instant does not matter: they apply together
            all_times = np.concatenate([np.array(t, dtype=float) for t in (times, rises, falls)])
            all_deltas = np.concatenate(
                [np.array(deltas, dtype=np.int64), np.ones(len(rises), dtype=np.int64),
                 np.full(len(falls), -1, dtype=np.int64)]
            )  # fmt: skip
            runs = step_runs(all_times, all_deltas, self.interval_s)
            for start, end, peak in runs:
                out.append(
                    EventRecord(
                        time_s=start,
                        kind=kind,
                        instance=instance,
                        value=peak,
                        end_s=end,
                        origin=self.origin,
                    )
                )
        out.sort(key=lambda e: (e.time_s, e.kind))
        return out
