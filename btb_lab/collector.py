"""Keeping Python's cyclic garbage collector off what a run loads and simulates.

A workload and a simulated run are hundreds of thousands of small acyclic objects
(requests, block-id tuples, records). The cyclic collector finds nothing among them, yet
rescans them: while they are made (the collections their allocation triggers) and, once
they live, in every full collection after (the report's, the record sink's). `paused()`
keeps it off while a stage allocates; `frozen()` with `freeze()` takes what is alive
at that moment out of its scans until the outermost `frozen()` ends (objects still die
by reference counting as usual).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["freeze", "frozen", "paused"]

_depth = 0  # open `frozen()` scopes
_froze = False  # whether `freeze()` ran in them


@contextlib.contextmanager
def paused(*, then_freeze: bool = False) -> Iterator[None]:
    """No automatic collections inside; the collector's state before is put back after.

    `then_freeze`: what is alive at the end is frozen (`freeze()`) before the collector
    is back on. Frozen after, the first collection would already have scanned it: every
    object made while paused waits in the youngest generation, and the first allocation
    after `gc.enable()` collects that generation (0.2 s after loading 78,280 requests)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        if then_freeze:
            freeze()
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def frozen(*, now: bool = False) -> Iterator[None]:
    """A scope for `freeze()` (called on entry with `now`); nested scopes (the cluster
    driver inside a run) keep what was frozen out of collections until the outermost one
    ends."""
    global _depth, _froze
    _depth += 1
    try:
        if now:
            freeze()
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _froze:
            _froze = False
            gc.unfreeze()


def freeze() -> None:
    """Leave every object alive now out of later collections, inside `frozen()` (outside
    one it does nothing: nothing would ever thaw them)."""
    global _froze
    if _depth:
        gc.freeze()
        _froze = True
