"""A repeat's variants in forked workers (`btb_lab.workers`, `btb-lab run --jobs`): the
same records, manifest and report as one after another, progress and answers back to the
parent, and a worker that fails or dies recorded as such."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import selectors
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from btb_lab import runner, workers
from btb_lab.errors import UserError
from btb_lab.forks import fork_safe
from btb_lab.records import Request
from btb_lab.report import forked
from tests.helpers import cli, write_small


def _children() -> set[int]:
    """This process's child processes (alive or not yet reaped)."""
    found: set[int] = set()
    for task in Path("/proc/self/task").glob("*"):
        with contextlib.suppress(OSError):
            found |= {int(pid) for pid in (task / "children").read_text().split()}
    return found


@pytest.fixture(autouse=True)
def no_worker_left() -> Any:
    """Every worker a test starts is reaped by the time it ends (other tests' children,
    alive across tests, are left alone)."""
    if not Path("/proc/self/task").is_dir():
        yield
        return
    before = _children()
    yield
    assert _children() <= before


def _task(work: Any, log: list[Any]) -> workers.Task:
    def start() -> Any:
        log.append(("start", os.getpid()))
        return lambda done, total: log.append(("progress", done, total))

    return workers.Task(start=start, work=work,
                        done=lambda answer, died: log.append(("done", answer, died)))  # fmt: skip


def test_workers_answer_in_task_order_with_their_progress() -> None:
    log: list[Any] = []

    def work(n: int) -> Any:
        def run(progress: workers.WorkerProgress) -> Any:
            update = progress.task("x", 10)
            update(10, 10)  # the last update is always sent
            return {"n": n, "pid": os.getpid()}

        return run

    workers.run_tasks([_task(work(n), log) for n in range(3)], jobs=2)
    done = [entry for entry in log if entry[0] == "done"]
    assert [answer["n"] for _, answer, _ in done] == [0, 1, 2]
    assert all(died == "" for _, _, died in done)
    assert len({answer["pid"] for _, answer, _ in done} | {os.getpid()}) == 4  # own processes
    assert log.count(("progress", 10, 10)) == 3


def test_the_first_failing_task_in_order_is_raised_after_every_answer() -> None:
    log: list[Any] = []

    def ok(progress: workers.WorkerProgress) -> Any:
        return "fine"

    def mistake(progress: workers.WorkerProgress) -> Any:
        raise UserError("variant b: bad parameter")

    def disk(progress: workers.WorkerProgress) -> Any:
        raise OSError(28, "No space left on device", "/x/parts")

    with pytest.raises(UserError, match="variant b: bad parameter") as info:
        workers.run_tasks([_task(ok, log), _task(mistake, log), _task(disk, log)], jobs=3)
    assert info.value.exit_code == 2
    assert [entry[1] for entry in log if entry[0] == "done"] == ["fine", None, None]
    with pytest.raises(OSError, match="No space") as raised:
        workers.run_tasks([_task(disk, [])], jobs=1)
    assert raised.value.errno == 28


def test_a_worker_that_dies_is_reported_and_the_others_finish() -> None:
    log: list[Any] = []

    def killed(progress: workers.WorkerProgress) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    def ok(progress: workers.WorkerProgress) -> Any:
        return "fine"

    workers.run_tasks([_task(killed, log), _task(ok, log)], jobs=2)
    done = [entry for entry in log if entry[0] == "done"]
    assert done[0] == ("done", None, "its worker process died before it answered")
    assert done[1] == ("done", "fine", "")


def test_the_parent_waits_for_a_slower_worker_without_spinning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the first worker ends, the parent's select must block, not wake for that
    pipe's hang-up again and again while the second runs (a busy loop on a core the
    workers need; it spun while the second worker held a copy of the first one's pipe)."""
    selects: list[float | None] = []

    class Counting(selectors.DefaultSelector):
        def select(self, timeout: float | None = None) -> Any:
            selects.append(timeout)
            return super().select(timeout)

    monkeypatch.setattr(workers.selectors, "DefaultSelector", Counting)

    def quick(progress: workers.WorkerProgress) -> Any:
        return "quick"

    def slow(progress: workers.WorkerProgress) -> Any:
        time.sleep(0.6)
        return "slow"

    log: list[Any] = []
    workers.run_tasks([_task(quick, log), _task(slow, log)], jobs=2)
    assert [entry[1] for entry in log if entry[0] == "done"] == ["quick", "slow"]
    # about one select per 0.1 s waited plus one per message; spinning made thousands
    assert len(selects) < 50


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_a_stop_sent_to_the_parent_alone_stops_every_worker(sig: signal.Signals) -> None:
    """A `kill` of the run's process (not its group): the parent forwards the stop, each
    worker stops as a run would and answers, and the parent raises it once all have."""
    from btb_lab.interrupts import Terminated, terminate_interrupts

    log: list[Any] = []

    def first(progress: workers.WorkerProgress) -> Any:
        os.kill(os.getppid(), sig)
        return _forever()

    def second(progress: workers.WorkerProgress) -> Any:
        return _forever()

    expected = Terminated if sig == signal.SIGTERM else KeyboardInterrupt
    with terminate_interrupts(), pytest.raises(expected):
        workers.run_tasks([_task(first, log), _task(second, log)], jobs=2)
    assert [entry for entry in log if entry[0] == "done"] == [("done", None, "")] * 2


def _stop_as_handlers_go_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a worker, call its stop handler the moment it is installed: as if a Ctrl-C to
    the whole group arrived right after `signal.signal`."""
    real, parent = signal.signal, os.getpid()

    def landing(sig: int, handler: Any) -> Any:
        previous = real(sig, handler)
        if os.getpid() != parent and getattr(handler, "__name__", "") == "stop":
            handler(sig, None)
        return previous

    monkeypatch.setattr(signal, "signal", landing)


def test_a_stop_as_a_workers_handlers_go_in_is_answered_not_a_death(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C to the whole group lands in a worker the moment its own handler is in
    place, before its work starts: the worker answers that it was interrupted (its run
    "interrupted"), it is not a worker that died without a word (a "failed" run)."""
    _stop_as_handlers_go_in(monkeypatch)
    log: list[Any] = []
    with pytest.raises(KeyboardInterrupt):
        workers.run_tasks([_task(lambda progress: "fine", log)], jobs=1)
    assert [entry for entry in log if entry[0] == "done"] == [("done", None, "")]


def test_a_stop_after_the_work_returned_keeps_its_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop lands in the worker after its run ended: the run's answer still reaches
    the parent (its entry "ok"), and the parent raises the stop."""
    real, parent = workers._ignore_stops, os.getpid()
    calls = [0]

    def landing() -> None:
        calls[0] += 1
        real()
        if os.getpid() != parent and calls[0] == 1:
            raise KeyboardInterrupt  # right after the work returned

    monkeypatch.setattr(workers, "_ignore_stops", landing)
    log: list[Any] = []
    with pytest.raises(KeyboardInterrupt):
        workers.run_tasks([_task(lambda progress: "fine", log)], jobs=1)
    assert [entry for entry in log if entry[0] == "done"] == [("done", "fine", "")]


def test_a_worker_a_second_stop_does_not_wait_for_is_interrupted_not_dead() -> None:
    """Two stops (Ctrl-C twice; `timeout` delivers its signal twice, to the process and
    to its group): the parent stops waiting and kills the worker that has not answered.
    That run was stopped, not lost to a crash: it is answered as interrupted."""
    log: list[Any] = []

    def deaf(progress: workers.WorkerProgress) -> Any:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        os.kill(os.getppid(), signal.SIGINT)
        time.sleep(0.3)
        os.kill(os.getppid(), signal.SIGINT)
        return _forever()

    with pytest.raises(KeyboardInterrupt):
        workers.run_tasks([_task(deaf, log)], jobs=1)
    assert [entry for entry in log if entry[0] == "done"] == [("done", None, "")]


def _forever() -> Any:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.01)
    raise AssertionError("never stopped")


def _frames(run_dir: Path) -> dict[str, pd.DataFrame]:
    return {name: pd.read_parquet(run_dir / f"{name}.parquet")
            for name in ("requests", "events", "utilization")}  # fmt: skip


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    run_tasks = workers.run_tasks

    def counted(tasks: list[workers.Task], jobs: int) -> None:
        calls.append(jobs)
        run_tasks(tasks, jobs)

    monkeypatch.setattr(workers, "run_tasks", counted)
    return calls


def test_variants_in_workers_give_the_run_of_one_after_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two repeats of two variants, with the progress display on (redrawn without a
    thread, so the process may fork): the records, events, utilization, plots, summary
    and the manifest's runs are those of `--jobs 1`."""
    if not fork_safe():
        pytest.skip("this process cannot fork workers")
    # both runs draw their plots in this process: whether a run may fork its drawing
    # child depends on the threads alive at that moment (`--jobs 1` redraws its progress
    # on one), and a child forked from this test process can render text unlike it
    monkeypatch.setenv(forked.ENV, "0")
    calls = _counting(monkeypatch)
    path = write_small(tmp_path, **{"repeats: 1": "repeats: 2"})
    one = cli("run", path, "--out", tmp_path / "one", "--jobs", "1")
    assert one.code == 0, one.output
    assert calls == []
    two = cli("run", path, "--out", tmp_path / "two", "--jobs", "2")
    assert two.code == 0, two.output
    assert calls == [2, 2]  # each repeat's two variants at once
    for name, frame in _frames(tmp_path / "one").items():
        pd.testing.assert_frame_equal(frame, _frames(tmp_path / "two")[name], obj=name)
    plots = sorted(p.name for p in (tmp_path / "one" / "plots").glob("*.png"))
    assert plots
    for name in plots:
        assert (tmp_path / "one" / "plots" / name).read_bytes() == (
            tmp_path / "two" / "plots" / name
        ).read_bytes(), name
    stored = [json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("one", "two")]
    keep = ("variant", "repeat", "seed", "workload_seed", "requests", "status", "records",
            "extra")  # fmt: skip
    runs = [[{k: r[k] for k in keep} for r in m["runs"]] for m in stored]
    assert runs[0] == runs[1]
    assert [(r["variant"], r["repeat"]) for r in stored[1]["runs"]] == [
        ("base", 0),
        ("fast", 0),
        ("base", 1),
        ("fast", 1),
    ]
    assert stored[0]["fidelity"] == stored[1]["fidelity"]
    assert stored[1]["complete"] is True
    assert stored[1]["cli"]["options"]["jobs"] == 2
    summaries = [json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two")]
    assert summaries[0]["variants"] == summaries[1]["variants"]
    assert summaries[0]["verdict"] == summaries[1]["verdict"]


def _pipes_and_epolls() -> tuple[int, int]:
    """How many pipes and epoll sets this process has open."""
    kinds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
             if os.path.exists(f"/proc/self/fd/{fd}")]  # fmt: skip
    return sum(k.startswith("pipe:") for k in kinds), sum("eventpoll" in k for k in kinds)


def test_a_worker_holds_none_of_the_parents_pipes_and_epoll_set() -> None:
    """A worker forked while another runs does not keep that one's pipe open (nor the
    parent's epoll set): it has the pipes the first worker has, no more."""
    if not fork_safe() or not Path("/proc/self/fd").is_dir():
        pytest.skip("needs fork and /proc")

    def first(progress: workers.WorkerProgress) -> Any:
        time.sleep(0.5)  # still running when the second is forked
        return _pipes_and_epolls()

    def second(progress: workers.WorkerProgress) -> Any:
        return _pipes_and_epolls()

    log: list[Any] = []
    workers.run_tasks([_task(first, log), _task(second, log)], jobs=2)
    answers = [entry[1] for entry in log if entry[0] == "done"]
    assert answers[1] == answers[0], answers
    assert answers[0][1] == 0, answers


def _faults_reading_ids(requests: list[Request], own_pages_first: bool) -> int:
    """Minor page faults a forked worker takes reading every request's block ids, after
    `runner._own_pages` or without it."""
    log: list[Any] = []

    def work(progress: workers.WorkerProgress) -> int:
        if own_pages_first:
            runner._own_pages(requests)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        held = [request.block_hashes for request in requests]
        taken = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        del held
        return taken

    workers.run_tasks([_task(work, log)], 1)
    answers = [entry[1] for entry in log if entry[0] == "done"]
    assert len(answers) == 1, log
    assert isinstance(answers[0], int), log
    return answers[0]


def test_a_worker_takes_its_copies_of_the_requests_pages_before_its_run() -> None:
    """A worker's run writes reference counts on requests the parent loaded, each write
    to a page still shared with the parent a copy-on-write fault in the middle of the
    event loop; `_own_pages` takes them all first, in one loop (benchmarks/README.md)."""
    if not fork_safe() or not sys.platform.startswith("linux"):
        pytest.skip("needs fork and Linux's per-process fault counts")
    ids = tuple(range(10**6, 10**6 + 300))  # ~2.4 KB a tuple: about a page each
    requests = [Request(request_id=f"r{i}", arrival_s=float(i), input_tokens=300 * 16,
                        output_tokens=1, block_hashes=(*ids[:299], i), block_tokens=16)
                for i in range(4000)]  # fmt: skip
    without = _faults_reading_ids(requests, own_pages_first=False)
    if without < len(requests) // 4:
        pytest.skip(f"{without} faults for {len(requests)} requests: this kernel does not "
                    "copy shared pages one at a time")  # fmt: skip
    after = _faults_reading_ids(requests, own_pages_first=True)
    assert after <= without // 20, (without, after)


def test_a_variant_whose_worker_dies_is_a_failed_run_and_the_others_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not fork_safe():
        pytest.skip("this process cannot fork workers")
    from btb_lab.sim.backend import SimBackend

    run_variant = SimBackend.run_variant

    def dies_on_fast(self: SimBackend, ctx: Any, requests: Any) -> Any:
        if ctx.variant_name == "fast":
            os.kill(os.getpid(), signal.SIGKILL)  # out of memory, say
        return run_variant(self, ctx, requests)

    monkeypatch.setattr(SimBackend, "run_variant", dies_on_fast)
    result = cli("run", write_small(tmp_path), "--no-progress", "--out", tmp_path / "run",
                 "--jobs", "2")  # fmt: skip
    assert not result.traceback, result.output
    stored = json.loads((tmp_path / "run" / "manifest.json").read_text())
    status = {r["variant"]: (r["status"], r["error"]) for r in stored["runs"]}
    assert status == {
        "base": ("ok", None),
        "fast": ("failed", "its worker process died before it answered"),
    }
    assert stored["complete"] is True  # every planned run ended; one of them failed
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["variants"]["base"]["all"]["n"] == 60
    assert summary["verdict"]["word"] == "INCONCLUSIVE"


@pytest.mark.parametrize("where", ["pages", "handler"])
def test_a_worker_stopped_before_its_run_began_is_an_interrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Ctrl-C reaches a worker before its run began: while it takes its copies of the
    requests' pages (an answer whose entry never started), or as its handler goes in
    (no answer at all). Either way the run is "interrupted", not "running" nor "failed"."""
    if not fork_safe():
        pytest.skip("this process cannot fork workers")
    from btb_lab import interrupts

    monkeypatch.setattr(interrupts, "_received", [])  # no SIGTERM of an earlier test
    parent = os.getpid()
    if where == "pages":
        own_pages = runner._own_pages

        def stopped(requests: Any) -> None:
            if os.getpid() != parent:
                raise KeyboardInterrupt
            own_pages(requests)

        monkeypatch.setattr(runner, "_own_pages", stopped)
    else:
        _stop_as_handlers_go_in(monkeypatch)
    result = cli("run", write_small(tmp_path), "--no-progress", "--out", tmp_path / "run",
                 "--jobs", "2")  # fmt: skip
    assert result.code == 130, result.output
    stored = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert [(r["status"], r["error"]) for r in stored["runs"]] == [("interrupted", None)] * 2
    assert (stored["interrupted"], stored["complete"]) == (True, False)


def test_jobs_below_zero_is_refused(tmp_path: Path) -> None:
    result = cli("run", write_small(tmp_path), "--jobs", "-1")
    assert result.code == 2
    assert "--jobs must be 0 (one per core) or more" in result.err
