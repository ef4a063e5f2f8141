"""The package's shape: data flows one way between stages, and modules stay readable.

Every `import btb_lab.…` in every module (top level, inside functions, under
TYPE_CHECKING) is a dependency; each stage may depend only on the stages listed for it.
The direction (STYLE.md, config/__init__.py): config ← workload, model, policies ←
hypothesis, sim, cluster ← runner ← sweep ← cli; records ← results ← analysis ← report.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "btb_lab"
# the data contracts and helpers every stage shares (records.py, events.py)
# shared by every stage: errors, the registry helper, the record types, and the small
# utilities every layer needs (strict YAML reading, credential redaction, Ctrl-C handling,
# the cyclic garbage collector kept off loaded and simulated objects, safe forks)
BASE = {
    "errors", "registry", "records", "events", "btb_lab", "yamlio", "redact", "interrupts",
    "collector", "forks",
}  # fmt: skip

# stage -> stages it may import (besides itself and BASE)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "registry": {"errors"},
    "records": set(),
    "events": set(),
    "btb_lab": set(),
    "yamlio": {"errors"},
    "redact": set(),
    "interrupts": set(),
    "collector": set(),
    "forks": set(),
    # forked workers for a repeat's variants (the runner's; it knows no stage)
    "workers": set(),
    "config": set(),
    "workload": {"config"},
    "model": {"config"},
    "policies": {"config"},
    "hypothesis": {"config", "workload", "model", "policies"},
    "backends": {"config", "model"},
    "results": {"config"},
    "sim": {"config", "model", "policies", "workload", "backends"},
    "cluster": {"config", "model", "policies", "workload", "backends"},
    "analysis": {"config", "results"},
    "report": {"config", "results", "analysis"},
    "runner": {
        "config", "workload", "model", "policies", "hypothesis", "backends", "results",
        "sim", "cluster", "analysis", "report", "workers",
    },
    # calibrate measures a real engine (cluster) or, where none can be measured, fits a
    # profile to published figures against simulator runs (sim, with the runner's seeds)
    "calibrate": {
        "config", "model", "workload", "policies", "hypothesis", "cluster", "sim", "runner",
    },
    "crosscheck": {
        "config", "workload", "model", "policies", "hypothesis", "backends", "results",
        "sim", "cluster", "analysis", "report", "runner", "calibrate",
    },
    "sweep": {
        "config", "workload", "model", "policies", "hypothesis", "backends", "results",
        "analysis", "report", "runner", "workers",
    },
    "cli": {
        "config", "workload", "model", "policies", "hypothesis", "backends", "results",
        "sim", "cluster", "analysis", "report", "runner", "sweep", "calibrate", "crosscheck",
    },
}  # fmt: skip

MAX_LINES = 600
LONG_REASON = "This module is long because"


def stage_of(module_path: Path) -> str:
    rel = module_path.relative_to(PACKAGE)
    if rel.parts[0] == "__init__.py":
        return "btb_lab"
    return rel.parts[0].removesuffix(".py")


def imported_stages(module_path: Path) -> set[tuple[str, int]]:
    tree = ast.parse(module_path.read_text(encoding="utf-8"))
    found: set[tuple[str, int]] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "btb_lab":  # `from btb_lab import x`: a submodule or an attribute
                names = [
                    f"btb_lab.{a.name}" if _is_submodule(a.name) else "btb_lab" for a in node.names
                ]
        for name in names:
            parts = name.split(".")
            if parts[0] == "btb_lab":
                found.add((parts[1] if len(parts) > 1 else "btb_lab", line))
    return found


def _is_submodule(name: str) -> bool:
    return (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_stage_is_declared() -> None:
    stages = {stage_of(p) for p in MODULES}
    assert stages <= set(ALLOWED), f"new stage(s) without import rules: {stages - set(ALLOWED)}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_flow_one_way(path: Path) -> None:
    stage = stage_of(path)
    allowed = ALLOWED[stage] | BASE | {stage}
    wrong = sorted((s, line) for s, line in imported_stages(path) if s not in allowed)
    assert not wrong, f"{path.relative_to(PACKAGE)} ({stage}) imports " + ", ".join(
        f"{s} (line {line})" for s, line in wrong
    )


def test_the_rules_themselves_have_no_cycle() -> None:
    """A stage never (transitively) depends on itself."""

    def reach(stage: str, seen: set[str]) -> set[str]:
        for dep in ALLOWED[stage]:
            if dep not in seen:
                seen.add(dep)
                reach(dep, seen)
        return seen

    for stage in ALLOWED:
        assert stage not in reach(stage, set()), stage


def test_sim_and_cluster_never_import_each_other() -> None:
    assert "cluster" not in ALLOWED["sim"]
    assert "sim" not in ALLOWED["cluster"]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_long_modules_say_why(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    if text.count("\n") <= MAX_LINES:
        return
    doc = ast.get_docstring(ast.parse(text)) or ""
    assert LONG_REASON in doc, (
        f"{path.relative_to(PACKAGE)} has {text.count(chr(10))} lines: split it, or say at its "
        f"top why not ('{LONG_REASON} …')"
    )


# The simulator's own layers, top to bottom: each module imports only modules below it
# (engine.py's docstring). Modules on one line are independent of each other.
SIM_LAYERS: list[set[str]] = [
    {"bench"},
    {"backend"},
    {"engine"},
    {"steps"},
    {"actions"},
    {"transfers"},
    {"scheduler"},
    {"instance"},
    {"cache", "decode", "jobs"},
]


def test_sim_modules_are_all_layered() -> None:
    names = {p.stem for p in (PACKAGE / "sim").glob("*.py")} - {"__init__"}
    layered = set().union(*SIM_LAYERS)
    assert names == layered, f"sim modules without a layer: {names - layered}"


@pytest.mark.parametrize("name", sorted(set().union(*SIM_LAYERS)))
def test_sim_layers_import_downwards(name: str) -> None:
    rank = {m: i for i, layer in enumerate(SIM_LAYERS) for m in layer}
    tree = ast.parse((PACKAGE / "sim" / f"{name}.py").read_text(encoding="utf-8"))
    used = {
        node.module.split(".")[2]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module
        and node.module.startswith("btb_lab.sim.")
    }
    upward = sorted(m for m in used if rank[m] <= rank[name])
    assert not upward, f"sim/{name}.py imports sim.{', sim.'.join(upward)} (same or higher layer)"
