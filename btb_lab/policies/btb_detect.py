"""BTB with other burst detectors: the BTB write-up's future work items 4 and 5.

* `btb_adaptive`: X, Z and M adapt instead of being four constants. X (arrivals that mark
  a burst) rises from `burst_count` to `burst_count_max` with cache pressure, the share
  of the KV budget the emptiest serving instance has committed to in-flight requests
  (outstanding tokens / `kv_budget_tokens`): under pressure a copy evicts useful KV, so
  more evidence is asked for. Z (the window) widens from `burst_window_s` to
  `burst_window_max_s` with queue load (mean running + waiting over `load_ref`): with
  long queues a slower stream of one prefix still piles onto its holder. M starts at
  `replicas` and grows by one replica per arrival, up to `replicas_max`, while every
  warm replica has at least `grow_at_load` requests: a big burst keeps its replicas
  loaded and earns more of them, a small one stays on few.
* `btb_hint`: a request's `job_kind` (request metadata: the job a batch or a system
  prompt belongs to, e.g. `labeling`, `batch_extraction`, `subagent_fanout`) is a prior
  that a burst is coming. A request whose kind is in `hint_kinds` marks its prefix
  active after `hinted_burst_count` arrivals (1: at once) instead of X. Hints can
  mislead: the workload's decoy jobs carry the same kinds.

Both are BTB otherwise (warming, routing, speculative prefill, the cache-aware fallback).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from btb_lab.config.base import StrictModel
from btb_lab.policies.base import POLICIES, ClusterView, InstanceLoad
from btb_lab.policies.btb import BTB, BTBParams, _Active
from btb_lab.policies.common import require_params, serving
from btb_lab.records import BURST_JOB_KINDS, Request

__all__ = ["AdaptiveBTB", "AdaptiveBTBParams", "HintBTB", "HintBTBParams"]


class AdaptiveBTBParams(BTBParams):
    """BTB's constants become the low ends of ranges the detector moves in."""

    replicas: int = Field(
        2, ge=1, description="M at activation: warm replicas, counting the holders."
    )
    burst_count_max: int = Field(
        4,
        ge=1,
        description="X under full cache pressure (burst_count: X with none).",
    )
    burst_window_max_s: float = Field(
        4.0,
        gt=0,
        description="Z under full queue load (burst_window_s: Z on an idle cluster).",
    )
    replicas_max: int = Field(
        8, ge=1, description="Most warm replicas M may grow to (capped by the instances)."
    )
    grow_at_load: int = Field(
        4,
        ge=1,
        description="M grows by one when every warm replica has at least this many running "
        "+ waiting requests.",
    )
    load_ref: float = Field(
        8.0,
        gt=0,
        description="Mean running + waiting requests per serving instance at which Z reaches "
        "burst_window_max_s.",
    )
    kv_budget_tokens: int | None = Field(
        None,
        ge=1,
        description="KV tokens one instance holds (what cache pressure is measured "
        "against); unset: no pressure term, X stays burst_count.",
    )

    @model_validator(mode="after")
    def _ranges(self) -> AdaptiveBTBParams:
        if self.burst_count_max < self.burst_count:
            raise ValueError("burst_count_max must be at least burst_count")
        if self.burst_window_max_s < self.burst_window_s:
            raise ValueError("burst_window_max_s must be at least burst_window_s")
        if self.replicas_max < self.replicas:
            raise ValueError("replicas_max must be at least replicas")
        return self


@POLICIES.register("btb_adaptive")
class AdaptiveBTB(BTB):
    """BTB whose X follows cache pressure, Z queue load and M the burst's own load."""

    name: ClassVar[str] = "btb_adaptive"
    Params: ClassVar[type[StrictModel]] = AdaptiveBTBParams

    def __init__(self, params: StrictModel, *, seed: int = 0) -> None:
        super().__init__(params, seed=seed)
        self.adaptive = require_params(params, AdaptiveBTBParams)

    def cache_pressure(self, view: ClusterView) -> float:
        """0–1: outstanding tokens / KV budget on the emptiest serving instance."""
        budget = self.adaptive.kv_budget_tokens
        if budget is None:
            return 0.0
        emptiest = min(inst.outstanding_tokens for inst in serving(view))
        return min(1.0, max(0.0, emptiest / budget))

    def queue_load(self, view: ClusterView) -> float:
        """0–1: mean running + waiting per serving instance over `load_ref`."""
        candidates = serving(view)
        mean = sum(inst.running + inst.waiting for inst in candidates) / len(candidates)
        return min(1.0, mean / self.adaptive.load_ref)

    def burst_count_for(self, request: Request, view: ClusterView) -> int:
        cfg = self.adaptive
        span = cfg.burst_count_max - cfg.burst_count
        return cfg.burst_count + round(span * self.cache_pressure(view))

    def burst_window_for(self, request: Request, view: ClusterView) -> float:
        cfg = self.adaptive
        span = cfg.burst_window_max_s - cfg.burst_window_s
        return cfg.burst_window_s + span * self.queue_load(view)

    def longest_window_s(self) -> float:
        return self.adaptive.burst_window_max_s

    def replicas_for(
        self, active: _Active, view: ClusterView, members: set[int], candidates: list[InstanceLoad]
    ) -> int:
        cfg = self.adaptive
        if active.replicas == 0:
            active.replicas = cfg.replicas
        ceiling = min(cfg.replicas_max, len(candidates))
        grown_enough = len(members) >= active.replicas
        if active.warmed and members and grown_enough and active.replicas < ceiling:
            loads = [inst.load for inst in candidates if inst.index in members]
            if loads and min(loads) >= cfg.grow_at_load:
                active.replicas += 1
        return active.replicas


class HintBTBParams(BTBParams):
    """BTB plus the job kinds that count as a prior for a burst."""

    hint_kinds: list[str] = Field(
        default_factory=lambda: list(BURST_JOB_KINDS),
        min_length=1,
        description="Request job kinds (metadata `job_kind`) that announce a burst.",
    )
    hinted_burst_count: int = Field(
        1,
        ge=1,
        description="X for a request whose job kind is hinted (1: its first arrival marks "
        "the prefix active); other requests need burst_count.",
    )

    @model_validator(mode="after")
    def _hint_lowers_x(self) -> HintBTBParams:
        if self.hinted_burst_count > self.burst_count:
            raise ValueError("hinted_burst_count must not exceed burst_count")
        if any(not kind for kind in self.hint_kinds):
            raise ValueError("hint_kinds must not contain empty names")
        return self


@POLICIES.register("btb_hint")
class HintBTB(BTB):
    """BTB that fires early on prefixes whose requests carry a hinted job kind."""

    name: ClassVar[str] = "btb_hint"
    Params: ClassVar[type[StrictModel]] = HintBTBParams

    def __init__(self, params: StrictModel, *, seed: int = 0) -> None:
        super().__init__(params, seed=seed)
        self.hint = require_params(params, HintBTBParams)
        self._kinds = frozenset(self.hint.hint_kinds)

    def is_hinted(self, request: Request) -> bool:
        """Whether the request's metadata announces a burst."""
        return request.job_kind is not None and request.job_kind in self._kinds

    def burst_count_for(self, request: Request, view: ClusterView) -> int:
        if self.is_hinted(request):
            return self.hint.hinted_burst_count
        return self.hint.burst_count
