"""Load a hypothesis file: YAML with line numbers, overrides, strict schema, semantic checks.

Every user mistake becomes one `FILE:LINE: field.path: message` line inside a
`ValidationFailed`, so `btb-lab validate` can print them all at once and never a traceback.
The checks that need a registry (policies and their parameters, model and GPU presets,
workload formats and generators, class names) import those registries statically here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from btb_lab.config.costs import CostSettings, ProfileRef, move_sim_aliases
from btb_lab.config.hypothesis import ClusterSpec, Hypothesis
from btb_lab.config.launch import served_model_of
from btb_lab.config.metrics import METRICS
from btb_lab.config.sim import SimSettings
from btb_lab.config.variants import deep_merge, resolve_variant
from btb_lab.errors import UserError, ValidationFailed
from btb_lab.model.hardware import GPU_PRESETS, MODEL_PRESETS, no_query_width, resolve_model
from btb_lab.model.profile import load_profile
from btb_lab.policies import POLICIES, build_policy
from btb_lab.workload.loader import validate_workload_spec
from btb_lab.yamlio import MAX_YAML_NODES, PathKey, compose_yaml, parse_yaml_value
from btb_lab.yamlio import dotted as _dotted

__all__ = [
    "MAX_YAML_NODES",
    "LoadedHypothesis",
    "apply_overrides",
    "compose_yaml",
    "format_pydantic_errors",
    "load_hypothesis",
    "parse_hypothesis_text",
    "parse_yaml_value",
]


@dataclass
class LoadedHypothesis:
    """A validated hypothesis plus where it came from (relative paths resolve from
    `base_dir`, the hypothesis file's folder)."""

    hypothesis: Hypothesis
    path: Path
    base_dir: Path
    raw_text: str


# ---------------------------------------------------------------------------- overrides


def _coerce_segment(container: Any, segment: str, where: str) -> str | int:
    if isinstance(container, list):
        try:
            return int(segment)
        except ValueError:
            raise UserError(f"{where}: segment {segment!r} must index a list") from None
    return segment


def _dotted_key(node: dict[str, Any], segments: list[str], depth: int) -> tuple[str, int]:
    """The longest run of segments from `depth` that names a key of `node` with dots in it
    (a variant `of_1.5`: `variants.of_1.5.router`), and the index of its last segment; the
    one segment itself when none does."""
    for end in range(len(segments), depth + 1, -1):
        key = ".".join(segments[depth:end])
        if key in node:
            return key, end - 1
    return segments[depth], depth


def apply_overrides(
    data: dict[str, Any],
    overrides: Mapping[str, Any],
    origins: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Return a copy of `data` with dotted-path overrides applied (`a.b.0.c`: integer
    segments index lists); missing mappings along the path are created. `origins` names
    where each override came from (`--set a.b`, `sweep.yaml:12`) for error messages."""
    result = copy.deepcopy(data)
    for dotted, value in overrides.items():
        where = (origins or {}).get(dotted) or f"override {dotted!r}"
        segments = dotted.split(".")
        if not all(segments):
            raise UserError(f"{where}: {dotted!r} has an empty path segment")
        node: Any = result
        depth = 0
        while depth < len(segments):
            raw = segments[depth]
            if isinstance(node, dict):  # the longest key that exists, dots and all
                raw, depth = _dotted_key(node, segments, depth)
            seg = _coerce_segment(node, raw, where)
            last = depth == len(segments) - 1
            depth += 1
            if isinstance(node, list):
                assert isinstance(seg, int)
                if seg < 0:  # errors name fields by their index from 0: so does the path
                    raise UserError(f"{where}: {dotted}: index {seg}: count from 0")
                if seg >= len(node):
                    raise UserError(f"{where}: {dotted}: index {seg} out of range")
                if last:
                    node[seg] = value
                else:
                    node = node[seg]
            elif isinstance(node, dict):
                if last:
                    node[seg] = value
                else:
                    if node.get(seg) is None:
                        node[seg] = {}
                    node = node[seg]
            else:
                raise UserError(f"{where}: {dotted}: {raw!r} is inside a scalar value")
    return result


@dataclass
class _Where:
    """Where a field path was written: `FILE:LINE`, or the override that set it (`--set
    repeats`, `sweep.yaml:14: grid.repeats`) when one did, so a bad override is never
    blamed on a line of the hypothesis file."""

    file: Path | str
    lines: Mapping[PathKey, int]
    overrides: list[tuple[str, str]] = field(default_factory=list)  # (dotted path, origin)

    def __call__(self, path: PathKey) -> str:
        # compared as dotted text, so that a key with dots (variant `of_1.5`) matches
        key = ".".join(str(p) for p in path)
        written = tuple(path) in self.lines
        # the first level along the path the file did not write (an override made it, a
        # variant `variants.new` say, when the override lies under it)
        cut = next(c for c in range(len(path), -1, -1) if c == 0 or tuple(path[:c]) in self.lines)
        made = ".".join(str(p) for p in path[: cut + 1]) if not written else ""
        for prefix, origin in self.overrides:
            # the override set this path, or made it (a key the file does not have)
            if _within(key, prefix) or (made and _within(prefix, made)):
                return origin
        here = f"{self.file}:{_line_for(path, self.lines)}"
        # a check of the whole of something the file wrote and an override changed inside
        inside = [origin for prefix, origin in self.overrides if key and _within(prefix, key)]
        return f"{here} (with {', '.join(inside)})" if inside else here


def _within(path: str, prefix: str) -> bool:
    """Whether dotted `path` is `prefix` or lies under it."""
    return path == prefix or path.startswith(prefix + ".")


def _where(
    file: Path | str,
    lines: Mapping[PathKey, int],
    overrides: Mapping[str, Any] | None,
    origins: Mapping[str, str] | None,
) -> _Where:
    pairs = [
        (dotted, (origins or {}).get(dotted) or f"override {dotted}") for dotted in overrides or {}
    ]
    pairs.sort(key=lambda pair: -pair[0].count("."))  # the most specific override first
    return _Where(file, lines, pairs)


# ---------------------------------------------------------------------------- error formatting


def _locate(data: Any, loc: Iterable[str | int]) -> tuple[PathKey, bool]:
    """Map a pydantic error location onto the data path, dropping union-member tags
    (`str`, `ModelShape`, `function-after[...]`). Returns (path, fully_resolved)."""
    path: list[str | int] = []
    node = data
    resolved = True
    for part in loc:
        in_dict = isinstance(node, dict) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if in_dict or in_list:
            path.append(part)
            node = node[part]
        elif isinstance(node, dict) and isinstance(part, str) and not _is_union_tag(part):
            path.append(part)  # a missing or unknown key: name it, line from its parent
            resolved = False
            node = None
        elif isinstance(part, int):
            path.append(part)
            node = None
        # else: a union-member tag; skip
    return tuple(path), resolved


def _is_union_tag(part: str) -> bool:
    return part[:1].isupper() or "[" in part or part in {"str", "int", "float", "bool"}


def _line_for(path: PathKey, lines: Mapping[PathKey, int]) -> int:
    for cut in range(len(path), -1, -1):
        if path[:cut] in lines:
            return lines[path[:cut]]
    return 1


def format_pydantic_errors(
    exc: ValidationError,
    *,
    file: Path | str,
    data: Any,
    lines: Mapping[PathKey, int],
    prefix: PathKey = (),
    where: Callable[[PathKey], str] | None = None,
) -> list[str]:
    """One `FILE:LINE: field.path: message` line per pydantic error. `prefix` places the
    validated object inside the file (e.g. a variant's `sim` overrides); `where` says
    where a path was written (default: its line in `file`)."""
    locate = where or _Where(file, lines)
    problems: list[str] = []
    seen: set[str] = set()
    for err in exc.errors():
        sub: Any = data
        for part in prefix:
            if isinstance(sub, dict):
                sub = sub.get(part)
            elif isinstance(sub, list) and isinstance(part, int) and 0 <= part < len(sub):
                sub = sub[part]
            else:
                sub = None
        path, _ = _locate(sub, err["loc"])
        full = (*prefix, *path)
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = f"unknown key {path[-1]!r} (misspelled?)" if path else message
        elif err["type"] == "missing":
            message = "required field is missing"
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        line = f"{locate(full)}: {_dotted(full)}: {message}"
        if line not in seen:
            seen.add(line)
            problems.append(line)
    return problems


# ---------------------------------------------------------------------------- semantic checks


def _move_aliases(
    data: dict[str, Any], lines: dict[PathKey, int], file: Path, where: _Where
) -> list[str]:
    """`sim.<cost parameter>` → `costs.<parameter>` (also inside variants), keeping each
    moved key's line so a bad value is still reported where it was written."""
    notes: list[str] = []

    def move(block: dict[str, Any], prefix: PathKey) -> None:
        sim_keys = dict(block["sim"]) if isinstance(block.get("sim"), dict) else {}
        dotted = "".join(f"{p}." for p in prefix)
        try:
            found = move_sim_aliases(block, where=dotted)
        except ValueError as exc:
            raise ValidationFailed([f"{where((*prefix, 'sim'))}: {dotted}sim: {exc}"]) from None
        for key in sim_keys:
            if key not in block["sim"]:
                lines.setdefault((*prefix, "costs", key), _line_for((*prefix, "sim", key), lines))
        notes.extend(found)

    move(data, ())
    variants = data.get("variants")
    if isinstance(variants, dict):
        for name, variant in variants.items():
            if isinstance(variant, dict):
                variants[name] = variant = dict(variant)
                move(variant, ("variants", name))
    return notes


def _instances_that_do_not_fit(hyp: Hypothesis) -> dict[PathKey, str]:
    """Per cluster block (the top level's, or a variant's own instances), why its model
    does not fit an instance or leaves it no KV, as the simulator would say at its run."""
    from btb_lab.model.hardware import build_instances

    out: dict[PathKey, str] = {}
    for name, variant in hyp.variants.items():
        resolved = resolve_variant(hyp, name)
        own = "instances" in variant.cluster
        path: PathKey = ("variants", name, "cluster", "instances") if own else (
            "cluster", "instances")  # fmt: skip
        memory = resolved.costs.gpu_memory_utilization
        try:
            build_instances(resolve_model(resolved.model), resolved.cluster,
                            gpu_memory_utilization=memory)  # fmt: skip
        except UserError as exc:
            out.setdefault(path, str(exc))
    return out


def _slowdowns_without_connector(hyp: Hypothesis) -> dict[PathKey, list[str]]:
    """Where `sim.connector_decode_slowdown` is set for variants that run no connector:
    the slowdown is the connector's, so it would change nothing. A top-level slowdown is
    for the variants that run one (H1's baseline runs without), so it is refused only
    when none does."""
    resolved = {name: resolve_variant(hyp, name) for name in hyp.variants}
    bare = [n for n, r in resolved.items() if r.cluster.kv_connector.type == "none"]
    out: dict[PathKey, list[str]] = {}
    for name in bare:
        if resolved[name].sim.connector_decode_slowdown <= 0:
            continue
        if "connector_decode_slowdown" in hyp.variants[name].sim:
            out[("variants", name, "sim", "connector_decode_slowdown")] = [f"variant {name}"]
        elif len(bare) == len(resolved):
            out.setdefault(("sim", "connector_decode_slowdown"), []).append(f"variant {name}")
    return out


def _variant_block_problems(
    hyp: Hypothesis, *, file: Path, data: dict[str, Any], lines: Mapping[PathKey, int],
    where: _Where,
) -> list[str]:  # fmt: skip
    """Each variant's `sim`, `costs` and `cluster` overrides merged into the top-level block
    and validated, so a bad override is reported at its own line."""
    problems: list[str] = []
    blocks: tuple[tuple[str, BaseModel, type[BaseModel]], ...] = (
        ("sim", hyp.sim, SimSettings),
        ("costs", hyp.costs, CostSettings),
        ("cluster", hyp.cluster, ClusterSpec),
    )
    for vname, variant in hyp.variants.items():
        for block, base, model in blocks:
            over = getattr(variant, block)
            if not over:
                continue
            try:
                model.model_validate(deep_merge(base.model_dump(by_alias=True), over))
            except ValidationError as exc:
                problems += format_pydantic_errors(
                    exc, file=file, data=data, lines=lines, prefix=("variants", vname, block),
                    where=where,
                )  # fmt: skip
    return problems


def _semantic_problems(
    hyp: Hypothesis, *, file: Path, data: dict[str, Any], lines: Mapping[PathKey, int],
    base_dir: Path, where: _Where,
) -> list[str]:  # fmt: skip
    problems: list[str] = []

    def add(path: PathKey, message: str) -> None:
        problems.append(f"{where(path)}: {_dotted(path)}: {message}")

    if hyp.backend == "cluster":
        try:
            served_model_of(hyp.cluster.launch, hyp.model)
        except ValueError as exc:
            add(("cluster", "launch", "served_model"), str(exc))

    # policies and their parameters
    for name, variant in hyp.variants.items():
        policy_path: PathKey = ("variants", name, "router", "policy")
        if variant.router.policy not in POLICIES:
            add(policy_path, f"unknown policy {variant.router.policy!r}; choose one of: "
                + ", ".join(POLICIES.names()))  # fmt: skip
            continue
        refusal = POLICIES.get(variant.router.policy).cluster_refusal
        if refusal is not None and hyp.backend == "cluster":
            add(policy_path, f"{refusal}; run it with backend: sim")
        try:
            build_policy(variant.router.policy, variant.router.params, seed=hyp.seed)
        except ValidationError as exc:
            problems += format_pydantic_errors(
                exc, file=file, data=data, lines=lines,
                prefix=("variants", name, "router", "params"), where=where,
            )  # fmt: skip
        except UserError as exc:
            add(policy_path, str(exc))

    # variant overrides of sim / costs / cluster
    block_problems = _variant_block_problems(hyp, file=file, data=data, lines=lines, where=where)
    problems += block_problems
    if not block_problems:  # the roles a policy routes every request to, in its cluster
        for name, variant in hyp.variants.items():
            if variant.router.policy not in POLICIES:
                continue
            roles = {group.role for group in resolve_variant(hyp, name).cluster.instances}
            for role in POLICIES.get(variant.router.policy).needs_roles:
                if role not in roles:
                    add(("variants", name, "router", "policy"),
                        f"policy {variant.router.policy!r} needs at least one instance with "
                        f"role {role} in cluster.instances")  # fmt: skip
        for where_set, names in _slowdowns_without_connector(hyp).items():
            add(where_set, f"{', '.join(names)} run{'s' if len(names) == 1 else ''} no KV "
                "connector (cluster.kv_connector.type: none), so no decode is slowed by one; "
                "give a connector or leave this at 0")  # fmt: skip

    # cost profiles (top level and per variant), read and checked now, not at run time
    profiles: list[tuple[PathKey, Any]] = [(("costs",), hyp.costs.model)]
    if not block_problems:
        profiles += [
            (("variants", vname, "costs"), CostSettings.model_validate(
                deep_merge(hyp.costs.model_dump(), variant.costs)).model)
            for vname, variant in hyp.variants.items() if "model" in variant.costs
        ]  # fmt: skip
    for path, chosen in profiles:
        if isinstance(chosen, ProfileRef):
            profile_path = Path(chosen.profile)
            try:
                load_profile(
                    profile_path if profile_path.is_absolute() else base_dir / profile_path
                )
            except UserError as exc:
                add((*path, "model", "profile"), str(exc))

    # model and GPU presets (the top-level cluster and every variant's own)
    if isinstance(hyp.model, str) and hyp.model.lower() not in MODEL_PRESETS:
        add(("model",), f"unknown model preset {hyp.model!r}; choose one of: "
            + ", ".join(sorted(MODEL_PRESETS)) + " (or give an explicit shape)")  # fmt: skip
    groups: list[tuple[PathKey, Any]] = [
        (("cluster", "instances", i), g) for i, g in enumerate(hyp.cluster.instances)
    ]
    if not block_problems:
        for vname, variant in hyp.variants.items():
            if "instances" in variant.cluster:
                cluster = ClusterSpec.model_validate(
                    deep_merge(hyp.cluster.model_dump(by_alias=True), variant.cluster)
                )
                groups += [
                    (("variants", vname, "cluster", "instances", i), g)
                    for i, g in enumerate(cluster.instances)
                ]
    # the roofline's prefill attention term needs the model's query width
    attention: list[PathKey] = [("costs", "prefill_attention")] * hyp.costs.prefill_attention
    attention += [
        ("variants", vname, "costs", "prefill_attention")
        for vname, variant in hyp.variants.items()
        if variant.costs.get("prefill_attention") is True
    ]
    if attention and (not isinstance(hyp.model, str) or hyp.model.lower() in MODEL_PRESETS):
        model = resolve_model(hyp.model)
        if model.query_width is None:
            for path in attention:
                add(path, no_query_width(model))
    gpu_names = {name.lower() for name in GPU_PRESETS}
    for path, group in groups:
        if group.gpu.lower() not in gpu_names:
            add((*path, "gpu"), f"unknown GPU preset {group.gpu!r}; choose one of: "
                + ", ".join(GPU_PRESETS))  # fmt: skip
    if hyp.backend == "sim" and not problems and not block_problems:
        for path, text in _instances_that_do_not_fit(hyp).items():  # found here, not mid-run
            add(path, text)

    # workload: trace file relative to the hypothesis, formats, generator parameters
    try:
        validate_workload_spec(hyp.workload, base_dir)
    except ValidationFailed as exc:
        for text in exc.problems:
            head, sep, rest = text.partition(": ")
            if sep and head.startswith("workload.") and " " not in head:
                add(tuple(int(p) if p.isdigit() else p for p in head.split(".")), rest)
            else:
                add(("workload",), text)

    # metrics (config.metrics) and the class names the verdict rule uses
    class_names = [rule.name for rule in hyp.classes]
    rule = hyp.verdict
    scoped: list[tuple[PathKey, str, str | None]] = [(("verdict",), rule.metric, rule.klass)]
    scoped += [(("verdict", "guards", i), g.metric, g.klass) for i, g in enumerate(rule.guards)]
    for path, metric, klass in scoped:
        if metric not in METRICS:
            add((*path, "metric"), f"unknown metric {metric!r}; choose one of: "
                + ", ".join(METRICS))  # fmt: skip
        elif klass is not None and METRICS[metric].level != "request":
            add((*path, "class"), f"metric {metric!r} cannot be restricted to a class")
    if rule.klass is not None and rule.klass not in class_names:
        add(("verdict", "class"), _unknown_class(rule.klass, class_names))
    for i, klass in enumerate(rule.per_class):
        if klass not in class_names:
            add(("verdict", "per_class", i), _unknown_class(klass, class_names))
    if rule.per_class and rule.metric in METRICS and METRICS[rule.metric].level != "request":
        add(("verdict", "per_class"), f"metric {rule.metric!r} cannot be restricted to a class "
            "(per-class checks would repeat the whole run's value)")  # fmt: skip
    for i, guard in enumerate(rule.guards):
        if guard.klass is not None and guard.klass not in class_names:
            add(("verdict", "guards", i, "class"), _unknown_class(guard.klass, class_names))
    return problems


def _unknown_class(name: str, class_names: list[str]) -> str:
    if not class_names:
        return f"unknown class {name!r}: the hypothesis declares no `classes`"
    return f"unknown class {name!r}; choose one of: " + ", ".join(class_names)


# ---------------------------------------------------------------------------- entry points


def parse_hypothesis_text(
    text: str,
    *,
    file: Path,
    base_dir: Path,
    overrides: Mapping[str, Any] | None = None,
    origins: Mapping[str, str] | None = None,
) -> Hypothesis:
    """Validate hypothesis YAML text; raise `ValidationFailed` listing every problem.
    `origins` names where each override came from, for its error messages."""
    data, lines = compose_yaml(text, file)
    if not isinstance(data, dict):
        raise ValidationFailed([f"{file}:1: (top level): expected a mapping of hypothesis fields"])
    if overrides:
        data = apply_overrides(data, overrides, origins)
    where = _where(file, lines, overrides, origins)
    notes = _move_aliases(data, lines, file, where)
    try:
        hyp = Hypothesis.model_validate(data)
    except ValidationError as exc:
        raise ValidationFailed(
            format_pydantic_errors(exc, file=file, data=data, lines=lines, where=where)
        ) from None
    hyp._aliases = notes
    problems = _semantic_problems(
        hyp, file=file, data=data, lines=lines, base_dir=base_dir, where=where
    )
    if problems:
        raise ValidationFailed(problems)
    return hyp


def load_hypothesis(
    path: Path,
    overrides: dict[str, Any] | None = None,
    origins: Mapping[str, str] | None = None,
) -> LoadedHypothesis:
    """Read, override, validate and check a hypothesis file. `origins` maps each override
    key to where it was given (`--set repeats`), named instead of a line of the file when
    that override is what is wrong."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such hypothesis file") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, not a hypothesis file") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text (UTF-8) file") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None
    base_dir = path.resolve().parent
    hyp = parse_hypothesis_text(
        text, file=path, base_dir=base_dir, overrides=overrides, origins=origins
    )
    return LoadedHypothesis(hypothesis=hyp, path=path, base_dir=base_dir, raw_text=text)
