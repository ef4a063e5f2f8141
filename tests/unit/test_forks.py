"""Forked children of a run: they die with the process that forked them, and a drawing
child stopped mid-figure leaves no half-written file behind."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from btb_lab.forks import fork_safe
from btb_lab.report import forked
from btb_lab.report.png import stop_drawing


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_a_drawing_child_dies_with_the_process_that_forked_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run killed while its drawing child draws (or a drawing child killed while its own
    child draws the timeline's zoom) leaves no process behind writing into the run."""
    if not sys.platform.startswith("linux") or not fork_safe():
        pytest.skip("needs Linux's parent-death signal and a fork-safe process")
    monkeypatch.setattr(forked, "fork_allowed", lambda: True)
    read_fd, write_fd = os.pipe()
    middle = os.fork()
    if middle == 0:  # the run: forks its drawing child, says which, then waits to be killed
        try:
            os.close(read_fd)
            child = forked.start(lambda: time.sleep(60))
            os.write(write_fd, str(child.pid if child else 0).encode())
            os.close(write_fd)
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(write_fd)
    pid = int(os.read(read_fd, 64) or b"0")  # not to the end: the drawing child holds it open
    os.close(read_fd)
    try:
        assert pid
        assert _alive(pid)
        os.kill(middle, signal.SIGKILL)
        os.waitpid(middle, 0)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _half_written(plots_dir: str) -> None:
    """A figure in the middle of `write_atomic`: its temporary file is there, not yet
    renamed into place."""
    (Path(plots_dir) / "timeline.png.tmp").write_bytes(b"\x89PNG half")
    time.sleep(60)


def test_a_drawing_child_stopped_mid_figure_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not fork_safe():
        pytest.skip("this process cannot fork")
    monkeypatch.setattr(forked, "fork_allowed", lambda: True)
    plots_dir = tmp_path / "plots"
    plots_dir.mkdir()
    (plots_dir / "ttft.png").write_bytes(b"\x89PNG whole")  # drawn before the stop
    worker = forked.warm(lambda: None)
    assert worker is not None
    assert worker.send(_half_written, str(plots_dir))
    deadline = time.monotonic() + 10
    while not (plots_dir / "timeline.png.tmp").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (plots_dir / "timeline.png.tmp").exists()
    stop_drawing(worker, plots_dir)  # the run failed or was stopped meanwhile
    assert sorted(p.name for p in plots_dir.iterdir()) == ["ttft.png"]


def test_closing_a_drawing_child_says_whether_it_stopped_one_at_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not fork_safe():
        pytest.skip("this process cannot fork")
    monkeypatch.setattr(forked, "fork_allowed", lambda: True)
    answered = forked.warm(lambda: None)
    assert answered is not None
    assert answered.call(sorted, [3, 1, 2]) == [1, 2, 3]
    assert answered.close() is False  # it had answered: nothing of its was cut short
    working = forked.warm(lambda: None)
    assert working is not None
    assert working.send(time.sleep, 60)
    assert working.close() is True
