"""Cache-blind baselines: round_robin, random and least_load.

They route only to serving (C-role) instances and ignore prefixes, which is what makes
them the reference points for the cache-aware and burst-aware policies.
"""

from __future__ import annotations

import random
from typing import ClassVar

from btb_lab.config.base import StrictModel
from btb_lab.policies.base import POLICIES, ClusterView, Decision, NoParams, Policy
from btb_lab.policies.common import least_load, serving
from btb_lab.records import Request

__all__ = ["LeastLoad", "RandomPolicy", "RoundRobin"]


@POLICIES.register("round_robin")
class RoundRobin(Policy):
    """Cycles through the serving instances in index order."""

    name: ClassVar[str] = "round_robin"
    Params: ClassVar[type[StrictModel]] = NoParams

    def __init__(self, params: StrictModel, *, seed: int = 0) -> None:
        super().__init__(params, seed=seed)
        self._next = 0

    def route(self, request: Request, view: ClusterView) -> Decision:
        candidates = sorted(serving(view), key=lambda inst: inst.index)
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return Decision(instance=chosen.index, route="RR")


@POLICIES.register("random")
class RandomPolicy(Policy):
    """Uniform choice among serving instances from a `random.Random(seed)` stream, so a
    run is reproducible from its seed."""

    name: ClassVar[str] = "random"
    Params: ClassVar[type[StrictModel]] = NoParams

    def __init__(self, params: StrictModel, *, seed: int = 0) -> None:
        super().__init__(params, seed=seed)
        self._rng = random.Random(seed)

    def route(self, request: Request, view: ClusterView) -> Decision:
        candidates = sorted(serving(view), key=lambda inst: inst.index)
        chosen = candidates[self._rng.randrange(len(candidates))]
        return Decision(instance=chosen.index, route="RANDOM")


@POLICIES.register("least_load")
class LeastLoad(Policy):
    """Fewest running + waiting requests, ties by lowest index: spreads unrelated work
    evenly, and scatters same-prefix bursts over cold replicas (the seed's worst case)."""

    name: ClassVar[str] = "least_load"
    Params: ClassVar[type[StrictModel]] = NoParams

    def route(self, request: Request, view: ClusterView) -> Decision:
        return Decision(instance=least_load(serving(view)).index, route="LEAST_LOAD")
