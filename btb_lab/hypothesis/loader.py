"""Load a hypothesis file: YAML with line numbers, overrides, strict schema, semantic checks.

Every user mistake becomes one `FILE:LINE: field.path: message` line inside a
`ValidationFailed`, so `btb-lab validate` can print them all at once and never a traceback.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from btb_lab.errors import UserError, ValidationFailed
from btb_lab.hypothesis.schema import ClusterSpec, Hypothesis
from btb_lab.sim.settings import SimSettings

__all__ = [
    "LoadedHypothesis",
    "apply_overrides",
    "format_pydantic_errors",
    "load_hypothesis",
    "parse_hypothesis_text",
    "resolve_variant",
]

PathKey = tuple[str | int, ...]


@dataclass
class LoadedHypothesis:
    """A validated hypothesis plus where it came from (relative paths resolve from
    `base_dir`, the hypothesis file's folder)."""

    hypothesis: Hypothesis
    path: Path
    base_dir: Path
    raw_text: str


# ---------------------------------------------------------------------------- YAML + lines


def _compose(text: str, path: Path) -> tuple[Any, dict[PathKey, int]]:
    """Parse YAML keeping the 1-based line of every key and list item."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = exc.problem or exc.context or "invalid YAML"
        raise ValidationFailed([f"{path}:{line}: YAML syntax error: {problem}"]) from None
    except yaml.YAMLError as exc:
        raise ValidationFailed([f"{path}:1: YAML error: {exc}"]) from None
    finally:
        loader.dispose()
    lines: dict[PathKey, int] = {(): node.start_mark.line + 1}
    _walk_lines(node, (), lines)
    return data, lines


def _walk_lines(node: yaml.Node, prefix: PathKey, lines: dict[PathKey, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node)
            here = (*prefix, key)
            lines[here] = key_node.start_mark.line + 1
            _walk_lines(value_node, here, lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            here = (*prefix, index)
            lines[here] = item.start_mark.line + 1
            _walk_lines(item, here, lines)


# ---------------------------------------------------------------------------- overrides


def _coerce_segment(container: Any, segment: str) -> str | int:
    if isinstance(container, list):
        try:
            return int(segment)
        except ValueError:
            raise UserError(f"override segment {segment!r} must index a list") from None
    return segment


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Return a copy of `data` with dotted-path overrides applied (`a.b.0.c`: integer
    segments index lists); missing mappings along the path are created."""
    result = copy.deepcopy(data)
    for dotted, value in overrides.items():
        segments = dotted.split(".")
        node: Any = result
        for depth, raw in enumerate(segments):
            seg = _coerce_segment(node, raw)
            last = depth == len(segments) - 1
            if isinstance(node, list):
                assert isinstance(seg, int)
                if not -len(node) <= seg < len(node):
                    raise UserError(f"override {dotted!r}: index {seg} out of range")
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
                raise UserError(f"override {dotted!r}: {raw!r} is inside a scalar value")
    return result


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


def _dotted(path: PathKey) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def format_pydantic_errors(
    exc: ValidationError,
    *,
    file: Path | str,
    data: Any,
    lines: Mapping[PathKey, int],
    prefix: PathKey = (),
) -> list[str]:
    """One `FILE:LINE: field.path: message` line per pydantic error. `prefix` places the
    validated object inside the file (e.g. a variant's `sim` overrides)."""
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
        line = f"{file}:{_line_for(full, lines)}: {_dotted(full)}: {message}"
        if line not in seen:
            seen.add(line)
            problems.append(line)
    return problems


# ---------------------------------------------------------------------------- semantic checks


def _optional_module(name: str) -> Any | None:
    """Import a module another part of the package provides, or None if it is absent."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            return None
        raise


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_variant(hypothesis: Hypothesis, variant_name: str) -> Hypothesis:
    """The hypothesis as one variant sees it: its `sim` and `cluster` overrides merged
    into the top-level blocks (so a backend reads `hypothesis.sim` and is done)."""
    variant = hypothesis.variants[variant_name]
    if not variant.sim and not variant.cluster:
        return hypothesis
    update: dict[str, Any] = {}
    if variant.sim:
        merged = _deep_merge(hypothesis.sim.model_dump(), variant.sim)
        update["sim"] = SimSettings.model_validate(merged)
    if variant.cluster:
        merged = _deep_merge(hypothesis.cluster.model_dump(by_alias=True), variant.cluster)
        update["cluster"] = ClusterSpec.model_validate(merged)
    return hypothesis.model_copy(update=update)


def _names(collection: Any) -> list[str]:
    if hasattr(collection, "names"):
        return list(collection.names())
    return sorted(str(k) for k in collection)


def _semantic_problems(
    hyp: Hypothesis, *, file: Path, data: dict[str, Any], lines: Mapping[PathKey, int],
    base_dir: Path,
) -> list[str]:  # fmt: skip
    problems: list[str] = []

    def add(path: PathKey, message: str) -> None:
        problems.append(f"{file}:{_line_for(path, lines)}: {_dotted(path)}: {message}")

    # policies and their parameters
    policies_mod = _optional_module("btb_lab.policies")
    registry = getattr(policies_mod, "POLICIES", None)
    if registry is not None and list(registry):
        from btb_lab.policies.base import build_policy

        for name, variant in hyp.variants.items():
            policy_path: PathKey = ("variants", name, "router", "policy")
            if variant.router.policy not in registry:
                add(
                    policy_path,
                    f"unknown policy {variant.router.policy!r}; choose one of: "
                    + ", ".join(registry.names()),
                )
                continue
            try:
                build_policy(variant.router.policy, variant.router.params, seed=hyp.seed)
            except ValidationError as exc:
                problems += format_pydantic_errors(
                    exc, file=file, data=data, lines=lines,
                    prefix=("variants", name, "router", "params"),
                )  # fmt: skip
            except UserError as exc:
                add(policy_path, str(exc))

    # model and GPU presets
    hardware = _optional_module("btb_lab.sim.hardware")
    if hardware is not None:
        models = getattr(hardware, "MODEL_PRESETS", None)
        if models is not None and isinstance(hyp.model, str) and hyp.model not in models:
            add(("model",), f"unknown model preset {hyp.model!r}; choose one of: "
                + ", ".join(_names(models)) + " (or give an explicit shape)")  # fmt: skip
        gpus = getattr(hardware, "GPU_PRESETS", None)
        if gpus is not None:
            groups: list[tuple[PathKey, Any]] = [
                (("cluster", "instances", i), g) for i, g in enumerate(hyp.cluster.instances)
            ]
            for vname in hyp.variants:
                try:
                    resolved = resolve_variant(hyp, vname)
                except ValidationError:
                    continue  # reported below
                if hyp.variants[vname].cluster:
                    groups += [
                        (("variants", vname, "cluster", "instances", i), g)
                        for i, g in enumerate(resolved.cluster.instances)
                    ]
            for path, group in groups:
                if group.gpu not in gpus:
                    add((*path, "gpu"), f"unknown GPU preset {group.gpu!r}; choose one of: "
                        + ", ".join(_names(gpus)))  # fmt: skip

    # variant overrides of sim / cluster
    for vname, variant in hyp.variants.items():
        if variant.sim:
            try:
                SimSettings.model_validate(_deep_merge(hyp.sim.model_dump(), variant.sim))
            except ValidationError as exc:
                problems += format_pydantic_errors(
                    exc, file=file, data=data, lines=lines, prefix=("variants", vname, "sim")
                )
        if variant.cluster:
            try:
                ClusterSpec.model_validate(
                    _deep_merge(hyp.cluster.model_dump(by_alias=True), variant.cluster)
                )
            except ValidationError as exc:
                problems += format_pydantic_errors(
                    exc, file=file, data=data, lines=lines, prefix=("variants", vname, "cluster")
                )

    # workload: trace file relative to the hypothesis, generator parameters
    trace = hyp.workload.trace
    trace_missing = False
    if trace is not None:
        trace_path = Path(trace.path)
        if not trace_path.is_absolute():
            trace_path = base_dir / trace_path
        if not trace_path.is_file():
            trace_missing = True
            add(("workload", "trace", "path"), f"trace file not found: {trace_path}")
    workload_mod = _optional_module("btb_lab.workload")
    validate_spec = getattr(workload_mod, "validate_workload_spec", None)
    if validate_spec is not None and not trace_missing:
        try:
            found = validate_spec(hyp.workload, base_dir)
        except ValidationFailed as exc:
            found = exc.problems
        except UserError as exc:
            found = [str(exc)]
        except ValidationError as exc:
            found = format_pydantic_errors(
                exc, file=file, data=data, lines=lines,
                prefix=("workload", "generator", "params") if hyp.workload.generator else
                ("workload",),
            )  # fmt: skip
        for message in found or []:
            text = str(message)
            head, sep, rest = text.partition(": ")
            if text.startswith(f"{file}:"):
                problems.append(text)
            elif sep and head.startswith("workload.") and " " not in head:
                path = tuple(int(p) if p.isdigit() else p for p in head.split("."))
                add(path, rest)
            else:
                add(("workload",), text)

    # class rules: numbers for numeric fields, equality only for text fields
    from btb_lab.analysis.classes import NUMERIC_FIELDS
    from btb_lab.analysis.metrics import METRIC_NAMES, REQUEST_METRIC_NAMES

    for i, class_rule in enumerate(hyp.classes):
        for j, cond in enumerate(class_rule.when):
            where: PathKey = ("classes", i, "when", j)
            if cond.field in NUMERIC_FIELDS and isinstance(cond.value, str):
                add((*where, "value"), f"{cond.field} compares with a number, got {cond.value!r}")
            elif cond.field not in NUMERIC_FIELDS and cond.op not in ("==", "!="):
                add((*where, "op"), f"{cond.field} is text: use '==' or '!=' (got {cond.op!r})")

    # verdict metrics and classes

    class_names = [rule.name for rule in hyp.classes]
    rule = hyp.verdict
    if rule.metric not in METRIC_NAMES:
        add(("verdict", "metric"), f"unknown metric {rule.metric!r}; choose one of: "
            + ", ".join(METRIC_NAMES))  # fmt: skip
    elif rule.klass is not None and rule.metric not in REQUEST_METRIC_NAMES:
        add(("verdict", "class"), f"metric {rule.metric!r} cannot be restricted to a class")
    if rule.klass is not None and rule.klass not in class_names:
        add(("verdict", "class"), _unknown_class(rule.klass, class_names))
    for i, klass in enumerate(rule.per_class):
        if klass not in class_names:
            add(("verdict", "per_class", i), _unknown_class(klass, class_names))
    for i, guard in enumerate(rule.guards):
        if guard.metric not in METRIC_NAMES:
            add(("verdict", "guards", i, "metric"), f"unknown metric {guard.metric!r}; "
                "choose one of: " + ", ".join(METRIC_NAMES))  # fmt: skip
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
) -> Hypothesis:
    """Validate hypothesis YAML text; raise `ValidationFailed` listing every problem."""
    data, lines = _compose(text, file)
    if not isinstance(data, dict):
        raise ValidationFailed([f"{file}:1: (top level): expected a mapping of hypothesis fields"])
    if overrides:
        data = apply_overrides(data, overrides)
    try:
        hyp = Hypothesis.model_validate(data)
    except ValidationError as exc:
        raise ValidationFailed(
            format_pydantic_errors(exc, file=file, data=data, lines=lines)
        ) from None
    problems = _semantic_problems(hyp, file=file, data=data, lines=lines, base_dir=base_dir)
    if problems:
        raise ValidationFailed(problems)
    return hyp


def load_hypothesis(path: Path, overrides: dict[str, Any] | None = None) -> LoadedHypothesis:
    """Read, override, validate and check a hypothesis file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such hypothesis file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read: {exc}") from None
    base_dir = path.resolve().parent
    hyp = parse_hypothesis_text(text, file=path, base_dir=base_dir, overrides=overrides)
    return LoadedHypothesis(hypothesis=hyp, path=path, base_dir=base_dir, raw_text=text)
