"""The sweep file: one base hypothesis and the override points to run it at.

A sweep names a base hypothesis and combines three kinds of override sources into
points: a `points` list (labelled override sets), `axes` (named choices, each a bundle of
overrides) and a `grid` (one dotted path, many values). Every combination (cartesian
product) is one point, run as its own run directory. Overrides are dotted paths exactly
as `btb_lab.hypothesis.load_hypothesis` accepts them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from btb_lab.config.base import StrictModel
from btb_lab.errors import UserError, ValidationFailed

__all__ = ["LoadedSweep", "SweepPointSpec", "SweepSpec", "TableSpec", "load_sweep"]


class SweepPointSpec(StrictModel):
    """One explicitly listed point."""

    label: str = Field(description="Short name of the point, shown in the table.")
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Dotted-path overrides of the base hypothesis."
    )


class TableSpec(StrictModel):
    """What the sweep's table and plot show."""

    metrics: list[str] = Field(
        default_factory=lambda: ["ttft_mean", "ttft_p95"],
        min_length=1,
        description="Per-variant metrics from summary.json: keys of `variants.<v>.all` "
        "(e.g. ttft_mean, ttft_p95, tpot_p90, e2e_p50, ok_rate) or gpu_imbalance, gpu_std, "
        "gpu_max.",
    )
    scope: str = Field(
        "all",
        description="Which requests the metrics cover: `all`, or a class name (WARM, HEAVY).",
    )
    variants: list[str] | None = Field(
        None, description="Variants to show, in order; default: every variant of the run."
    )
    baseline: str | None = Field(
        None,
        description="Variant the reductions are computed against; default: the base "
        "hypothesis's baseline.",
    )
    reductions: bool = Field(
        True,
        description="Add `<metric> reduction %` columns: (baseline − variant) / baseline × "
        "100, so a positive number means the variant is lower (better for latencies).",
    )
    plot_metric: str | None = Field(
        None, description="Metric drawn in plot.png; default: the first of `metrics`."
    )


class SweepSpec(StrictModel):
    """The whole sweep file."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Sweep name; the default output folder is results/sweeps/<name>/.",
    )
    description: str | None = Field(None, description="What the sweep measures and why.")
    base: str = Field(description="Base hypothesis file, relative to the sweep file's folder.")
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Dotted-path overrides applied to every point."
    )
    points: list[SweepPointSpec] = Field(
        default_factory=list,
        description="Explicit points (labelled override sets); crossed with axes and grid.",
    )
    axes: dict[str, dict[str, dict[str, Any]]] = Field(
        default_factory=dict,
        description="Named axes: axis name → choice label → overrides. Each axis is one "
        "table column; every choice is crossed with every other axis.",
    )
    grid: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="Dotted path → values; the cartesian product of all paths is taken.",
    )
    seed: int | None = Field(
        None, ge=0, description="Master seed for every point; default: the hypothesis's seed."
    )
    table: TableSpec = Field(default_factory=TableSpec, description="Table and plot contents.")
    executor: Literal["local", "ray"] = Field(
        "local", description="Default executor (the CLI's --executor wins)."
    )

    @field_validator("grid")
    @classmethod
    def _grid_values_nonempty(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for path, values in grid.items():
            if not values:
                raise ValueError(f"grid path {path!r} has no values")
        return grid

    @field_validator("axes")
    @classmethod
    def _axes_nonempty(
        cls, axes: dict[str, dict[str, dict[str, Any]]]
    ) -> dict[str, dict[str, dict[str, Any]]]:
        for name, choices in axes.items():
            if not choices:
                raise ValueError(f"axis {name!r} has no choices")
        return axes

    @model_validator(mode="after")
    def _unique_columns(self) -> SweepSpec:
        labels = [p.label for p in self.points]
        if len(set(labels)) != len(labels):
            raise ValueError("point labels must be unique")
        clash = set(self.axes) & set(self.grid)
        if clash:
            raise ValueError(f"names used both as axis and grid path: {sorted(clash)}")
        if "point" in self.axes or "point" in self.grid:
            raise ValueError("'point' is reserved for the points list's column")
        return self


class LoadedSweep:
    """A validated sweep with where it came from (relative paths resolve against it)."""

    def __init__(self, spec: SweepSpec, path: Path) -> None:
        self.spec = spec
        self.path = path
        self.base_path = (path.parent / spec.base).resolve()


def _node_line(root: yaml.Node | None, loc: tuple[int | str, ...]) -> int | None:
    """1-based YAML line of the node at `loc` (or of its nearest existing parent)."""
    node = root
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        child: yaml.Node | None = None
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if getattr(k, "value", None) == str(key):
                    child = v
                    line = k.start_mark.line + 1
                    break
        elif (
            isinstance(node, yaml.SequenceNode)
            and isinstance(key, int)
            and 0 <= key < len(node.value)
        ):
            child = node.value[key]
            line = child.start_mark.line + 1
        if child is None:
            break
        node = child
    return line


def load_sweep(path: Path) -> LoadedSweep:
    """Read and validate a sweep file; every problem names the file, line and field path."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: sweep file not found")
    text = path.read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise UserError(f"{where}: YAML syntax error: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}:1: a sweep file must be a mapping")
    try:
        spec = SweepSpec.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            line = _node_line(root, loc)
            field = ".".join(str(p) for p in loc) or "(top)"
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            problems.append(f"{path}:{line}: {field}: {msg}")
        raise ValidationFailed(problems) from None
    loaded = LoadedSweep(spec, path)
    if not loaded.base_path.is_file():
        line = _node_line(root, ("base",))
        raise UserError(f"{path}:{line}: base: hypothesis file {loaded.base_path} not found")
    return loaded
