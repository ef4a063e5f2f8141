"""The sweep file: one base hypothesis and the override points to run it at.

A sweep names a base hypothesis and combines three kinds of override sources into
points: a `points` list (labelled override sets), `axes` (named choices, each a bundle of
overrides) and a `grid` (one dotted path, many values). Every combination (cartesian
product) is one point, run as its own run directory. Overrides are dotted paths exactly
as `btb_lab.hypothesis.load_hypothesis` accepts them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError, field_validator, model_validator

from btb_lab.config.base import StrictModel
from btb_lab.config.limits import MAX_SWEEP_POINTS
from btb_lab.config.metrics import METRICS
from btb_lab.errors import UserError, ValidationFailed

__all__ = ["LoadedSweep", "SweepPointSpec", "SweepSpec", "TableSpec", "load_sweep"]


class SweepPointSpec(StrictModel):
    """One explicitly listed point."""

    label: str = Field(description="Short name of the point, shown in the table.")
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Dotted-path overrides of the base hypothesis."
    )


def _known_metric(name: str) -> str:
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}; choose one of: " + ", ".join(METRICS))
    return name


# a metric of `config.metrics`, checked where it is written (`table.metrics.1`)
MetricName = Annotated[str, AfterValidator(_known_metric)]


class ReferenceSpec(StrictModel):
    """Figures from elsewhere (a paper's table) keyed by one label column's values: the
    table gains the reference column, `<column>_gap_pp` (the table's value minus the
    reference) and `<column>_within` (|gap| ≤ tolerance)."""

    axis: str = Field(description="Label column whose values key `values` (an axis name).")
    column: str = Field(description="Table column (after `rename`) compared to the figures.")
    name: str = Field("published_pct", description="Name of the reference column.")
    values: dict[str, float] = Field(description="Label → reference figure.")
    tolerance: float = Field(2.0, ge=0, description="Largest |gap| that counts as reproduced.")


class TableSpec(StrictModel):
    """What the sweep's table and plot show."""

    metrics: list[MetricName] = Field(
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
    plot_metric: MetricName | None = Field(
        None, description="Metric drawn in plot.png; default: the first of `metrics`."
    )
    rename: dict[str, str] = Field(
        default_factory=dict,
        description="Table column → the name it gets in table.csv / table.md (e.g. "
        "`ttft_mean reduction % (btb vs cache_aware)` → `btb_reduction_pct`).",
    )
    reference: ReferenceSpec | None = Field(
        None, description="Published figures to set beside a column, with their gaps."
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
        ref = self.table.reference
        if ref is not None:
            if ref.axis not in self.axes:
                raise ValueError(
                    f"table.reference.axis {ref.axis!r} is not an axis; axes: "
                    + (", ".join(self.axes) or "none")
                )
            unknown = sorted(set(ref.values) - set(self.axes[ref.axis]))
            if unknown:
                raise ValueError(
                    f"table.reference.values: {', '.join(unknown)} not choices of axis "
                    f"{ref.axis!r} ({', '.join(self.axes[ref.axis])})"
                )
        return self


class LoadedSweep:
    """A validated sweep with where it came from (relative paths resolve against it) and
    the line of every key, so a bad override is reported at its line of the sweep file."""

    def __init__(
        self, spec: SweepSpec, path: Path, lines: Mapping[tuple[str | int, ...], int] | None = None
    ) -> None:
        self.spec = spec
        self.path = path
        self.base_path = (path.parent / spec.base).resolve()
        self.lines: Mapping[tuple[str | int, ...], int] = lines or {}

    def line(self, *loc: str | int) -> int:
        """1-based line of the key at `loc` (or of its nearest parent that has one)."""
        return _line_in(self.lines, loc)

    def override_origins(
        self, labels: Mapping[str, str], overrides: Mapping[str, Any]
    ) -> dict[str, str]:
        """For one point (its labels and merged overrides), where each override was
        written: `sweep.yaml:LINE: grid.<path>`, `…: axes.<axis>.<choice>.<path>`,
        `…: points.<i>.overrides.<path>` or `…: overrides.<path>` (the source that wins,
        in `expand_points`' order: grid over axes over points over top-level overrides)."""
        spec = self.spec
        origins: dict[str, str] = {}
        for key in overrides:
            loc: tuple[str | int, ...] = ("overrides", key)
            label = labels.get("point")
            if label is not None:
                index = next(i for i, p in enumerate(spec.points) if p.label == label)
                if key in spec.points[index].overrides:
                    loc = ("points", index, "overrides", key)
            for axis, choices in spec.axes.items():
                choice = labels.get(axis)
                if choice is not None and key in choices.get(choice, {}):
                    loc = ("axes", axis, choice, key)
            if key in spec.grid:
                loc = ("grid", key)
            dotted = ".".join(str(p) for p in loc)
            origins[key] = f"{self.path}:{self.line(*loc)}: {dotted}"
        return origins


def _line_in(lines: Mapping[tuple[str | int, ...], int], loc: tuple[str | int, ...]) -> int:
    for cut in range(len(loc), -1, -1):
        if loc[:cut] in lines:
            return lines[loc[:cut]]
    return 1


def load_sweep(path: Path) -> LoadedSweep:
    """Read and validate a sweep file; every problem names the file, line and field path.
    The YAML is read with the hypothesis loader's checks (no tags, duplicate keys or
    alias bombs), and a sweep of more than MAX_SWEEP_POINTS points is refused."""
    from btb_lab.yamlio import compose_yaml

    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a directory, not a sweep file")
    if not path.is_file():
        raise UserError(f"{path}: sweep file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text (UTF-8) file") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None
    data, lines = compose_yaml(text, path)
    if not isinstance(data, dict):
        raise UserError(f"{path}:1: a sweep file must be a mapping")
    loaded_lines: dict[tuple[str | int, ...], int] = dict(lines)
    try:
        spec = SweepSpec.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            field = ".".join(str(p) for p in loc) or "(top)"
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, ") :]
            problems.append(f"{path}:{_line_in(loaded_lines, loc)}: {field}: {msg}")
        raise ValidationFailed(problems) from None
    loaded = LoadedSweep(spec, path, loaded_lines)
    if not loaded.base_path.is_file():
        raise UserError(
            f"{path}:{loaded.line('base')}: base: hypothesis file {loaded.base_path} not found"
        )
    _refuse_sweep_base(loaded)
    count = max(1, len(spec.points))
    for choices in spec.axes.values():
        count *= len(choices)
    for values in spec.grid.values():
        count *= len(values)
    if count > MAX_SWEEP_POINTS:
        raise UserError(
            f"{path}:1: (top level): the sweep has {count:,} points, more than the limit of "
            f"{MAX_SWEEP_POINTS:,} (each point is a full run)"
        )
    _refuse_duplicate_points(loaded)
    return loaded


def _refuse_sweep_base(loaded: LoadedSweep) -> None:
    """A base that is itself a sweep file is named as such (its keys failed the
    hypothesis schema once per point, with no word of what was wrong)."""
    from btb_lab.yamlio import compose_yaml

    try:
        data, _ = compose_yaml(loaded.base_path.read_text(encoding="utf-8"), loaded.base_path)
    except (OSError, UnicodeDecodeError, UserError):
        return  # the hypothesis loader reports it, with its line
    if isinstance(data, dict) and "base" in data and "variants" not in data:
        theirs = (loaded.base_path.parent / str(data["base"])).resolve()
        raise UserError(
            f"{loaded.path}:{loaded.line('base')}: base: {loaded.base_path} is a sweep file, "
            f"not a hypothesis: name the hypothesis it varies ({theirs}) and add its axes here"
        )


def _refuse_duplicate_points(loaded: LoadedSweep) -> None:
    """Two grid values, axis choices or listed points that make one point twice are
    refused at their lines: the second would share the first's run directory (and fail on
    its files after the first ran) or repeat its run under another id."""
    from btb_lab.sweep.plan import _label, duplicate_points

    problems = []
    for mine, theirs, why in duplicate_points(loaded.spec):
        field = ".".join(str(p) for p in mine)
        if mine[0] == "grid":
            value = _label(loaded.spec.grid[str(mine[1])][int(mine[2])])
            what, fix = f"value {value} repeats", "list each value once"
        else:
            what, fix = "repeats", "remove one or make them differ"
        problems.append(
            f"{loaded.path}:{loaded.line(*mine)}: {field}: {what} "
            f"{'.'.join(str(p) for p in theirs)} (line {loaded.line(*theirs)}): {why}; {fix}"
        )
    if problems:
        raise ValidationFailed(problems)


def refuse_swept_seed(loaded: LoadedSweep, points: Sequence[Any], flag: str | None) -> None:
    """A sweep seed (`flag`, or the file's `seed:`) goes over every point's overrides: a
    seed the points set themselves would be replaced in each, and their rows would
    differ in label only."""
    for point in points:
        if "seed" in point.overrides:
            where = flag or f"seed: {loaded.spec.seed} at line {loaded.line('seed')}"
            origin = loaded.override_origins(point.labels, point.overrides)["seed"]
            raise UserError(
                f"{origin}: the points set their own seed, and the sweep's seed ({where}) "
                "would replace it in every point; give one or the other"
            )
