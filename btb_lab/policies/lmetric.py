"""LMetric: one score, the product of a KV-cache indicator and a load indicator.

LMetric (Zhang et al., "LMetric: Simple is Better – Multiplication May Be All You Need for
LLM Request Scheduling", 2026) routes each request to the instance with the smallest
`new prefill tokens × current batch size`: the tokens the instance would have to compute
given the prefix it holds, times the requests it is running. Multiplying instead of
weighting two terms makes the weights cancel out in the comparison, so there is nothing
to tune. The elastic-prefill log tried it on agentic sessions ("≈ baseline for agentic:
session affinity limits routing freedom"), which `sticky_sessions` reproduces: later
turns stick as in session_affinity and LMetric places first turns and broken ones.

Choices made here: at least one prompt token is always computed (the last one, as vLLM
does), so a full cache hit still scales with load; ties go to fewer new tokens, then the
lower batch, then the lower index. The prefix an instance holds is what the view says
(`view.match_blocks`, routed or resident per the backend's router view).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from btb_lab.config.base import ParamsModel, StrictModel
from btb_lab.policies.base import POLICIES, ClusterView, Decision, InstanceLoad, Policy
from btb_lab.policies.common import cached_tokens, require_params, serving
from btb_lab.policies.session_affinity import BROKEN, NEW, NO_SESSION, STICKY, SessionTable
from btb_lab.records import Request

__all__ = ["LMetric", "LMetricParams", "lmetric_pick", "lmetric_score"]

ROUTE_LMETRIC = "LMETRIC"


class LMetricParams(ParamsModel):
    """What counts as the batch, and whether sessions stick."""

    batch: Literal["running", "running_waiting"] = Field(
        "running",
        description="The load indicator: requests running on the instance (LMetric's "
        "current batch size), or running + waiting.",
    )
    sticky_sessions: bool = Field(
        False,
        description="Later turns of a session stick to its instance as in session_affinity; "
        "LMetric places first turns and turns whose affinity broke.",
    )
    overload_factor: float = Field(
        2.0,
        gt=0,
        description="With sticky_sessions: affinity breaks above this × the mean load "
        "(seed OVERLOAD_FACTOR).",
    )

    @model_validator(mode="after")
    def _overload_needs_sticky(self) -> LMetricParams:
        """Without sticky sessions no affinity breaks: the factor would change nothing."""
        if "overload_factor" in self.model_fields_set and not self.sticky_sessions:
            raise ValueError("overload_factor needs sticky_sessions: true")
        return self


def lmetric_score(
    request: Request, view: ClusterView, inst: InstanceLoad, batch: str
) -> tuple[int, int, int, int]:
    """(new tokens × batch, new tokens, batch, index) for routing `request` to `inst`;
    the smallest wins."""
    cached = cached_tokens(
        view, inst.index, request.block_hashes, request.block_tokens, request.input_tokens
    )
    new_tokens = max(1, request.input_tokens - cached)
    size = inst.running + (inst.waiting if batch == "running_waiting" else 0)
    return (new_tokens * size, new_tokens, size, inst.index)


def lmetric_pick(
    request: Request, view: ClusterView, candidates: Sequence[InstanceLoad], batch: str
) -> InstanceLoad:
    """The instance LMetric routes `request` to among `candidates`."""
    return min(candidates, key=lambda inst: lmetric_score(request, view, inst, batch))


@POLICIES.register("lmetric")
class LMetric(Policy):
    """Smallest new-prefill-tokens × batch-size. Routes: LMETRIC, or with sticky sessions
    STICKY / NEW / BROKEN / NO_SESSION."""

    name: ClassVar[str] = "lmetric"
    Params: ClassVar[type[StrictModel]] = LMetricParams

    def __init__(self, params: StrictModel, *, seed: int = 0) -> None:
        super().__init__(params, seed=seed)
        self.cfg = require_params(params, LMetricParams)
        self.sessions = SessionTable()

    def route(self, request: Request, view: ClusterView) -> Decision:
        candidates = serving(view)
        batch = self.cfg.batch
        if not self.cfg.sticky_sessions:
            return Decision(lmetric_pick(request, view, candidates, batch).index, ROUTE_LMETRIC)
        session = request.session_id
        if session is None:
            return Decision(lmetric_pick(request, view, candidates, batch).index, NO_SESSION)
        home_index = self.sessions.home(session)
        home = next((inst for inst in candidates if inst.index == home_index), None)
        if home is None:
            chosen, reason = lmetric_pick(request, view, candidates, batch), NEW
        else:
            mean_load = sum(inst.load for inst in candidates) / len(candidates)
            if home.load <= self.cfg.overload_factor * mean_load:
                return Decision(home.index, STICKY)
            others = [inst for inst in candidates if inst.index != home.index] or [home]
            chosen, reason = lmetric_pick(request, view, others, batch), BROKEN
        self.sessions.bind(session, chosen.index)
        return Decision(chosen.index, reason)
