"""`manifest.json`: what a run is — the resolved hypothesis, the options, every fidelity
setting, seeds, versions, and the state of each variant × repeat — as a typed model that
the runner writes and every reader (analysis, report, log, listing, sweeps) loads.

The file is rewritten atomically after every change of state, so a reader never sees half
of it, and a crash leaves the last consistent state on disk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from btb_lab.errors import UserError
from btb_lab.results.store import write_json

__all__ = ["MANIFEST", "Manifest", "RunEntry", "RunStatus"]

MANIFEST = "manifest.json"
RunStatus = Literal["running", "ok", "failed", "interrupted"]


class _Stored(BaseModel):
    """Base of stored files: a field the reader does not know is an error, never ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunEntry(_Stored):
    """One variant × repeat of a run."""

    variant: str
    repeat: int
    seed: int = Field(description="The backend's seed (policies, random tie-breaks).")
    workload_seed: int = Field(description="The seed the workload of this repeat came from.")
    requests: int
    status: RunStatus
    started: str
    finished: str | None = None
    records: int | None = None
    error: str | None = Field(None, description="One line: the exception of a failed run.")
    error_file: str | None = Field(
        None, description="File in the run directory holding the failed run's traceback."
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="Backend telemetry.")


class Manifest(_Stored):
    """Everything needed to rebuild, explain and reproduce a run."""

    run_id: str
    run_dir: str
    hypothesis_id: str
    hypothesis_file: str
    hypothesis: dict[str, Any] = Field(description="The resolved hypothesis, as JSON.")
    aliases: list[str] = Field(
        default_factory=list, description="Deprecated spellings the hypothesis used."
    )
    cli: dict[str, Any] = Field(default_factory=dict)
    backend: str
    variants: list[str]
    repeats: int
    master_seed: int
    requests_per_run: int | None = None
    runs_planned: int
    runs: list[RunEntry] = Field(default_factory=list)
    fidelity: dict[str, dict[str, Any]] = Field(default_factory=dict)
    telemetry_source: str | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    git: dict[str, Any] | None = None
    host: dict[str, str] = Field(default_factory=dict)
    started: str
    finished: str | None = None
    complete: bool = False
    interrupted: bool = False
    error: str | None = Field(
        None, description="Why the run as a whole failed before or between its variants."
    )
    error_file: str | None = None

    def save(self, run_dir: Path) -> None:
        """Write `manifest.json` atomically."""
        write_json(run_dir / MANIFEST, self.model_dump(mode="json"))

    @classmethod
    def load(cls, run_dir: Path) -> Manifest:
        """Read a run directory's manifest (a UserError naming the file when it is missing,
        unreadable or not a manifest)."""
        path = Path(run_dir) / MANIFEST
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"{run_dir}: not a run directory (no {MANIFEST})") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"{path}: unreadable manifest: {exc}") from None
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(top level)"
            raise UserError(f"{path}: not a btb-lab manifest: {where}: {first['msg']}") from None

    @property
    def failed_variants(self) -> list[str]:
        return sorted({r.variant for r in self.runs if r.status == "failed"})

    @property
    def runs_ok(self) -> int:
        return sum(1 for r in self.runs if r.status == "ok")
