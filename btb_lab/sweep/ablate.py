"""The assumption waterfall (`btb-lab ablate`): start from a fidelity profile's rules and
switch them back to btb-lab's causal defaults one at a time, cumulatively, in a documented
order, so the headline's value after every step shows which assumptions carry it.

An ablation is an ordinary sweep: the given sweep's axes (e.g. the six setups) crossed with
a `step` axis whose k-th choice holds the overrides of steps 1..k. It is written to
`<out>/ablation.yaml` and run by the sweep engine (so it resumes, runs with `--jobs` or on
Ray, and leaves one run directory per point); `waterfall.csv`, `waterfall.md` and
`waterfall.png` then give the headline per setup and step, and each step's change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from btb_lab.errors import UserError
from btb_lab.sweep.spec import LoadedSweep, load_sweep
from btb_lab.sweep.table import reduction_column

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "ABLATIONS",
    "AblationStep",
    "ablation_sweep",
    "check_ablation",
    "run_ablation",
    "waterfall_table",
]


@dataclass(frozen=True)
class AblationStep:
    """One assumption switched to the causal default: settings, and router params given to
    every variant whose policy is one of `policies`."""

    label: str
    why: str
    settings: dict[str, Any] = field(default_factory=dict)
    router_params: dict[str, Any] = field(default_factory=dict)
    policies: tuple[str, ...] = ()


_TIES = ("cache_aware", "btb", "early_rdma")
_BTB = ("btb", "early_rdma")

# From the most local rule to the most global one; the last state is btb-lab's defaults.
ABLATIONS: dict[str, list[AblationStep]] = {
    "infer-sim": [
        AblationStep(
            "ties: lowest index",
            "ties go to the lowest index, not a seeded draw",
            router_params={"tie_break": "lowest"},
            policies=_TIES,
        ),
        AblationStep(
            "copies on the RDMA link",
            "a warm copy uses the target's link beside its compute, with a 1 ms setup, "
            "and copies out of one source share its link",
            {
                "sim.warm_copy_blocks_target": False,
                "sim.rdma_egress_shared": True,
                "costs.transfer_setup_ms": 1.0,
            },
        ),
        AblationStep(
            "BTB warms once, routes to the warm set",
            "btb-lab's BTB: one warming per activation; requests may wait on a target for its copy",
            router_params={"recopy": False, "route_active": "warm_set"},
            policies=_BTB,
        ),
        AblationStep(
            "router sees HBM only",
            "a cache-aware match counts HBM, not host RAM",
            {"sim.router_match_tiers": "hbm"},
        ),
        AblationStep(
            "first token from prefill",
            "output_tokens − 1 decode steps after the prefill's token",
            {"sim.decode_steps": "after_first_token"},
        ),
        AblationStep(
            "last prompt token computed",
            "a cache hit spares whole blocks short of the prompt's last token (vLLM)",
            {"sim.prompt_cache_hit": "full_blocks"},
        ),
        AblationStep(
            "output KV not cached",
            "no output blocks enter the prefix cache",
            {"sim.output_blocks_cached": False},
        ),
        AblationStep(
            "memory counted once",
            "the cache gets what admission has not reserved; "
            "cached prefixes are shared (ref-counted)",
            {"sim.prefix_cache_budget": "unreserved", "sim.kv_prefix_sharing": True},
        ),
        AblationStep(
            "host RAM 512 GB",
            "host RAM for KV is bounded per instance",
            {"sim.host_ram_bytes": 512e9},
        ),
        AblationStep(
            "HBM at 0.9",
            "vLLM's gpu_memory_utilization 0.9, not all of HBM",
            {"costs.gpu_memory_utilization": 0.9},
        ),
        AblationStep(
            "admission as prefill starts",
            "a request is admitted when its prefill starts, not all that fit at once",
            {"sim.admission": "serial"},
        ),
        AblationStep(
            "KV visible after prefill",
            "KV is matchable and copyable once computed",
            {"sim.kv_visibility": "after_prefill"},
        ),
        AblationStep(
            "router sees what it routed",
            "the router's approximate tree, not the engines' caches",
            {"sim.router_view": "routed"},
        ),
        AblationStep(
            "windows back to back",
            "one cluster for all windows; caches and queues carry over",
            {"sim.window_replay": "continuous"},
        ),
    ],
}


def _step_overrides(
    steps: list[AblationStep], upto: int, variant_policies: Mapping[str, str]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for step in steps[:upto]:
        out.update(step.settings)
        for variant, policy in variant_policies.items():
            if policy in step.policies:
                for key, value in step.router_params.items():
                    out[f"variants.{variant}.router.params.{key}"] = value
    return out


def _variant_policies(loaded: LoadedSweep) -> dict[str, str]:
    from btb_lab.hypothesis import load_hypothesis

    hyp = load_hypothesis(loaded.base_path, dict(loaded.spec.overrides)).hypothesis
    return {name: v.router.policy for name, v in hyp.variants.items()}


def _ablation_steps(profile: str) -> list[AblationStep]:
    if profile not in ABLATIONS:
        raise UserError(f"--from: {profile!r} has no ablation; choose: {', '.join(ABLATIONS)}")
    return ABLATIONS[profile]


def step_labels(profile: str) -> list[str]:
    steps = _ablation_steps(profile)
    return [f"0 {profile}"] + [f"{k} {s.label}" for k, s in enumerate(steps, start=1)]


def ablation_sweep(
    loaded: LoadedSweep, profile: str, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The sweep document of an ablation of `loaded` from `profile` (a sweep
    `check_ablation` accepted: its other problems are found there, at their lines)."""
    steps = _ablation_steps(profile)
    policies = _variant_policies(loaded)
    labels = step_labels(profile)
    step_axis = {label: _step_overrides(steps, k, policies) for k, label in enumerate(labels)}
    spec = loaded.spec.model_dump(mode="json", exclude_none=True)
    table = spec.get("table", {})
    table.pop("reference", None)
    table.pop("rename", None)
    table["reductions"] = True  # the headline is a reduction column
    return {
        "name": f"{loaded.spec.name}-ablation",
        "description": f"{loaded.spec.name}: the {profile} rules switched to btb-lab's causal "
        "defaults one at a time, cumulatively (btb-lab ablate).",
        "base": str(loaded.base_path),
        "overrides": {**spec.get("overrides", {}), "sim.profile": profile, **(extra or {})},
        "axes": {**spec.get("axes", {}), "step": step_axis},
        "seed": spec.get("seed"),
        "table": table,
    }


def headline_column(loaded: LoadedSweep, baseline: str) -> str:
    """The headline the waterfall follows: the reduction of the first variant besides the
    baseline (of `table.variants`, or of the base hypothesis when the sweep lists none, as
    the table then shows every variant) in the first metric."""
    table = loaded.spec.table
    if table.variants is None:
        names = list(_variant_policies(loaded))
        where = f"{loaded.base_path}: variants"
    else:
        names = list(table.variants)
        where = f"{loaded.path}:{loaded.line('table', 'variants')}: table.variants"
    variants = [v for v in names if v != baseline]
    if not variants:
        raise UserError(
            f"{where}: the waterfall follows a variant's reduction against the baseline "
            f"{baseline!r}; name a variant besides it"
        )
    return reduction_column(variants[0], baseline, table.metrics[0])


def check_ablation(loaded: LoadedSweep, profile: str) -> tuple[str, str]:
    """Everything an ablation of `loaded` needs, checked before any point runs (each
    problem at its line of the sweep file): the setups' one axis, no grid or points (the
    ablation would drop them), a baseline among the table's variants and a headline.
    Returns (headline column, setup axis)."""
    from btb_lab.errors import ValidationFailed
    from btb_lab.sweep.engine import _baseline_name

    _ablation_steps(profile)
    spec, path = loaded.spec, loaded.path
    problems: list[str] = []
    if len(spec.axes) != 1:
        has = f"has {len(spec.axes)}: {', '.join(spec.axes)}" if spec.axes else "has none"
        problems.append(
            f"{path}:{loaded.line('axes')}: axes: an ablation needs exactly one axis (its "
            f"setups, the waterfall's rows); this sweep {has}"
        )
    for key, name in (("grid", "a grid"), ("points", "a points list")):
        if getattr(spec, key):
            problems.append(
                f"{path}:{loaded.line(key)}: {key}: an ablation takes its setups from one "
                f"axis and would drop {name}; make it the axis or top-level `overrides`"
            )
    if "step" in spec.axes:
        problems.append(
            f"{path}:{loaded.line('axes', 'step')}: axes.step: an axis named 'step' is the "
            "ablation's own"
        )
    baseline = _baseline_name(loaded)
    if spec.table.variants is not None and baseline not in spec.table.variants:
        problems.append(
            f"{path}:{loaded.line('table', 'variants')}: table.variants: the waterfall "
            f"follows a reduction against the baseline {baseline!r}, which is not listed"
        )
    headline = ""
    try:
        headline = headline_column(loaded, baseline)
    except UserError as exc:
        problems.append(str(exc))
    if problems:
        raise ValidationFailed(problems)
    return headline, next(iter(spec.axes))


def waterfall_table(df: pd.DataFrame, column: str, labels: list[str], axis: str) -> pd.DataFrame:
    """Setup × step: the headline after each cumulative step; every step a column, a step
    with no value (n/a, or its point failed) an empty one rather than none."""
    wide = df.pivot_table(
        index=axis, columns="step", values=column, aggfunc="first", sort=False, dropna=False
    )
    return wide.reindex(columns=labels)


def _plot(wide: pd.DataFrame, headline: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5.5))
    x = range(len(wide.columns))
    for setup, row in wide.iterrows():
        ax.plot(list(x), row.to_numpy(dtype=float), marker="o", label=str(setup))
    ax.axhline(0.0, color="0.6", linewidth=0.8)
    ax.set_xticks(list(x), [str(c) for c in wide.columns], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(headline)
    ax.set_title("Assumption waterfall: each step switches one more rule to the causal default")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def _markdown(wide: pd.DataFrame, profile: str, headline: str) -> str:
    steps = ABLATIONS[profile]
    lines = [f"# Assumption waterfall from {profile}", "", f"Headline: {headline}.", ""]
    cols = [str(c) for c in wide.columns]
    lines.append("| setup | " + " | ".join(cols) + " |")
    lines.append("|---|" + "---:|" * len(cols))
    for setup, row in wide.iterrows():
        cells = ["–" if math.isnan(v) else f"{v:+.1f}" for v in row.to_numpy(dtype=float)]
        lines.append(f"| {setup} | " + " | ".join(cells) + " |")
    lines += ["", "Steps (cumulative):", ""]
    lines.append(f"0. {profile}: every rule of the profile.")
    lines += [f"{k}. {s.label}: {s.why}." for k, s in enumerate(steps, start=1)]
    return "\n".join(lines) + "\n"


def _check_extra(
    loaded: LoadedSweep, profile: str, extra: Mapping[str, Any], origins: Mapping[str, str]
) -> None:
    """The `--set` overrides on the ablation's first step (the profile's rules), before
    anything is written: a bad one is refused once, blamed on its flag, instead of once
    per point at a line of the ablation.yaml the command writes."""
    from btb_lab.hypothesis import load_hypothesis

    overrides = {**loaded.spec.overrides, "sim.profile": profile, **extra}
    labels = {key: origins.get(key, f"--set {key}") for key in extra}
    load_hypothesis(loaded.base_path, overrides, {"sim.profile": f"--from {profile}", **labels})


def run_ablation(
    sweep_file: Path,
    profile: str,
    *,
    out: Path | None = None,
    jobs: int = 1,
    executor: str | None = None,
    extra: Mapping[str, Any] | None = None,
    origins: Mapping[str, str] | None = None,
    echo: Callable[[str], None] | None = None,
) -> dict[str, Path]:
    """Check the ablation (`check_ablation`), write and run its sweep, then the waterfall
    table and plot (in `out`, by default results/ablations/<sweep name>/)."""
    from btb_lab.sweep.engine import run_sweep

    loaded = load_sweep(sweep_file)
    headline, axis = check_ablation(loaded, profile)
    if extra:
        _check_extra(loaded, profile, extra, origins or {})
    out = out or Path("results") / "ablations" / loaded.spec.name
    doc = ablation_sweep(loaded, profile, extra)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "ablation.yaml"
    path.write_text(
        "# Written by btb-lab ablate; rerun it to resume.\n"
        + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True),
        encoding="utf-8",
    )
    outcome = run_sweep(
        path, jobs=jobs, executor="ray" if executor == "ray" else None, out=out, echo=echo
    )
    if outcome.table is None:
        raise UserError(f"{out}: the ablation wrote no table")
    wide = waterfall_table(outcome.table, headline, step_labels(profile), axis)
    outputs = dict(outcome.outputs)
    outputs["waterfall_csv"] = out / "waterfall.csv"
    wide.to_csv(outputs["waterfall_csv"])
    outputs["waterfall_md"] = out / "waterfall.md"
    outputs["waterfall_md"].write_text(_markdown(wide, profile, headline), encoding="utf-8")
    outputs["waterfall_png"] = out / "waterfall.png"
    _plot(wide, headline, outputs["waterfall_png"])
    return outputs
