"""A watchdog beside a server started by a Ray actor: when the actor's process is gone —
killed by `ray.kill`, by its owner's death or its node's raylet dying, none of which lets
it clean up — the reaper stops the server's process group and every descendant it saw,
TERM then KILL. It runs in its own session (nothing that signals the actor's group
reaches it) and exits as soon as the server's tree is gone.

    python -m btb_lab.cluster.reaper PARENT_PID SERVER_PGID GRACE_S
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

__all__ = ["main", "reaper_command"]

POLL_S = 0.2


def reaper_command(parent_pid: int, server_pgid: int, grace_s: float) -> list[str]:
    """The argument list that starts a reaper for `server_pgid` guarding `parent_pid`."""
    return [sys.executable, "-m", "btb_lab.cluster.reaper", str(parent_pid),
            str(server_pgid), f"{grace_s:g}"]  # fmt: skip


def _alive(proc: object) -> bool:
    import psutil

    assert isinstance(proc, psutil.Process)
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main(argv: list[str] | None = None) -> int:
    import psutil

    args = sys.argv[1:] if argv is None else argv
    parent_pid, pgid, grace_s = int(args[0]), int(args[1]), float(args[2])
    try:
        parent = psutil.Process(parent_pid)
    except psutil.Error:
        parent = None
    known: dict[int, psutil.Process] = {}  # is_running() compares create times: no reused pid
    while True:
        with contextlib.suppress(psutil.Error):
            leader = psutil.Process(pgid)
            for proc in [leader, *leader.children(recursive=True)]:
                known.setdefault(proc.pid, proc)
        alive = [p for p in known.values() if _alive(p)]
        if not alive:
            return 0  # the server stopped normally (or was never there)
        if parent is None or not _alive(parent):
            break
        time.sleep(POLL_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(alive, timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
