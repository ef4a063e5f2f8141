"""One hypothesis, two worlds, one command: `btb-lab run H.yaml --backend sim,cluster`.

Runs the hypothesis on every backend named (optionally calibrating the engine first and
running the simulator on that profile), then compares the runs, all into one directory:

    <dir>/profile.yaml     the engine profile (with --calibrate)
    <dir>/<backend>/       one ordinary run directory per backend
    <dir>/compare/         compare.md, compare.json, plots/
    <dir>/crosscheck.json  what is where

`btb-lab report` and `log append` accept the directory: the entry is the reference run's
(the real cluster's), with the comparison's agreement beside it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from btb_lab.errors import UserError
from btb_lab.results import check_out, new_run_id
from btb_lab.runner import RunOptions, RunOutcome, plan_run, run_hypothesis

__all__ = ["CROSSCHECK", "Crosscheck", "CrosscheckOutcome", "load_crosscheck", "run_crosscheck"]

CROSSCHECK = "crosscheck.json"


class Crosscheck(BaseModel):
    """crosscheck.json: the runs of one hypothesis on several backends and their comparison
    (paths relative to the directory holding the file)."""

    model_config = ConfigDict(extra="forbid")

    hypothesis: str
    runs: dict[str, str]
    reference: str
    compare: str
    profile: str | None = None


@dataclass
class CrosscheckOutcome:
    root: Path
    runs: dict[str, RunOutcome]
    crosscheck: Crosscheck


def load_crosscheck(root: Path) -> Crosscheck | None:
    """The crosscheck description of `root`, or None when `root` is not one."""
    path = root / CROSSCHECK
    if not path.is_file():
        return None
    try:
        return Crosscheck.model_validate(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable: {exc}") from None


def run_crosscheck(
    path: Path, options: RunOptions, backends: list[str], *, calibrate: bool = False
) -> CrosscheckOutcome:
    """Run `path` on each backend (calibrating first if asked), then compare the runs."""
    from btb_lab.report.compare import write_comparison

    if len(set(backends)) != len(backends) or len(backends) < 2:
        raise UserError(f"--backend {','.join(backends)}: name two or more different backends")
    plan = plan_run(path, replace(options, backend=backends[0], dry_run=True))
    hid = plan.hypothesis.id
    root = options.out or options.results_root / hid / f"{new_run_id()}-crosscheck"
    check_out(root)
    root.mkdir(parents=True, exist_ok=True)
    profile_rel: str | None = None
    overrides: dict[str, Any] = dict(options.overrides)
    if calibrate:
        if "cluster" not in backends or "sim" not in backends:
            raise UserError("--calibrate needs both sim and cluster among --backend")
        profile = _calibrate(path, root / "profile.yaml")
        profile_rel = "profile.yaml"
    outcomes: dict[str, RunOutcome] = {}
    for backend in backends:
        these = dict(overrides)
        if backend == "sim" and profile_rel is not None:
            these["costs.model"] = {"profile": str(profile.resolve())}
        outcomes[backend] = run_hypothesis(
            path, replace(options, backend=backend, out=root / backend, overrides=these)
        )
    reference = "cluster" if "cluster" in backends else backends[0]
    write_comparison(
        [outcomes[reference].run_dir, *(o.run_dir for b, o in outcomes.items() if b != reference)],
        root / "compare",
    )
    crosscheck = Crosscheck(
        hypothesis=hid, runs={b: b for b in backends}, reference=reference, compare="compare",
        profile=profile_rel,
    )  # fmt: skip
    (root / CROSSCHECK).write_text(crosscheck.model_dump_json(indent=2) + "\n", "utf-8")
    return CrosscheckOutcome(root=root, runs=outcomes, crosscheck=crosscheck)


def _calibrate(path: Path, out: Path) -> Path:
    from btb_lab.calibrate.run import calibrate, target_from_hypothesis
    from btb_lab.cluster.launcher import sigterm_raises

    target, (launcher, specs) = target_from_hypothesis(path)
    with sigterm_raises(), launcher:
        launcher.start(specs, label="calibrate")
        # servers launched here start with empty caches: the same prompts every time
        profile = calibrate(target, name=out.stem, seed=0)
    profile.save(out)
    return out
