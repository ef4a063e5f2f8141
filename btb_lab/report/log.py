"""The hypothesis log (`hypotheses/LOG.md`): append verdict entries, list what it holds.

Tool entries sit between HTML comment markers, one pair per run, so appending the same
run again replaces its entry and text a researcher wrote outside the markers is kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from btb_lab.analysis.summary import analyze_run
from btb_lab.errors import UserError, ValidationFailed
from btb_lab.report.render import entry_context, render_template
from btb_lab.results import write_atomic

__all__ = ["LogEntry", "append_entry", "parse_log", "read_log", "render_entry"]

_HEADER = (
    "# Hypothesis log\n\nVerdicts appended by `btb-lab log append`; text outside the tool's "
    "markers is kept.\n"
)
_START = "<!-- btb-lab:entry {id} run={run} -->"
_END = "<!-- btb-lab:end {id} run={run} -->"
_HEADING = re.compile(r"^##\s+([^\s:]+):\s*(.*?)\s*$")
_VERDICT = re.compile(r"\*\*Verdict\*\*:\s*\*\*([A-Z ]+?)\*\*")
_MARK = re.compile(r"^<!-- btb-lab:(entry|end) (\S+) run=(\S+) -->$")
_INCOMPLETE = " (incomplete run)"  # after the verdict's reason (log_entry.md.j2)


@dataclass
class LogEntry:
    """One `## ID: title` section of the log."""

    hypothesis: str
    title: str
    verdict: str | None
    run: str | None  # set for entries the tool wrote


def _report_path(run_dir: Path, log_path: Path) -> str:
    try:
        rel = os.path.relpath(run_dir.resolve() / "report.md", log_path.resolve().parent)
    except ValueError:  # different drives
        rel = str(run_dir.resolve() / "report.md")
    return Path(rel).as_posix()


def _crosscheck_context(compare_dir: Path, log_path: Path) -> dict[str, Any]:
    """What the entry says about the same hypothesis in the other world (compare.json)."""
    import json

    from btb_lab.analysis.compare import Comparison, summary_errors

    c = Comparison.model_validate(
        json.loads((compare_dir / "compare.json").read_text(encoding="utf-8"))
    )

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 100:+.1f}%"

    errors = []
    for variant, metrics in summary_errors(c).items():
        parts = [
            f"{name.split('_')[0].upper()}{name.split('_')[1][1:]} {pct(e['error'])}"
            + (f" (spread {e['spread'] * 100:.1f}%)" if e["spread"] is not None else "")
            for name, e in metrics.items()
        ]
        errors.append(f"{variant}: " + ", ".join(parts))
    return {
        "model_backend": c.model_backend,
        "reference_backend": c.reference_backend,
        "agree": sum(v.agrees for v in c.verdicts),
        "verdicts": [
            f"{v.variant}: {c.model_backend} {v.model}, {c.reference_backend} {v.reference}"
            for v in c.verdicts
        ],
        "same_ranking": c.same_ranking,
        "errors": errors,
        "n": len(c.verdicts),
        "compare_path": _report_path(compare_dir, log_path).replace("report.md", "compare.md"),
    }


def render_entry(
    run_dir: Path, log_path: Path, *, compare_dir: Path | None = None
) -> tuple[str, str, str]:
    """(hypothesis id, run id, entry text with its markers) for one stored run; with
    `compare_dir` (a comparison of this run with the same hypothesis elsewhere), the entry
    carries their agreement."""
    run = analyze_run(run_dir)
    context = entry_context(run)
    context["report_path"] = _report_path(run_dir, log_path)
    context["crosscheck"] = (
        _crosscheck_context(compare_dir, log_path) if compare_dir is not None else None
    )
    body = render_template("log_entry.md.j2", context).rstrip("\n")
    hid, run_id = context["id"], context["run_id"]
    text = f"{_START.format(id=hid, run=run_id)}\n{body}\n{_END.format(id=hid, run=run_id)}\n"
    return hid, run_id, text


def read_log(log_path: Path) -> str:
    """The log's text (a new log's header when there is none yet). A folder, a file that
    is not UTF-8 text or one that cannot be read is a `UserError` naming the file, which
    a bare `read_text` would leave to the CLI's generic "input is not UTF-8" line."""
    if log_path.is_dir():
        raise UserError(f"--log {log_path}: is a directory, not a log file")
    if not log_path.exists():
        return _HEADER
    try:
        return log_path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{log_path}: not a text (UTF-8) file") from None
    except OSError as exc:
        raise UserError(f"{log_path}: cannot read: {exc.strerror or exc}") from None


@contextlib.contextmanager
def _locked(log_path: Path) -> Iterator[None]:
    """One `log append` at a time per log file (an advisory lock on `.<name>.lock` beside
    it), so two appends never lose each other's entry."""
    lock_path = log_path.with_name(f".{log_path.name}.lock")
    try:
        handle = lock_path.open("a")
    except OSError:  # a read-only folder: the replace below fails with the real reason
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def append_entry(
    run_dir: Path,
    log_path: Path,
    *,
    compare_dir: Path | None = None,
    replace: bool = False,
) -> None:
    """Add the run's entry to the log, or replace it if this run is already there. With
    `replace`, the entry takes the place of the hypothesis's first tool entry from any
    run (its later ones are removed), so one hypothesis is re-run without regenerating
    the whole log or moving its entry. The log is replaced atomically: a reader, or a
    crash, sees the old log or the new one."""
    hid, run_id, entry = render_entry(run_dir, log_path, compare_dir=compare_dir)
    if log_path.is_dir():
        raise UserError(f"--log {log_path}: is a directory, not a log file")
    folder = next((p for p in log_path.parents if p.exists()), None)
    if folder is not None and not folder.is_dir():
        raise UserError(f"--log {log_path}: {folder} is a file, not a folder")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(log_path):
        _append_locked(log_path, hid, run_id, entry, replace=replace)


def _entry_spans(text: str, hid: str, run_id: str | None) -> list[tuple[int, int]]:
    """(start, end) of the tool entries of `hid` (of run `run_id`, or of any run), each
    with the newline after its end marker."""
    run = re.escape(run_id) if run_id is not None else r"\S+"
    pattern = re.compile(
        rf"^<!-- btb-lab:entry {re.escape(hid)} run=({run}) -->$.*?"
        rf"^<!-- btb-lab:end {re.escape(hid)} run=\1 -->$\n?",
        re.MULTILINE | re.DOTALL,
    )
    return [m.span() for m in pattern.finditer(text)]


def _append_locked(
    log_path: Path, hid: str, run_id: str, entry: str, *, replace: bool = False
) -> None:
    text = read_log(log_path)
    _check_marks(text, log_path)
    # replace: in place of the hypothesis's first entry, whichever run it is of (this
    # run's own among them), the later ones removed; else this run's own entry updated
    spans = _entry_spans(text, hid, None if replace else run_id)
    if spans:
        (i, j), *later = spans
        for a, b in reversed(later):
            text = text[:a] + text[b:]
        text = text[:i] + entry + text[j:]
    else:
        if not text.endswith("\n"):
            text += "\n"
        if not text.endswith("\n\n"):
            text += "\n"
        text += entry
    write_atomic(log_path, text)


def _check_marks(text: str, log_path: Path) -> None:
    """Every tool entry's start marker has its end marker before the next entry: an
    append finds its run's entry by the pair, and with one of them edited away it would
    add the entry a second time instead of replacing it."""
    problems: list[str] = []
    open_at, open_entry = 0, ""  # the line and `ID run=RUN` of the entry now open
    for line_no, line in enumerate(text.splitlines(), start=1):
        mark = _MARK.match(line.strip())
        if not mark:
            continue
        kind, entry = mark.group(1), f"{mark.group(2)} run={mark.group(3)}"
        if kind == "entry":
            if open_entry:
                problems.append(f"{log_path}:{open_at}: the entry of {open_entry} has no end "
                                f"marker before line {line_no}")  # fmt: skip
            open_at, open_entry = line_no, entry
        elif not open_entry:
            problems.append(f"{log_path}:{line_no}: an end marker without its entry marker")
        else:
            if entry != open_entry:
                problems.append(f"{log_path}:{line_no}: the end marker of {entry} closes the "
                                f"entry of {open_entry}")  # fmt: skip
            open_entry = ""
    if open_entry:
        problems.append(f"{log_path}:{open_at}: the entry of {open_entry} has no end marker")
    if problems:
        raise ValidationFailed(
            [*problems, f"{log_path}: mend the btb-lab markers by hand; the log is unchanged"]
        )


def parse_log(text: str) -> list[LogEntry]:
    """Every `## ID: title` section, hand-written or the tool's, with its verdict word
    (" (incomplete run)" after it where the entry says so). A tool entry whose heading was
    edited out of that shape is still one entry: its id is in its markers."""
    entries: list[LogEntry] = []
    run: str | None = None
    marked: str | None = None  # the id of the tool entry being read, until its heading
    for line in text.splitlines():
        mark = _MARK.match(line.strip())
        if mark:
            opened = mark.group(1) == "entry"
            run, marked = (mark.group(3), mark.group(2)) if opened else (None, None)
            continue
        heading = _HEADING.match(line)
        if heading:
            entries.append(LogEntry(heading.group(1), heading.group(2), None, run))
            marked = None
            continue
        verdict = _VERDICT.search(line)
        if verdict and marked is not None:  # the tool's entry, its heading edited
            entries.append(LogEntry(marked, "(heading edited)", None, run))
            marked = None
        if verdict and entries and entries[-1].verdict is None:
            word = verdict.group(1).strip()
            entries[-1].verdict = word + (_INCOMPLETE if _INCOMPLETE in line else "")
    return entries
