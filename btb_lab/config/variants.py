"""The one place a variant's overrides are applied: `resolve_variant` merges a variant's
`sim`, `costs` and `cluster` overrides into the hypothesis's top-level blocks (deeply, so a
variant can change one nested key, e.g. `launch.env.PS`, and keep its siblings), and every
backend reads the result's top-level blocks only."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from btb_lab.config.costs import CostSettings
from btb_lab.config.hypothesis import ClusterSpec, Hypothesis
from btb_lab.config.sim import SimSettings

__all__ = ["deep_merge", "resolve_variant"]


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `over` laid on top: mappings merge key by key, anything else (lists
    included) replaces."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_variant(hypothesis: Hypothesis, variant_name: str) -> Hypothesis:
    """The hypothesis as one variant sees it (raises pydantic's ValidationError when the
    merged blocks are invalid; the loader reports that at validate time)."""
    variant = hypothesis.variants[variant_name]
    update: dict[str, Any] = {}
    if variant.sim:
        update["sim"] = SimSettings.model_validate(
            deep_merge(hypothesis.sim.model_dump(), variant.sim)
        )
    if variant.costs:
        update["costs"] = CostSettings.model_validate(
            deep_merge(hypothesis.costs.model_dump(), variant.costs)
        )
    if variant.cluster:
        update["cluster"] = ClusterSpec.model_validate(
            deep_merge(hypothesis.cluster.model_dump(by_alias=True), variant.cluster)
        )
    if not update:
        return hypothesis
    resolved = hypothesis.model_copy(update=update)
    resolved._aliases = hypothesis.aliases
    resolved._profile_set = hypothesis.profile_settings
    return resolved
