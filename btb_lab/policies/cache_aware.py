"""SGLang-style cache-aware routing: longest prefix match while the cluster is balanced,
least-load once it is not.

Behaviour follows the SGLang router's `cache_aware` policy (model gateway), with these
deliberate differences, each a parameter or a property of the ClusterView:

* Absolute balance test: the seed (and ARCHITECTURE.md) compare the *maximum* load with
  `balance_abs`; SGLang compares the max − min *spread*. Default `balance_abs_on: max`
  reproduces the seed; `spread` reproduces SGLang.
* Match threshold: SGLang sends a request to its best-matching worker only when the
  match rate exceeds `--cache-threshold` (0.3 in current releases) and otherwise to the
  worker with the smallest radix tree. The seed routes by any match, so the default
  `cache_threshold` is 0.0; below the threshold this policy picks the least-loaded
  instance, because a ClusterView exposes load, not tree sizes.
* Prefix knowledge: SGLang matches raw text in an approximate per-worker tree built from
  what it routed. Here the match is in blocks (`view.match_blocks`); whether it reflects
  routed or resident blocks is the backend's declared `router_view`.
* Ties among equally long matches go to the lower load, then the lower index (SGLang
  picks the first worker found), so runs are deterministic; `tie_break: random` draws
  among the tied from the policy's seeded stream instead (the seed simulator's rule,
  which keeps cold requests from all landing on the first instance).
"""

from __future__ import annotations

import random
from typing import ClassVar, Literal

from pydantic import Field

from btb_lab.config.base import ParamsModel, StrictModel
from btb_lab.policies.base import POLICIES, ClusterView, Decision, InstanceLoad, Policy
from btb_lab.policies.common import (
    is_imbalanced,
    least_load,
    pick_tie,
    require_params,
    serving,
)
from btb_lab.records import Request

__all__ = ["CacheAware", "CacheAwareParams", "cache_aware_decision"]

ROUTE_CACHE_HIT = "CACHE_HIT"
ROUTE_COLD = "COLD"
ROUTE_BALANCE = "BALANCE"


class CacheAwareParams(ParamsModel):
    """Parameters of the cache-aware router (SGLang's names without the dashes)."""

    balance_abs: float = Field(
        64,
        ge=0,
        description="Absolute imbalance threshold in requests (SGLang --balance-abs-threshold).",
    )
    balance_rel: float = Field(
        1.5,
        ge=1.0,
        description="Relative imbalance threshold: max load vs this × min load "
        "(SGLang --balance-rel-threshold).",
    )
    balance_abs_on: Literal["max", "spread"] = Field(
        "max",
        description="What the absolute threshold tests: the maximum load (the seed's rule) "
        "or the max − min spread (SGLang's rule).",
    )
    cache_threshold: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Route by prefix only when the best match covers more than this "
        "fraction of the prompt's blocks; else least-load (SGLang default 0.3; seed 0).",
    )
    tie_break: Literal["lowest", "random"] = Field(
        "lowest",
        description="Among equally good instances: the lowest index, or a draw from the "
        "policy's stream seeded by the run's seed (the seed simulator re-seeds it per "
        "window).",
    )


def cache_aware_decision(
    request: Request,
    view: ClusterView,
    params: CacheAwareParams,
    rng: random.Random | None = None,
) -> Decision:
    """The cache-aware choice for one request (shared with `btb`, whose fallback it is).
    One pass over the instances: this runs once per simulated request. With `rng`, ties
    are drawn from it."""
    candidates = serving(view)
    loads = [inst.running + inst.waiting for inst in candidates]
    if is_imbalanced(
        loads,
        abs_threshold=params.balance_abs,
        rel_threshold=params.balance_rel,
        spread=params.balance_abs_on == "spread",
    ):
        return Decision(instance=least_load(candidates, rng).index, route=ROUTE_BALANCE)
    blocks = request.block_hashes
    if rng is not None:
        return _random_tie_decision(request, view, params, candidates, loads, rng)
    # Smallest (−matched blocks, load, index): longest match, then lowest load and index;
    # and smallest (load, index) for the no-match case, in the same pass.
    best_key = cold_key = (0, 0, 0)
    for n, (inst, load) in enumerate(zip(candidates, loads, strict=True)):
        matched = view.match_blocks(inst.index, blocks) if blocks else 0
        key = (-matched, load, inst.index)
        if n == 0 or key < best_key:
            best_key = key
        if n == 0 or (0, load, inst.index) < cold_key:
            cold_key = (0, load, inst.index)
    if best_key[0] < 0 and -best_key[0] / len(blocks) > params.cache_threshold:
        return Decision(instance=best_key[2], route=ROUTE_CACHE_HIT)
    return Decision(instance=cold_key[2], route=ROUTE_COLD)


def _random_tie_decision(
    request: Request,
    view: ClusterView,
    params: CacheAwareParams,
    candidates: list[InstanceLoad],
    loads: list[int],
    rng: random.Random,
) -> Decision:
    """`cache_aware_decision` with ties among (−matched, load) drawn from `rng`."""
    blocks = request.block_hashes
    matched = [view.match_blocks(inst.index, blocks) if blocks else 0 for inst in candidates]
    best = min(zip(matched, loads, strict=True), key=lambda ml: (-ml[0], ml[1]))
    if best[0] > 0 and best[0] / len(blocks) > params.cache_threshold:
        tied = [
            inst
            for inst, m, load in zip(candidates, matched, loads, strict=True)
            if (m, load) == best
        ]
        return Decision(instance=pick_tie(tied, rng).index, route=ROUTE_CACHE_HIT)
    low = min(loads)
    tied = [inst for inst, load in zip(candidates, loads, strict=True) if load == low]
    return Decision(instance=pick_tie(tied, rng).index, route=ROUTE_COLD)


def tie_rng(params: CacheAwareParams, seed: int) -> random.Random | None:
    """The policy's tie-break stream (None: lowest index). Seeded from the run's seed
    through its decimal text, so it is the same in every process."""
    if params.tie_break != "random":
        return None
    return random.Random(f"tie_break:{seed}")


@POLICIES.register("cache_aware")
class CacheAware(Policy):
    """Longest prefix match, ties by load then index; least-load past both thresholds.
    Routes: CACHE_HIT (prefix match chose), COLD (no useful match), BALANCE (imbalanced)."""

    name: ClassVar[str] = "cache_aware"
    Params: ClassVar[type[StrictModel]] = CacheAwareParams

    def __init__(self, params: StrictModel, *, seed: int = 0) -> None:
        super().__init__(params, seed=seed)
        self.cfg = require_params(params, CacheAwareParams)
        self.rng = tie_rng(self.cfg, seed)

    def route(self, request: Request, view: ClusterView) -> Decision:
        return cache_aware_decision(request, view, self.cfg, self.rng)
