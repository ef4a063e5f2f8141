"""A repeat's variants side by side, each in a forked worker process.

The simulator's runs of one repeat share nothing but their requests, which they only
read: each builds its own engine, policy and record sink and writes its own part files,
so on a machine with several cores they run in forked children, at most `jobs` at a
time, and give the same records as one after another. The parent keeps the manifest
(one writer): it adds each run's entry as its worker starts, shows the progress the
workers send, and takes each worker's entry back when it ends.

Stopping: Ctrl-C reaches every worker (one process group) and a signal to the parent
alone is forwarded; each worker stops as a run in the parent would (records so far kept,
its entry "interrupted") and answers, later signals ignored while it does; the parent
raises once every worker has answered. A worker that dies without answering (killed,
out of memory) leaves its records on disk and its entry "failed".
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from btb_lab.errors import UserError
from btb_lab.interrupts import Terminated

__all__ = ["Task", "WorkerProgress", "can_fork", "cores", "run_tasks"]

_PROGRESS_EVERY_S = 0.1


def can_fork() -> bool:
    """A fork is safe from this process's single thread (a lock another thread held
    would stay held in the child)."""
    return hasattr(os, "fork") and threading.active_count() == 1


def cores() -> int:
    """How many workers `--jobs 0` means: the cores this process may run on, on Linux;
    elsewhere one (a fork after some system libraries started threads of their own, as
    macOS's may, is not safe, so there it takes an explicit `--jobs`)."""
    if not sys.platform.startswith("linux"):
        return 1
    return len(os.sched_getaffinity(0)) or 1


@dataclass
class Task:
    """One run for a worker: `start()` (in the parent, as the worker is forked) returns the
    parent's progress callback; `work(progress)` runs in the worker and returns its
    JSON-able answer; `done(answer)` takes it back in the parent (None: the worker died,
    with `died` saying how)."""

    start: Callable[[], Callable[[int, int], None]]
    work: Callable[[WorkerProgress], Any]
    done: Callable[[Any, str], None]


@dataclass
class _Running:
    order: int
    task: Task
    pid: int
    fd: int
    progress: Callable[[int, int], None]
    buffer: bytes = b""
    answer: Any = None
    answered: bool = False
    raised: dict[str, Any] | None = None


class WorkerProgress:
    """What a worker's run reports progress to: `task(label, total)` gives a callback that
    sends (done, total) to the parent, a few times a second."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._last = 0.0

    def task(self, label: str, total: int) -> Callable[[int, int], None]:
        def update(done: int, total_now: int) -> None:
            now = time.monotonic()
            if done < total_now and now - self._last < _PROGRESS_EVERY_S:
                return
            self._last = now
            _send(self._fd, b"p " + f"{done} {total_now}".encode())

        return update


def _send(fd: int, line: bytes) -> None:
    view = memoryview(line + b"\n")
    while view:
        view = view[os.write(fd, view) :]


def _die_with_parent(parent: int) -> None:
    """Linux: this worker is killed when the parent dies (SIGKILL of the run kills its
    workers too, as it would a run in one process, instead of leaving them running)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


_PR_SET_PDEATHSIG = 1


def _worker(task: Task, fd: int, parent: int) -> None:
    """The worker's body: its first Ctrl-C or SIGTERM stops the run (as in the parent);
    later ones are ignored while it answers."""
    _die_with_parent(parent)

    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated(signum) if signum == signal.SIGTERM else KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    raised: dict[str, Any] | None = None
    answer: Any = None
    try:
        answer = task.work(WorkerProgress(fd))
    except BaseException as exc:  # every way out is sent to the parent
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        answer = getattr(exc, "answer", None)
        raised = _describe(exc)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    _send(fd, b"r " + json.dumps({"answer": answer, "raised": raised}).encode())


def _describe(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, KeyboardInterrupt):
        return {"kind": "interrupt", "signum": getattr(exc, "signum", int(signal.SIGINT))}
    if isinstance(exc, UserError):
        return {"kind": "user", "message": str(exc), "exit_code": exc.exit_code}
    if isinstance(exc, OSError):
        return {"kind": "os", "errno": exc.errno, "message": exc.strerror or str(exc),
                "filename": None if exc.filename is None else str(exc.filename)}  # fmt: skip
    return {"kind": "error", "message": f"{type(exc).__name__}: {exc}"}


def _rebuild(raised: dict[str, Any]) -> BaseException:
    """The worker's exception, raised again in the parent."""
    kind = raised["kind"]
    if kind == "interrupt":
        signum = raised["signum"]
        return Terminated(signum) if signum == signal.SIGTERM else KeyboardInterrupt()
    if kind == "user":
        error = UserError(raised["message"])
        error.exit_code = raised["exit_code"]
        return error
    if kind == "os":
        return OSError(raised["errno"], raised["message"], raised["filename"])
    return RuntimeError(raised["message"])


def run_tasks(tasks: list[Task], jobs: int) -> None:
    """Run `tasks` in forked workers, at most `jobs` at a time, started in order; raise
    what the first of them (in order) raised, once every started worker has answered. A
    Ctrl-C or SIGTERM in the parent starts no further task and stops the running ones."""
    selector = selectors.DefaultSelector()
    pending = list(tasks)
    running: dict[int, _Running] = {}
    finished: list[_Running] = []
    stopped: KeyboardInterrupt | None = None
    try:
        while pending or running:
            try:
                while pending and len(running) < jobs and stopped is None:
                    worker = _start(len(tasks) - len(pending), pending.pop(0))
                    running[worker.fd] = worker
                    selector.register(worker.fd, selectors.EVENT_READ)
                if not running:
                    break
                for key, _ in selector.select():
                    worker = running[key.fd]
                    if not _read(worker):
                        selector.unregister(key.fd)
                        del running[key.fd]
                        _reap(worker)
                        finished.append(worker)
            except KeyboardInterrupt as exc:
                if stopped is not None:  # a second stop: the workers are not waited for
                    for worker in running.values():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(worker.pid, signal.SIGKILL)
                    raise
                stopped = exc
                pending.clear()
                signum = int(getattr(exc, "signum", signal.SIGINT))
                for worker in running.values():  # Ctrl-C reached them already: ignored
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(worker.pid, signum)
    finally:
        for worker in running.values():  # only after a second stop or a parent's error
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.close(worker.fd)
            _reap(worker)
            finished.append(worker)
        selector.close()
        finished.sort(key=lambda w: w.order)
        for worker in finished:
            died = "" if worker.answered else "its worker process died before it answered"
            worker.task.done(worker.answer if worker.answered else None, died)
    if stopped is not None:
        raise stopped
    for worker in finished:
        if worker.raised is not None:
            raise _rebuild(worker.raised)


def _start(order: int, task: Task) -> _Running:
    progress = task.start()
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        raise
    if pid == 0:  # the worker: it never returns into the parent's code
        code = 1
        try:
            os.close(read_fd)
            _worker(task, write_fd, parent)
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    return _Running(order=order, task=task, pid=pid, fd=read_fd, progress=progress)


def _read(worker: _Running) -> bool:
    """Handle what the worker sent; False at its end (EOF)."""
    data = os.read(worker.fd, 1 << 16)
    if not data:
        os.close(worker.fd)
        return False
    worker.buffer += data
    *lines, worker.buffer = worker.buffer.split(b"\n")
    for line in lines:
        kind, _, body = line.partition(b" ")
        if kind == b"p":
            done, total = map(int, body.split())
            worker.progress(done, total)
        elif kind == b"r":
            message = json.loads(body)
            worker.answer, worker.raised = message["answer"], message["raised"]
            worker.answered = True
    return True


def _reap(worker: _Running) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(worker.pid, 0)
