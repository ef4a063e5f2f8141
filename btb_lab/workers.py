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
raises once every worker has answered (a second stop does not wait: the parent kills
the workers still running, their entries "interrupted"). A worker that dies without
answering (killed, out of memory) leaves its records on disk and its entry "failed".
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from btb_lab.errors import UserError
from btb_lab.forks import die_with_parent
from btb_lab.interrupts import Terminated

__all__ = ["Task", "WorkerProgress", "cores", "run_tasks"]

_PROGRESS_EVERY_S = 0.1


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
    with `died` saying how, or, `died` empty, it answered without one: stopped before
    its work gave one)."""

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


_STOPS = (signal.SIGINT, signal.SIGTERM)


def _ignore_stops() -> None:
    for sig in _STOPS:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def _noted_stops() -> Iterator[list[int]]:
    """While the parent runs workers, Ctrl-C and SIGTERM are noted (the list yielded)
    instead of raised, so a stop never lands between a fork and the worker's
    registration, nor in the middle of an answer being read or the manifest saved; the
    handlers before are put back after (a Ctrl-C that the process ignores stays ignored).
    A signal mask would not do: a process-wide signal goes to any thread that does not
    block it (pyarrow's among them), and Python then runs the handler in this one."""
    received: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in _STOPS}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _worker(task: Task, fd: int, parent: int, received: list[int]) -> None:
    """The worker's body: its first Ctrl-C or SIGTERM stops the run, as in the parent
    (one noted before its handlers were in place included); later ones are ignored while
    it answers. A worker of a run that ignores Ctrl-C (started in the background) ignores
    it too."""
    die_with_parent(parent)

    def stop(signum: int, frame: object) -> None:
        _ignore_stops()
        raise Terminated(signum) if signum == signal.SIGTERM else KeyboardInterrupt

    raised: dict[str, Any] | None = None
    answer: Any = None
    try:
        # inside the `try`: a stop that lands as the handlers change is answered too
        for sig in _STOPS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, stop)
        if received:  # noted by the handler this process was forked with
            stop(received[0], None)
        answer = task.work(WorkerProgress(fd))
        _ignore_stops()  # the run is over: a stop from here on cannot lose its answer
    except BaseException as exc:  # every way out is sent to the parent
        _ignore_stops()
        # a stop after the work returned keeps the answer (the run ended as it says)
        answer = getattr(exc, "answer", answer)
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
    Ctrl-C or SIGTERM in the parent starts no further task and stops the running ones.

    The stop is raised as the process's own handler raises it (`_noted_stops`), once
    every worker has answered; a second stop does not wait for them."""
    selector = selectors.DefaultSelector()
    pending = list(tasks)
    running: dict[int, _Running] = {}
    finished: list[_Running] = []
    stop: int | None = None
    with _noted_stops() as received:
        try:
            while pending or running:
                while pending and len(running) < jobs and stop is None:
                    siblings = [*running, selector.fileno()]
                    worker = _start(len(tasks) - len(pending), pending.pop(0), received,
                                    siblings)  # fmt: skip
                    running[worker.fd] = worker
                    selector.register(worker.fd, selectors.EVENT_READ)
                if not running:
                    break
                ready = selector.select(timeout=_PROGRESS_EVERY_S)
                if received and stop is None:  # forwarded: a Ctrl-C reached them already
                    stop = received[0]
                    pending.clear()
                    for worker in running.values():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(worker.pid, stop)
                elif len(received) > 1:  # a second stop: the workers are not waited for
                    break
                for key, _ in ready:
                    worker = running[key.fd]
                    if not _read(worker):
                        # out of the epoll set before the close: epoll watches the open
                        # pipe, not this fd, and while any copy of its read end were
                        # open (a worker forked before `_start` closed them) its hang-up
                        # would be reported to every select, a busy loop on a core
                        selector.unregister(key.fd)
                        os.close(key.fd)
                        del running[key.fd]
                        _reap(worker)
                        finished.append(worker)
        finally:
            killed = set()
            for worker in running.values():  # after a second stop or an error here only
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGKILL)
                with contextlib.suppress(OSError):
                    os.close(worker.fd)
                _reap(worker)
                finished.append(worker)
                killed.add(worker.order)
            selector.close()
            finished.sort(key=lambda w: w.order)
            for worker in finished:
                if worker.answered or (worker.order in killed and received):
                    died = ""  # answered, or stopped here by a second stop: interrupted
                else:
                    died = "its worker process died before it answered"
                worker.task.done(worker.answer if worker.answered else None, died)
    if stop is not None:  # the process's own handler, back in place, raises it (or dies)
        signal.raise_signal(stop)
    for worker in finished:
        if worker.raised is not None:
            raise _rebuild(worker.raised)


def _start(order: int, task: Task, received: list[int], parents_fds: list[int]) -> _Running:
    """Fork the worker of `task`; it closes `parents_fds` (the parent's epoll set and the
    read ends of the workers already running), which are none of its business."""
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
            for fd in (read_fd, *parents_fds):
                os.close(fd)
            _worker(task, write_fd, parent, received)
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    return _Running(order=order, task=task, pid=pid, fd=read_fd, progress=progress)


def _read(worker: _Running) -> bool:
    """Handle what the worker sent; False at its end (EOF; the caller closes the fd)."""
    data = os.read(worker.fd, 1 << 16)
    if not data:
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
