"""Sweeps: one base hypothesis run at many override points, locally or on Ray, into one
table (CSV and markdown) and one plot. See `experiments/` for the shipped sweep files.
"""

from __future__ import annotations

from btb_lab.sweep.engine import (
    RunPointFn,
    SweepOutcome,
    default_sweep_dir,
    is_point_complete,
    plan_tasks,
    read_summaries,
    run_point,
    run_sweep,
)
from btb_lab.sweep.plan import PointTask, SweepPoint, expand_points, overrides_digest
from btb_lab.sweep.spec import LoadedSweep, SweepPointSpec, SweepSpec, TableSpec, load_sweep
from btb_lab.sweep.table import build_table, table_markdown

__all__ = [
    "LoadedSweep",
    "PointTask",
    "RunPointFn",
    "SweepOutcome",
    "SweepPoint",
    "SweepPointSpec",
    "SweepSpec",
    "TableSpec",
    "build_table",
    "default_sweep_dir",
    "expand_points",
    "is_point_complete",
    "load_sweep",
    "overrides_digest",
    "plan_tasks",
    "read_summaries",
    "run_point",
    "run_sweep",
    "table_markdown",
]
