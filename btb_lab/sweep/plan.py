"""Expanding a sweep into points: the cartesian product of its points, axes and grid.

Each point gets a stable id built from its labels and a blake2b digest of its overrides,
so the same point maps to the same run directory across invocations (that is what makes
a sweep resumable) and a changed point never reuses a stale directory.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from btb_lab.sweep.spec import SweepSpec

__all__ = ["PointTask", "SweepPoint", "expand_points", "overrides_digest"]


@dataclass(frozen=True)
class SweepPoint:
    """One combination: its table labels (column → value) and merged overrides."""

    point_id: str
    labels: dict[str, str]
    overrides: dict[str, Any]


@dataclass(frozen=True)
class PointTask:
    """Everything a worker needs to run one point (plain data, so it pickles to a
    process pool or a Ray task)."""

    point_id: str
    labels: dict[str, str]
    base_path: str
    overrides: dict[str, Any]
    run_dir: str
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def overrides_digest(overrides: dict[str, Any]) -> str:
    """Stable short digest of an override set (key order does not matter)."""
    canonical = json.dumps(overrides, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(canonical.encode("utf-8"), digest_size=4).hexdigest()


def _label(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "-", text).strip("-")[:80] or "point"


def expand_points(spec: SweepSpec) -> list[SweepPoint]:
    """All points in a fixed order: listed points outermost, then axes, then grid paths,
    each in file order. Later sources override earlier ones on the same path."""
    listed: list[tuple[dict[str, str], dict[str, Any]]] = (
        [({"point": p.label}, dict(p.overrides)) for p in spec.points]
        if spec.points
        else [({}, {})]
    )
    axis_choices = [
        [({name: label}, dict(ov)) for label, ov in choices.items()]
        for name, choices in spec.axes.items()
    ]
    grid_choices = [
        [({path: _label(v)}, {path: v}) for v in values] for path, values in spec.grid.items()
    ]
    points: list[SweepPoint] = []
    for combo in itertools.product(listed, *axis_choices, *grid_choices):
        labels: dict[str, str] = {}
        overrides: dict[str, Any] = dict(spec.overrides)
        for lab, ov in combo:
            labels.update(lab)
            overrides.update(ov)
        stem = _slug("_".join(labels.values())) if labels else "base"
        point_id = f"{stem}-{overrides_digest(overrides)}"
        points.append(SweepPoint(point_id=point_id, labels=labels, overrides=overrides))
    return points
