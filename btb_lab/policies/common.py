"""Selection helpers every policy family shares: which instances serve, and the explicit
tie-break rules that keep routing deterministic: the lowest index by default, or a draw
from the policy's own seeded stream (`tie_break: random`, the seed simulator's rule).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypeVar

from btb_lab.config.base import StrictModel
from btb_lab.errors import UserError
from btb_lab.policies.base import ClusterView, InstanceLoad

__all__ = [
    "cached_tokens",
    "is_imbalanced",
    "least_load",
    "least_outstanding",
    "pick_tie",
    "prefill_service",
    "require_params",
    "serving",
]

P = TypeVar("P", bound=StrictModel)


def require_params(params: StrictModel, cls: type[P]) -> P:
    """Narrow a policy's params to its own model (a wrong type is a programming error)."""
    if not isinstance(params, cls):
        raise TypeError(f"expected {cls.__name__}, got {type(params).__name__}")
    return params


def serving(view: ClusterView) -> list[InstanceLoad]:
    """Instances that take whole requests: the C-role ones. A cluster without any C
    instance is served by all of them, so simple policies still work on odd layouts."""
    instances = view.instances
    colocated = [inst for inst in instances if inst.role == "C"]
    if colocated:
        return colocated
    if not instances:
        raise UserError("the cluster has no instances to route to")
    return list(instances)


def prefill_service(view: ClusterView, policy: str) -> list[InstanceLoad]:
    """PS-role instances; a PS policy on a cluster without one is a configuration error."""
    ps = [inst for inst in view.instances if inst.role == "PS"]
    if not ps:
        raise UserError(
            f"policy {policy!r} needs at least one instance with role PS in cluster.instances"
        )
    return ps


def least_load(
    candidates: Sequence[InstanceLoad], rng: random.Random | None = None
) -> InstanceLoad:
    """Fewest running + waiting requests; ties go to the lowest index, or with `rng` to a
    seeded draw among the tied. (A plain loop: this runs for nearly every simulated
    request.)"""
    best = candidates[0]
    best_load = best.running + best.waiting
    if rng is not None:
        tied = [best]
        for inst in candidates[1:]:
            load = inst.running + inst.waiting
            if load < best_load:
                best, best_load, tied = inst, load, [inst]
            elif load == best_load:
                tied.append(inst)
        return pick_tie(tied, rng)
    for inst in candidates[1:]:
        load = inst.running + inst.waiting
        if load < best_load or (load == best_load and inst.index < best.index):
            best, best_load = inst, load
    return best


def pick_tie(tied: Sequence[InstanceLoad], rng: random.Random) -> InstanceLoad:
    """One of equally good instances, drawn from `rng` (index order first, so the same
    stream gives the same choice in both worlds)."""
    if len(tied) == 1:
        return tied[0]
    ordered = sorted(tied, key=lambda inst: inst.index)
    return ordered[rng.randrange(len(ordered))]


def least_outstanding(candidates: Sequence[InstanceLoad]) -> InstanceLoad:
    """Fewest outstanding tokens (the seed's `ongoing_tokens` placement score); ties by
    load, then lowest index."""
    return min(candidates, key=lambda inst: (inst.outstanding_tokens, inst.load, inst.index))


def is_imbalanced(
    loads: Sequence[int], *, abs_threshold: float, rel_threshold: float, spread: bool
) -> bool:
    """SGLang's balance test over per-instance loads. Both conditions must hold: the
    absolute one compares the maximum load (seed) or the max − min spread (SGLang) with
    `abs_threshold`, and the relative one compares max with `rel_threshold` × min."""
    high, low = max(loads), min(loads)
    absolute = (high - low) if spread else high
    return absolute > abs_threshold and high > rel_threshold * low


def cached_tokens(
    view: ClusterView,
    instance: int,
    block_hashes: Sequence[int],
    block_tokens: int,
    input_tokens: int,
) -> int:
    """Prompt tokens the router believes `instance` already holds, capped at the prompt."""
    if not block_hashes:
        return 0
    return min(view.match_blocks(instance, block_hashes) * block_tokens, input_tokens)
