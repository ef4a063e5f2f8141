"""YAML read strictly, keeping the line of every key and list item.

Every YAML input (hypothesis and sweep files, engine profiles, `--set` and `--param`
values) is read here, so each gets the same checks: syntax errors, duplicate keys (YAML
would keep the last one silently), tags such as `!!python/object`, control characters and
alias bombs are refused with `FILE:LINE: …` problems inside a `ValidationFailed`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from btb_lab.errors import UserError, ValidationFailed

__all__ = [
    "MAX_YAML_NODES",
    "PathKey",
    "compose_yaml",
    "dotted",
    "parse_assignments",
    "parse_yaml_value",
]

PathKey = tuple[str | int, ...]
# A YAML file whose aliases expand to more nodes than this is refused before anything walks
# it (a few anchors listing each other nine times expand to hundreds of millions of nodes).
MAX_YAML_NODES = 200_000


def dotted(path: PathKey) -> str:
    """A key path as `a.b.0.c` (`(top level)` for the empty path)."""
    return ".".join(str(p) for p in path) or "(top level)"


def compose_yaml(text: str, path: Path | str) -> tuple[Any, dict[PathKey, int]]:
    """Parse YAML keeping the 1-based line of every key and list item. Refuses, with a
    line-numbered problem, syntax errors, duplicate keys (YAML would keep the last one
    silently) and alias bombs (more than MAX_YAML_NODES nodes once aliases expand)."""
    try:
        loader = yaml.SafeLoader(text)
    except yaml.reader.ReaderError as exc:  # a control character (a binary file?)
        raise ValidationFailed([_reader_problem(exc, text, path)]) from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        _check_expansion(node, path)
        problems: list[str] = []
        lines: dict[PathKey, int] = {(): node.start_mark.line + 1}
        _walk_lines(node, (), lines, problems, path, set())
        if problems:
            raise ValidationFailed(problems)
        data = loader.construct_document(node)
    except yaml.constructor.ConstructorError as exc:  # `!!python/object` and other tags
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = exc.problem or exc.context or "unsupported value"
        raise ValidationFailed([f"{path}:{line}: (YAML): not allowed: {problem}"]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = exc.problem or exc.context or "invalid YAML"
        raise ValidationFailed([f"{path}:{line}: YAML syntax error: {problem}"]) from None
    except RecursionError:  # thousands of nested brackets
        raise ValidationFailed([f"{path}:1: (YAML): nested too deeply"]) from None
    except yaml.reader.ReaderError as exc:
        raise ValidationFailed([_reader_problem(exc, text, path)]) from None
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValidationFailed([f"{path}:1: YAML error: {first}"]) from None
    finally:
        loader.dispose()
    return data, lines


def _reader_problem(exc: yaml.reader.ReaderError, text: str, path: Path | str) -> str:
    line = text.count("\n", 0, exc.position) + 1
    char = f"#x{exc.character:04x}" if isinstance(exc.character, int) else repr(exc.character)
    return f"{path}:{line}: (YAML): unacceptable character {char}: {exc.reason}"


def parse_yaml_value(text: str, label: str) -> Any:
    """One value given on the command line (`--set key=VALUE`, `--param k=VALUE`) read as
    YAML with the same checks as a file: no tags, duplicate keys or alias bombs. A problem
    is a `UserError` starting with `label`."""
    try:
        data, _ = compose_yaml(text, label)
    except ValidationFailed as exc:
        problems = [
            p.replace(f"{label}:1: (top level): ", f"{label}: ", 1).replace(
                f"{label}:1: ", f"{label}: ", 1
            )
            for p in exc.problems
        ]
        raise UserError("\n".join(problems)) from None
    return data


def parse_assignments(flag: str, items: Iterable[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """`flag KEY=VALUE` items (`--set`, `--param`): each value read as YAML with the
    file's checks, and per key the item it came from (`--set KEY=VALUE`, credential
    values redacted), which a problem with the value is blamed on. A key given twice is
    refused, as a YAML file's duplicate key is, rather than the last one winning."""
    from btb_lab.redact import redact_argv

    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"{flag} {item!r}: expected KEY=VALUE")
        label = f"{flag} {redact_argv([f'{key}={raw}'])[0]}"
        if key in values:
            raise UserError(f"{label}: {key} is given already ({origins[key]})")
        values[key] = parse_yaml_value(raw, label)
        origins[key] = label
    return values, origins


def _check_expansion(root: yaml.Node, path: Path | str) -> None:
    """Nodes the document has once every alias is expanded, counted per distinct node; a
    node that contains an alias of itself (`&a [*a]`) expands without end and is refused."""
    sizes: dict[int, int] = {}
    # nodes whose children are being counted: the ancestors of the node popped next
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        children = _children(node)
        if not done and id(node) in open_nodes:
            line = node.start_mark.line + 1
            message = (
                f"{path}:{line}: (YAML): an alias inside the node it names (a recursive "
                "structure); refusing to load"
            )
            raise ValidationFailed([message])
        if done:
            open_nodes.discard(id(node))
            total = 1 + sum(sizes[id(c)] for c in children)
            sizes[id(node)] = total
            if total > MAX_YAML_NODES:
                line = node.start_mark.line + 1
                message = (
                    f"{path}:{line}: (YAML): aliases expand to more than {MAX_YAML_NODES:,} "
                    "nodes; refusing to load (an alias bomb?)"
                )
                raise ValidationFailed([message])
            continue
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _walk_lines(
    node: yaml.Node,
    prefix: PathKey,
    lines: dict[PathKey, int],
    problems: list[str],
    path: Path | str,
    seen: set[int],
) -> None:
    if id(node) in seen:  # an alias of a node already walked: its lines are known
        return
    seen.add(id(node))
    if isinstance(node, yaml.ScalarNode):
        _check_timestamp(node, prefix, problems, path)
    elif isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node)
            line = key_node.start_mark.line + 1
            here = (*prefix, key)
            if isinstance(key_node, yaml.ScalarNode):
                _check_timestamp(key_node, here, problems, path)
            if key in first and key != "<<":
                problems.append(
                    f"{path}:{line}: {dotted(here)}: duplicate key {key!r} "
                    f"(first given at line {first[key]})"
                )
            first.setdefault(key, line)
            lines.setdefault(here, line)
            _walk_lines(value_node, here, lines, problems, path, seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            here = (*prefix, index)
            lines.setdefault(here, item.start_mark.line + 1)
            _walk_lines(item, here, lines, problems, path, seen)


_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"


def _check_timestamp(
    node: yaml.ScalarNode, here: PathKey, problems: list[str], path: Path | str
) -> None:
    """A value YAML reads as a date (`2026-02-30`) must be a real one: PyYAML builds it
    with `datetime`, whose ValueError would otherwise escape as a traceback."""
    if node.tag != _TIMESTAMP_TAG:
        return
    try:
        yaml.constructor.SafeConstructor().construct_yaml_timestamp(node)
    except (ValueError, OverflowError) as exc:
        problems.append(
            f"{path}:{node.start_mark.line + 1}: {dotted(here)}: {node.value!r} reads as a "
            f"date or time but is not one ({exc}); quote it to mean text"
        )
