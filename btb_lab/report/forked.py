"""One piece of the report drawn in a forked child while the parent draws the rest.

Drawing the figures is most of a simulated run's report time (matplotlib, one core), and
the timelines are independent of the CDFs and utilization bars, so on a machine with two
or more cores the timelines render in a child (forked once the data and matplotlib are
in memory, so it starts in milliseconds) beside the parent. The files are the same bytes
either way (`write_atomic`, no timestamps); a child that fails, or a process where a fork
is unsafe (other threads running) or pointless (one core), leaves the work to the parent,
which then raises any error itself. `BTB_LAB_REPORT_FORK=0` turns the fork off, and so
does `inline()` for what runs inside it (a sweep's points: they already share the cores,
and a point's process keeps matplotlib from its last point, where a child would import it
again for every point).

A run goes one step further (`prewarmed`): it forks a `Warm` child before it loads and
simulates, which imports matplotlib on the second core meanwhile (about as long as the
drawing itself), and the report then hands the plots to that child before it computes
the statistics, so the drawing and the analysis run side by side.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
from collections.abc import Callable, Iterator
from typing import Any

from btb_lab.forks import die_with_parent, fork_safe

__all__ = [
    "ENV", "Forked", "Warm", "fork_allowed", "inline", "prewarmed", "start", "take_warm", "warm",
]  # fmt: skip

ENV = "BTB_LAB_REPORT_FORK"

_inline_depth = 0


@contextlib.contextmanager
def inline() -> Iterator[None]:
    """No report child inside the block: the plots are drawn in this process."""
    global _inline_depth
    _inline_depth += 1
    try:
        yield
    finally:
        _inline_depth -= 1


def fork_allowed() -> bool:
    """A fork is safe with this process's single thread, and pays with a second core."""
    if os.environ.get(ENV, "1") == "0" or _inline_depth or not fork_safe():
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (cores or 1) >= 2


class Forked:
    """A running child; `result()` waits for it: its JSON answer, or None when it failed."""

    def __init__(self, pid: int, read_fd: int) -> None:
        self.pid = pid
        self._read_fd = read_fd
        self._reaped = False

    def result(self) -> Any:
        try:
            with os.fdopen(self._read_fd, "rb") as pipe:
                payload = pipe.read()
            _, status = os.waitpid(self.pid, 0)
            self._reaped = True
        finally:
            self.close()
        if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0) or not payload:
            return None
        return json.loads(payload)

    def close(self) -> bool:
        """Stop and reap the child (a Ctrl-C in the parent must not leave it behind); True
        when it was stopped before it answered, maybe in the middle of a file."""
        if self._reaped:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        self._reaped = True
        return True


def _fork(
    body: Callable[[], None], parent_ends: tuple[int, ...], child_ends: tuple[int, ...],
    sigint: Any,
) -> int | None:  # fmt: skip
    """Fork: the child closes the parent's pipe ends, runs `body` and exits (0 when it
    returned) without the parent's exit handlers or buffered output, or dies with the
    parent; the parent closes the child's ends and gets the pid. None, every end closed,
    when the fork fails."""
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        for fd in parent_ends + child_ends:
            os.close(fd)
        return None
    if pid == 0:  # the child
        code = 1
        try:
            die_with_parent(parent)
            for fd in parent_ends:
                os.close(fd)
            signal.signal(signal.SIGINT, sigint)
            body()
            code = 0
        finally:
            os._exit(code)
    for fd in child_ends:
        os.close(fd)
    return pid


def _send(fd: int, payload: bytes) -> None:
    with os.fdopen(fd, "wb") as pipe:
        pipe.write(payload)


def start(work: Callable[[], Any]) -> Forked | None:
    """Run `work` in a forked child, which sends its JSON-able result back; None when no
    fork is made. Ctrl-C stops the child (the parent then draws or stops itself)."""
    if not fork_allowed():
        return None
    read_fd, write_fd = os.pipe()
    pid = _fork(lambda: _send(write_fd, json.dumps(work()).encode()), (read_fd,), (write_fd,),
                signal.SIG_DFL)  # fmt: skip
    return None if pid is None else Forked(pid, read_fd)


class Warm:
    """A child forked ahead of its one call, which it has prepared for (imports) meanwhile;
    `send` gives it the function and arguments (pickled: a pipe between this process and
    its own fork), `result` waits for the JSON answer, None when the child failed; `call`
    is the two in one."""

    def __init__(self, pid: int, command_fd: int, answer_fd: int) -> None:
        self._command_fd = command_fd
        self._child = Forked(pid, answer_fd)
        self._sent = False

    def send(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """Start the call; False when it could not be sent (the child is then stopped)."""
        try:
            payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
            with os.fdopen(self._command_fd, "wb") as pipe:
                self._command_fd = -1
                pipe.write(payload)
        except (OSError, pickle.PicklingError, AttributeError):  # the child died; a lambda
            self.close()
            return False
        self._sent = True
        return True

    def result(self) -> Any:
        return self._child.result() if self._sent else None

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.result() if self.send(fn, *args, **kwargs) else None

    def close(self) -> bool:
        """Stop the child; True when it was stopped before it answered (`Forked.close`)."""
        if self._command_fd >= 0:  # never called: the child reads an empty command and exits
            with contextlib.suppress(OSError):
                os.close(self._command_fd)
            self._command_fd = -1
        return self._child.close()


def warm(prepare: Callable[[], object]) -> Warm | None:
    """Fork a child that runs `prepare` now and one `Warm.call` later; None when no fork is
    made. The child ignores Ctrl-C (the parent decides what an interrupted run still
    draws) and exits when the parent closes the command pipe or dies."""
    if not fork_allowed():
        return None
    command_r, command_w = os.pipe()
    answer_r, answer_w = os.pipe()

    def serve() -> None:
        prepare()
        with os.fdopen(command_r, "rb") as pipe:
            command = pipe.read()
        if command:  # empty: the parent closed the pipe without a call
            fn, args, kwargs = pickle.loads(command)
            _send(answer_w, json.dumps(fn(*args, **kwargs)).encode())

    pid = _fork(serve, (command_w, answer_r), (command_r, answer_w), signal.SIG_IGN)
    return None if pid is None else Warm(pid, command_w, answer_r)


_warm: Warm | None = None


@contextlib.contextmanager
def prewarmed(prepare: Callable[[], object]) -> Iterator[Warm | None]:
    """A `Warm` child for the duration of the block, for `take_warm` to hand out once; it
    is stopped when the block ends, used or not."""
    global _warm
    worker = warm(prepare)
    _warm = worker
    try:
        yield worker
    finally:
        _warm = None
        if worker is not None:
            worker.close()


def take_warm() -> Warm | None:
    """The prepared child, once (a second report in the same block draws in-process)."""
    global _warm
    worker, _warm = _warm, None
    return worker
