"""`btb-lab list`: hypothesis files with the verdict of their latest stored run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from btb_lab.analysis.models import Summary
from btb_lab.errors import UserError, ValidationFailed
from btb_lab.results import Manifest, full_runs
from btb_lab.yamlio import compose_yaml

__all__ = ["HypothesisRow", "edited_notes", "latest_verdicts", "list_hypotheses", "shared_ids"]


@dataclass
class HypothesisRow:
    id: str
    title: str
    path: Path
    verdict: str | None
    run: str | None
    # how the file changed since that run (`hypothesis.changes.changed_since`), or None
    edited: str | None = None


def latest_verdicts(results: Path) -> dict[str, tuple[str, str]]:
    """Hypothesis id → (verdict word, run dir) of its newest full run anywhere under
    `results` (`results/<id>/…`, `make log`'s `results/log/…`, `--out` folders inside it).
    A full run completed, recorded no error and ran the file as written (no `--set`,
    `--requests`, `--repeats`, `--time-scale`, `--variants`; so no sweep point and no smoke
    run): `btb-lab report ID` picks the same run. Newest = largest run id, which starts
    with the UTC start time. A full run whose summary is missing (killed while rendering)
    shows `?` until `btb-lab report DIR` rebuilds it."""
    latest: dict[str, Path] = {}
    for run_dir, manifest in full_runs(results):
        latest[manifest.hypothesis_id] = run_dir  # oldest first: the newest wins
    out: dict[str, tuple[str, str]] = {}
    for hid, run_dir in latest.items():
        word: str
        try:
            word = Summary.load(run_dir).verdict.word
        except UserError:
            word = "?"
        out[hid] = (word, str(run_dir))
    return out


def list_hypotheses(
    folder: Path,
    results: Path,
    changed: Callable[[Path, dict[str, Any]], str | None] | None = None,
) -> list[HypothesisRow]:
    """Every `*.yaml` in `folder` that looks like a hypothesis, sorted by file name.
    `changed(file, resolved hypothesis a run stored)`: how the file changed since its
    newest run, or None (the loader's stage, `hypothesis.changes.changed_since`)."""
    if not folder.is_dir():
        what = "a file" if folder.exists() else "not found"
        raise UserError(f"--hypotheses {folder}: {what}; name the folder of hypothesis files")
    rows: list[HypothesisRow] = []
    verdicts = latest_verdicts(results) if results.is_dir() else {}
    for path in sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")]):
        try:
            data, _ = compose_yaml(path.read_text(encoding="utf-8"), path)
        except (ValidationFailed, OSError, UnicodeDecodeError):
            rows.append(HypothesisRow("?", "(unreadable YAML)", path, None, None))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("id"), str | int):
            continue
        hid = str(data["id"])
        title = data.get("title", "")
        # only text is shown: a mapping could be an alias bomb that str() would expand
        title = str(title) if isinstance(title, str | int | float) else "(not text)"
        verdict, run = verdicts.get(hid, (None, None))
        edited = None
        if run is not None and changed is not None:
            try:
                edited = changed(path, Manifest.load(Path(run)).hypothesis)
            except UserError:  # its manifest went unreadable meanwhile
                edited = None
        rows.append(HypothesisRow(hid, title, path, verdict, run, edited))
    return rows


def edited_notes(rows: list[HypothesisRow]) -> list[str]:
    """A note per file edited since the run whose verdict its row shows."""
    return [
        f"note: {row.path} changed since {row.run} ran it ({row.edited}): its verdict (*) "
        "is of the settings that run had"
        for row in rows
        if row.edited is not None
    ]


def shared_ids(rows: list[HypothesisRow]) -> list[str]:
    """A note per id that several listed files give: their runs are stored under one id,
    so each row shows the newest run of any of them."""
    files: dict[str, list[str]] = {}
    for row in rows:
        if row.id != "?":
            files.setdefault(row.id, []).append(row.path.name)
    return [
        f"note: {hid} is the id of {', '.join(names)}: their runs are stored together, and "
        "each row shows the newest of them (give each file its own id)"
        for hid, names in files.items()
        if len(names) > 1
    ]
