"""What every forked child of a run shares: the variants' workers (`workers`) and the
report's drawing children (`report.forked`) fork only from a process whose one thread
holds every lock it may need, and each child dies with the process that forked it."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

__all__ = ["die_with_parent", "fork_safe"]

_PR_SET_PDEATHSIG = 1


def fork_safe() -> bool:
    """A fork is safe from this process's single thread (a lock another thread held
    would stay held in the child)."""
    return hasattr(os, "fork") and threading.active_count() == 1


def die_with_parent(parent: int) -> None:
    """Linux: this child is killed when `parent` dies, so a killed run, or a drawing child
    stopped mid-figure, leaves no process of its own behind writing into its directory."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)
