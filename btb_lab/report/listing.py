"""`btb-lab list`: hypothesis files with the verdict of their latest stored run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

__all__ = ["HypothesisRow", "list_hypotheses"]


@dataclass
class HypothesisRow:
    id: str
    title: str
    path: Path
    verdict: str | None
    run: str | None


def _latest_verdict(results: Path, hypothesis_id: str) -> tuple[str | None, str | None]:
    for run_dir in sorted((results / hypothesis_id).glob("*/"), reverse=True):
        summary = run_dir / "summary.json"
        if summary.is_file():
            try:
                data = json.loads(summary.read_text())
                return str(data["verdict"]["word"]), str(run_dir)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return None, None


def list_hypotheses(folder: Path, results: Path) -> list[HypothesisRow]:
    """Every `*.yaml` in `folder` that looks like a hypothesis, sorted by file name."""
    rows: list[HypothesisRow] = []
    for path in sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")]):
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, OSError):
            rows.append(HypothesisRow("?", "(unreadable YAML)", path, None, None))
            continue
        if not isinstance(data, dict) or "id" not in data:
            continue
        hid = str(data["id"])
        verdict, run = _latest_verdict(results, hid)
        rows.append(HypothesisRow(hid, str(data.get("title", "")), path, verdict, run))
    return rows
