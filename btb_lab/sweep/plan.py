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

__all__ = ["PointTask", "SweepPoint", "duplicate_points", "expand_points", "overrides_digest"]


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


# where one component of a point was written: ("points", i), ("axes", name, choice) or
# ("grid", path, i); a point's sources are one per component, in product order
Source = tuple[str | int, ...]
_Sourced = tuple[tuple[Source, ...], SweepPoint]


def _expand(spec: SweepSpec) -> list[_Sourced]:
    """Every point with the sources it was combined from (for `duplicate_points`)."""
    listed: list[tuple[Source, dict[str, str], dict[str, Any]]] = (
        [(("points", i), {"point": p.label}, dict(p.overrides)) for i, p in enumerate(spec.points)]
        if spec.points
        else [((), {}, {})]
    )
    axis_choices = [
        [(("axes", name, label), {name: label}, dict(ov)) for label, ov in choices.items()]
        for name, choices in spec.axes.items()
    ]
    grid_choices = [
        [(("grid", path, i), {path: _label(v)}, {path: v}) for i, v in enumerate(values)]
        for path, values in spec.grid.items()
    ]
    out: list[_Sourced] = []
    for combo in itertools.product(listed, *axis_choices, *grid_choices):
        labels: dict[str, str] = {}
        overrides: dict[str, Any] = dict(spec.overrides)
        for _, lab, ov in combo:
            labels.update(lab)
            overrides.update(ov)
        stem = _slug("_".join(labels.values())) if labels else "base"
        point_id = f"{stem}-{overrides_digest(overrides)}"
        point = SweepPoint(point_id=point_id, labels=labels, overrides=overrides)
        out.append((tuple(src for src, _, _ in combo), point))
    return out


def expand_points(spec: SweepSpec) -> list[SweepPoint]:
    """All points in a fixed order: listed points outermost, then axes, then grid paths,
    each in file order. Later sources override earlier ones on the same path."""
    return [point for _, point in _expand(spec)]


def duplicate_points(spec: SweepSpec) -> list[tuple[Source, Source, str]]:
    """Points that are one point twice: the same id (one run directory for two points,
    whose second run fails on the first's files), or the same labels and equal overrides
    (`1` and `1.0`: one run made twice under two ids). Each is (the first source the
    later point differs in, the earlier point's source there, why), once per source."""
    by_id: dict[str, _Sourced] = {}
    by_labels: dict[tuple[tuple[str, str], ...], list[_Sourced]] = {}
    found: list[tuple[Source, Source, str]] = []
    reported: set[Source] = set()
    for sources, point in _expand(spec):
        same_labels = by_labels.setdefault(tuple(point.labels.items()), [])
        earlier = by_id.get(point.point_id)
        why = f"both make point {point.point_id}"
        if earlier is None:
            earlier = next((e for e in same_labels if e[1].overrides == point.overrides), None)
            if earlier is None:
                by_id[point.point_id] = (sources, point)
                same_labels.append((sources, point))
                continue
            why = f"both make the same point ({earlier[1].point_id} and {point.point_id})"
        mine, theirs = next(
            (m, t) for m, t in zip(sources, earlier[0], strict=True) if m != t
        )  # two points never have the same sources
        if mine not in reported:
            reported.add(mine)
            found.append((mine, theirs, why))
    return found
