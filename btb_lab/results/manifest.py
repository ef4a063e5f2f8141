"""`manifest.json`: what a run is — the resolved hypothesis, the options, every fidelity
setting, seeds, versions, and the state of each variant × repeat — as a typed model that
the runner writes and every reader (analysis, report, log, listing, sweeps) loads.

The file is rewritten atomically after every change of state, so a reader never sees half
of it, and a crash leaves the last consistent state on disk.

A hypothesis id stands for its newest *full run* (`report ID`, `log append ID`, `list`):
one that completed, recorded no error, and ran the file as written — no `--set`,
`--requests`, `--repeats`, `--time-scale` or `--variants` (sweep points carry overrides,
so they never count). A run directory given by path is always taken as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from btb_lab.errors import UserError
from btb_lab.results.store import write_json

__all__ = [
    "MANIFEST",
    "Manifest",
    "RunEntry",
    "RunStatus",
    "full_runs",
    "resolve_run_dir",
    "same_contents",
    "stored_runs",
]

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
    samples: int | None = Field(None, description="Utilization samples stored.")
    events: int | None = Field(None, description="Events stored.")
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
    notes: list[str] = Field(
        default_factory=list,
        description="What the run left out of or changed in its input (malformed trace rows "
        "skipped, fewer requests than asked), said in the report and on the terminal.",
    )
    runs_planned: int
    trace: dict[str, Any] | None = Field(
        None,
        description="The replayed trace file: path, size, a digest of its ends and a CRC-32 "
        "of the whole file (`trace_stamp`), so that a file changed since is noticed.",
    )
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

    def partial_reasons(self) -> list[str]:
        """Why this run does not stand for its hypothesis (empty for a full run)."""
        reasons: list[str] = []
        if self.error:
            reasons.append(f"failed: {self.error}")
        elif self.interrupted and not self.complete:  # a stop after every run: complete
            reasons.append("interrupted")
        elif not self.complete:
            reasons.append("incomplete" if self.finished else "never finished (killed?)")
        point = (self.cli.get("options") or {}).get("sweep_point")
        if point:  # one point of a grid, even the one that changes nothing
            reasons.append(f"sweep point {point}")
        return reasons + self.run_options()

    def run_options(self) -> list[str]:
        """The command-line options that made the run other than its file says (`--set`,
        `--requests`, `--repeats`, `--time-scale`, `--variants`)."""
        options = self.cli.get("options") or {}
        shown: list[str] = []
        overrides = options.get("overrides")
        if isinstance(overrides, dict) and overrides:
            shown.append("--set " + ", ".join(f"{k}={v}" for k, v in sorted(overrides.items())))
        elif overrides:
            shown.append("--set " + ", ".join(sorted(overrides)))
        for name in _PARTIAL_OPTIONS:
            value = options.get(name)
            if value not in (None, [], ""):
                text = ",".join(map(str, value)) if isinstance(value, list) else value
                shown.append(f"--{name.replace('_', '-')} {text}")
        return shown

    @property
    def is_full_run(self) -> bool:
        """Complete, no error, and run as the file says (see the module docstring)."""
        return not self.partial_reasons()

    @property
    def failed_variants(self) -> list[str]:
        return sorted({r.variant for r in self.runs if r.status == "failed"})

    @property
    def runs_ok(self) -> int:
        return sum(1 for r in self.runs if r.status == "ok")


# Run options that change the experiment the file describes (`--seed`, `--backend` and
# `--out` do not: another seed is a replication, another backend the same experiment).
_PARTIAL_OPTIONS = ("requests", "repeats", "time_scale", "variants")


def stored_runs(
    results_root: Path, hypothesis_id: str | None = None
) -> list[tuple[Path, Manifest]]:
    """Every run under `results_root` (any depth: `results/<id>/…`, `make log`'s
    `results/log/…`, `--out` folders inside it), oldest first by run id (which starts with
    the UTC start time), optionally of one hypothesis. Unreadable manifests are skipped."""
    found: list[tuple[str, str, Path, Manifest]] = []
    if not results_root.is_dir():
        return []
    for path in results_root.rglob(MANIFEST):
        try:
            manifest = Manifest.load(path.parent)
        except UserError:
            continue
        if hypothesis_id is None or manifest.hypothesis_id == hypothesis_id:
            found.append((manifest.run_id, str(path.parent), path.parent, manifest))
    found.sort(key=lambda item: item[:2])
    return [(run_dir, manifest) for _, _, run_dir, manifest in found]


def full_runs(results_root: Path, hypothesis_id: str | None = None) -> list[tuple[Path, Manifest]]:
    """The full runs among `stored_runs` (see the module docstring), oldest first."""
    return [(d, m) for d, m in stored_runs(results_root, hypothesis_id) if m.is_full_run]


def resolve_run_dir(target: str | Path, results_root: Path = Path("results")) -> Path:
    """A run directory (taken as it is), or the newest full run of a hypothesis id
    anywhere under `results_root`."""
    path = Path(target)
    if (path / MANIFEST).is_file():
        return path
    runs = stored_runs(results_root, str(target))
    full = [run_dir for run_dir, manifest in runs if manifest.is_full_run]
    if full:
        return full[-1]
    if runs:
        newest_dir, newest = runs[-1]
        raise UserError(
            f"{target}: no full run under {results_root}/ ({len(runs)} run(s); the newest, "
            f"{newest_dir}, is {'; '.join(newest.partial_reasons())}); give a run directory "
            "to use one anyway"
        )
    if path.is_dir():
        raise UserError(f"{target}: not a run directory (no {MANIFEST})")
    raise UserError(f"{target}: neither a run directory nor a hypothesis id with runs under "
                    f"{results_root}/")  # fmt: skip


def same_contents(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two stamps say one file's contents (wherever it lies). A stamp written
    before the whole-file CRC was kept is compared by size and edges alone."""
    a, b = a or {}, b or {}
    keys = ["bytes", "edges_blake2b"] + (["crc32"] if "crc32" in a and "crc32" in b else [])
    return all(a.get(k) == b.get(k) for k in keys)
