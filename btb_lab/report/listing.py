"""`btb-lab list`: hypothesis files with the verdict of their latest stored run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from btb_lab.analysis.models import Summary
from btb_lab.errors import UserError
from btb_lab.results import Manifest

__all__ = ["HypothesisRow", "latest_verdicts", "list_hypotheses"]


@dataclass
class HypothesisRow:
    id: str
    title: str
    path: Path
    verdict: str | None
    run: str | None


def latest_verdicts(results: Path) -> dict[str, tuple[str, str]]:
    """Hypothesis id → (verdict word, run dir) of its newest stored run anywhere under
    `results` (`results/<id>/…`, `make log`'s `results/log/…`, `--out` folders inside it).
    Runs with `--set` overrides (sweep points among them) test a changed hypothesis, so
    they do not count. Newest = largest run id, which starts with the UTC start time."""
    best: dict[str, tuple[str, str, str]] = {}
    for summary_path in results.rglob("summary.json"):
        run_dir = summary_path.parent
        try:
            summary = Summary.load(run_dir)
            manifest = Manifest.load(run_dir)
        except UserError:
            continue
        hid, run_id, word = summary.hypothesis, summary.run_id, summary.verdict.word
        if (manifest.cli.get("options") or {}).get("overrides"):
            continue
        if hid not in best or run_id > best[hid][0]:
            best[hid] = (run_id, word, str(run_dir))
    return {hid: (word, run_dir) for hid, (_, word, run_dir) in best.items()}


def list_hypotheses(folder: Path, results: Path) -> list[HypothesisRow]:
    """Every `*.yaml` in `folder` that looks like a hypothesis, sorted by file name."""
    rows: list[HypothesisRow] = []
    verdicts = latest_verdicts(results) if results.is_dir() else {}
    for path in sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")]):
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, OSError):
            rows.append(HypothesisRow("?", "(unreadable YAML)", path, None, None))
            continue
        if not isinstance(data, dict) or "id" not in data:
            continue
        hid = str(data["id"])
        verdict, run = verdicts.get(hid, (None, None))
        rows.append(HypothesisRow(hid, str(data.get("title", "")), path, verdict, run))
    return rows
