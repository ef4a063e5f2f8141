"""`make log` (scripts/make_log.sh) under faults (issue 16, item 2): whatever stops it —
Ctrl-C, SIGTERM, SIGKILL, a failing hypothesis, a second make log — LOG.md is afterwards
its old content or the new one, never less, and every run it links to exists.

Most cases drive the script with a stand-in for btb-lab (tests/integration/make_log_stub.py:
`run` copies a real run directory, `log append` is the real command) that stops at a named
point; one case runs the real CLI end to end.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import btb_lab
from tests.helpers import MAIN, cli, python_env, write_small

SCRIPT = Path(btb_lab.__file__).resolve().parents[1] / "scripts" / "make_log.sh"
STUB = Path(__file__).with_name("make_log_stub.py")
NAMES = ("h1", "h2")
HAND_WRITTEN = "A note a researcher wrote above the entries.\n"


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real simulator run directory, copied by the stub for every hypothesis."""
    folder = tmp_path_factory.mktemp("template")
    result = cli("run", write_small(folder), "--no-progress", "--out", folder / "run")
    assert result.code == 0, result.output
    return folder / "run"


def make_repo(folder: Path) -> Path:
    """A checkout-shaped folder: scripts/make_log.sh, the hypotheses, a btb-lab stand-in."""
    (folder / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, folder / "scripts" / "make_log.sh")
    (folder / "hypotheses").mkdir()
    for name in NAMES:
        write_small(folder / "hypotheses", f"{name}.yaml")
    stub = folder / "btb"
    stub.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STUB}" "$@"\n', encoding="utf-8")
    stub.chmod(0o755)
    return folder


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory, template: Path) -> Path:
    """A repo after one complete make log (copied for each test that starts from it)."""
    folder = make_repo(tmp_path_factory.mktemp("logged") / "repo")
    log = folder / "hypotheses" / "LOG.md"
    log.write_text("# Hypothesis log\n\n" + HAND_WRITTEN + "\n", encoding="utf-8")
    code, output = finish(start(folder, template=str(template)))
    assert code == 0, output
    return folder


@pytest.fixture
def repo(tmp_path: Path, logged: Path) -> Path:
    """A fresh copy of the logged repo: LOG.md with an entry per hypothesis."""
    copy = tmp_path / "repo"
    shutil.copytree(logged, copy, symlinks=True)
    (copy / "btb").write_text((logged / "btb").read_text(), encoding="utf-8")
    return copy


def start(repo: Path, *files: str, btb: str | None = None, **env: str) -> subprocess.Popen[str]:
    environment = python_env(
        BTB=btb or str(repo / "btb"), PY=sys.executable, STUB_TEMPLATE=str(env.pop("template", "")),
        STUB_MARKERS=str(repo / "markers"), **env,
    )  # fmt: skip
    return subprocess.Popen(
        ["bash", str(repo / "scripts" / "make_log.sh"), *files], cwd=repo, env=environment,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def wait_for(path: Path, proc: subprocess.Popen[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"make log exited {proc.returncode} first:\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{path} never appeared")
        time.sleep(0.05)


def finish(proc: subprocess.Popen[str], timeout_s: float = 120) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, out + err


def full_log(repo: Path, template: Path) -> bytes:
    """A complete make log over the repo; the new LOG.md."""
    code, output = finish(start(repo, template=str(template)))
    assert code == 0, output
    return (repo / "hypotheses" / "LOG.md").read_bytes()


def old_log(repo: Path) -> bytes:
    return (repo / "hypotheses" / "LOG.md").read_bytes()


def entries(log: Path) -> list[tuple[str, str]]:
    return re.findall(r"^<!-- btb-lab:entry (\S+) run=(\S+) -->$", log.read_text(), re.M)


def assert_consistent(repo: Path, expected: bytes) -> None:
    """LOG.md is exactly `expected`, every report it links to exists, no temporary log
    is left behind."""
    log = repo / "hypotheses" / "LOG.md"
    assert log.read_bytes() == expected
    links = re.findall(r"^Report: \[([^\]]+)\]", log.read_text(), re.M)
    assert len(links) == len(NAMES)
    for link in links:
        assert (log.parent / link).is_file(), link
    assert sorted(p.name for p in log.parent.glob("LOG.md*")) == ["LOG.md"]


def test_a_complete_make_log_replaces_every_entry(repo: Path, template: Path) -> None:
    first = old_log(repo)
    assert [hid for hid, _ in entries(repo / "hypotheses" / "LOG.md")] == ["H1", "H2"]
    assert HAND_WRITTEN.encode() in first
    assert_consistent(repo, first)
    old_runs = {run for _, run in entries(repo / "hypotheses" / "LOG.md")}
    second = full_log(repo, template)
    new_runs = {run for _, run in entries(repo / "hypotheses" / "LOG.md")}
    assert len(new_runs) == len(NAMES)
    assert not new_runs & old_runs
    assert HAND_WRITTEN.encode() in second
    assert_consistent(repo, second)
    # the runs only the old log linked to are gone; one run per hypothesis is left
    assert [len(list((repo / "results" / "log" / n).iterdir())) for n in NAMES] == [1, 1]


def test_a_make_log_of_some_files_replaces_only_their_entries_in_place(
    repo: Path, template: Path
) -> None:
    log = repo / "hypotheses" / "LOG.md"
    before = entries(log)
    text = log.read_text()
    h2_entry = text[text.index("<!-- btb-lab:entry H2") :]
    h2_runs = sorted((repo / "results" / "log" / "h2").iterdir())
    code, output = finish(start(repo, "hypotheses/h1.yaml", template=str(template)))
    assert code == 0, output
    after = entries(log)
    assert [hid for hid, _ in after] == ["H1", "H2"]  # same order
    assert after[0][1] != before[0][1]  # H1 from a new run
    assert after[1] == before[1]
    assert log.read_text().endswith(h2_entry)  # H2's entry byte for byte
    assert HAND_WRITTEN in log.read_text()
    # H1's old run is gone, H2's runs are untouched
    assert len(list((repo / "results" / "log" / "h1").iterdir())) == 1
    assert sorted((repo / "results" / "log" / "h2").iterdir()) == h2_runs
    assert_consistent(repo, log.read_bytes())


@pytest.mark.parametrize(
    ("point", "sig", "code"),
    [
        ("run:h2", signal.SIGINT, 130),  # Ctrl-C: the terminal signals the process group
        ("run:h2", signal.SIGTERM, 143),  # kill PID: the script only
        ("append:h2", signal.SIGTERM, 143),
    ],
)
def test_an_interrupted_make_log_keeps_the_old_log(
    repo: Path, template: Path, point: str, sig: signal.Signals, code: int
) -> None:
    old = old_log(repo)
    proc = start(repo, template=str(template), STUB_BLOCK=point)
    wait_for(repo / "markers" / point.replace(":", "-"), proc)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    returncode, output = finish(proc, timeout_s=60)  # at once, not after the blocked run
    assert returncode == code, output
    assert "LOG.md left as it was" in output
    assert_consistent(repo, old)


def test_a_killed_make_log_keeps_the_old_log_and_the_next_one_recovers(
    repo: Path, template: Path
) -> None:
    old = old_log(repo)
    proc = start(repo, template=str(template), STUB_BLOCK="append:h2")
    wait_for(repo / "markers" / "append-h2", proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the machine went away: no trap runs
    proc.wait(timeout=30)
    log = repo / "hypotheses" / "LOG.md"
    assert log.read_bytes() == old
    assert list(log.parent.glob("LOG.md.new.*"))  # the half-built log it left
    new = full_log(repo, template)
    assert new != old
    assert_consistent(repo, new)


def test_a_second_make_log_refuses_to_start(repo: Path, template: Path) -> None:
    old = old_log(repo)
    first = start(repo, template=str(template), STUB_BLOCK="run:h1")
    wait_for(repo / "markers" / "run-h1", first)
    second_code, second_output = finish(start(repo, template=str(template)), timeout_s=60)
    assert second_code == 1, second_output
    assert "another make log is running" in second_output
    first.send_signal(signal.SIGTERM)
    assert finish(first, timeout_s=60)[0] == 143
    assert_consistent(repo, old)


def test_a_failing_hypothesis_leaves_the_log_as_it_was(repo: Path, template: Path) -> None:
    old = old_log(repo)
    code, output = finish(start(repo, template=str(template), STUB_FAIL="h2"))
    assert code == 1, output
    assert "hypotheses/h2.yaml failed" in output
    assert_consistent(repo, old)


def test_sigterm_during_a_real_run_keeps_the_log_and_the_interrupted_run(tmp_path: Path) -> None:
    """The real CLI, end to end: two small hypotheses, SIGTERM while the second runs."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "make_log.sh")
    (tmp_path / "hypotheses").mkdir()
    slow = {"requests: 60, rate_per_s: 4.0": "requests: 100000, rate_per_s: 400.0"}
    write_small(tmp_path / "hypotheses", "h1.yaml")
    write_small(tmp_path / "hypotheses", "h2.yaml", **slow)
    btb = tmp_path / "btb"
    btb.write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "{MAIN}" "$@"\n', encoding="utf-8")
    btb.chmod(0o755)
    log = tmp_path / "hypotheses" / "LOG.md"
    log.write_text("# Hypothesis log\n\nKept.\n", encoding="utf-8")
    old = log.read_bytes()
    proc = start(tmp_path, btb=str(btb))
    deadline = time.monotonic() + 300
    parts = tmp_path / "results" / "log" / "h2"
    while not list(parts.glob("*/parts/requests-*")):  # h2's first records are on disk
        assert proc.poll() is None, finish(proc)[1]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    code, output = finish(proc, timeout_s=120)
    assert code == 143, output
    assert log.read_bytes() == old
    (interrupted,) = parts.iterdir()
    import json

    manifest = json.loads((interrupted / "manifest.json").read_text())
    assert manifest["interrupted"] is True
    assert manifest["complete"] is False
    assert (interrupted / "report.md").is_file()
