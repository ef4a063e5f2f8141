"""Prefill offload for elastic PD on agentic sessions (seed hypotheses H2–H4).

Every policy here keeps sessions sticky (session affinity with `overload_factor`) and
classifies each request by prompt length: WARM (< `medium_input_tokens`), MEDIUM, or
HEAVY (≥ `heavy_input_tokens`). WARM and MEDIUM run co-located on the session's
instance C_s (route = the class). The policies differ only in what a HEAVY request does:

* `ps_always` (H2): a PS-role instance prefills cold (no session cache); C_s pulls the KV
  and decodes. Route PS.
* `ps_flexd` (H2): the same, but the least-loaded C decodes and the session moves there.
* `ps_cost` (H2): offload as ps_always only when the modeled PS cold prefill + KV transfer
  is cheaper than C_s's cached prefill + `interference_s`; else HEAVY_COLO.
* `offload_decode` (H3, the seed's V2): C_s prefills with its cache, the least-loaded C
  pulls the KV and decodes, and the session moves there. Route HEAVY_OFFLOAD.
* `cache_gate` (H4): offload_decode only when the cached fraction of the prompt on C_s is
  at least `threshold`; cold HEAVY stays on C_s (HEAVY_COLO).

`pd_split` is the full PD-separation baseline the log calls "net negative (memory wall)":
a dedicated prefill pool (PS-role instances, with their prefix caches) prefills every
request, whatever its class, and a dedicated decode pool (C-role instances) decodes it
after pulling the KV. No session sticks to a decode instance; a session's context stays
in the prefill pool's cache, so later turns go to the prefill instance holding it.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from btb_lab.config.base import ParamsModel, StrictModel
from btb_lab.errors import UserError
from btb_lab.policies.base import POLICIES, ClusterView, Decision, InstanceLoad, Policy
from btb_lab.policies.common import (
    cached_tokens,
    least_load,
    least_outstanding,
    prefill_service,
    require_params,
    serving,
)
from btb_lab.policies.session_affinity import OverloadFactor, OverloadMinLoad, SessionTable
from btb_lab.records import Request

__all__ = [
    "CacheGate",
    "CacheGateParams",
    "OffloadDecode",
    "OffloadParams",
    "PDSplit",
    "PDSplitParams",
    "PSAlways",
    "PSCost",
    "PSCostParams",
    "PSFlexD",
]

WARM = "WARM"
MEDIUM = "MEDIUM"
HEAVY = "HEAVY"
ROUTE_PS = "PS"
ROUTE_HEAVY_COLO = "HEAVY_COLO"
ROUTE_HEAVY_OFFLOAD = "HEAVY_OFFLOAD"
ROUTE_PD = "PD"


class OffloadParams(ParamsModel):
    """Request classes and session stickiness shared by the offload family."""

    heavy_input_tokens: int = Field(
        32_768,
        ge=1,
        description="Prompts of at least this many tokens are HEAVY (the seed's HEAVY "
        "turns are ~40k tokens; an 8k-token prefill counts as MEDIUM).",
    )
    medium_input_tokens: int = Field(
        2_048,
        ge=0,
        description="Prompts of at least this many tokens (and below heavy) are MEDIUM; "
        "shorter ones are WARM. Only labels the route.",
    )
    overload_factor: OverloadFactor = 2.0
    overload_min_load: OverloadMinLoad = 0

    @model_validator(mode="after")
    def _medium_below_heavy(self) -> OffloadParams:
        if self.medium_input_tokens > self.heavy_input_tokens:
            raise ValueError("medium_input_tokens must not exceed heavy_input_tokens")
        return self


class PSCostParams(OffloadParams):
    """ps_cost adds the interference term of the seed's cost inequality."""

    interference_s: float = Field(
        0.5,
        ge=0,
        description="Modeled cost, in seconds, of running a HEAVY prefill on the session's "
        "instance (stalled decodes there): the `interference` term of the seed's rule "
        "`PS cold prefill + transfer < C_s cached prefill + interference`.",
    )


class CacheGateParams(OffloadParams):
    """cache_gate adds the cached-fraction gate of H4."""

    threshold: float = Field(
        0.3,
        ge=0,
        le=1,
        description="Offload a HEAVY request only when at least this fraction of its prompt "
        "is cached on the session's instance (H4 ran with 0.3).",
    )


class _Offload(Policy):
    """Session placement, classification and the co-located path; subclasses decide
    what a HEAVY request does in `_heavy`."""

    Params: ClassVar[type[StrictModel]] = OffloadParams

    def __init__(self, params: StrictModel, *, seed: int = 0) -> None:
        super().__init__(params, seed=seed)
        self.cfg = require_params(params, OffloadParams)
        self.sessions = SessionTable()

    def classify(self, request: Request) -> str:
        """WARM, MEDIUM or HEAVY by prompt length."""
        if request.input_tokens >= self.cfg.heavy_input_tokens:
            return HEAVY
        if request.input_tokens >= self.cfg.medium_input_tokens:
            return MEDIUM
        return WARM

    def route(self, request: Request, view: ClusterView) -> Decision:
        candidates = serving(view)
        cfg = self.cfg
        home, _ = self.sessions.place(
            request, candidates, cfg.overload_factor, cfg.overload_min_load
        )
        klass = self.classify(request)
        if klass != HEAVY:
            return Decision(instance=home.index, route=klass)
        return self._heavy(request, view, home, candidates)

    def _heavy(
        self,
        request: Request,
        view: ClusterView,
        home: InstanceLoad,
        candidates: list[InstanceLoad],
    ) -> Decision:
        raise NotImplementedError

    def _move_session(self, request: Request, instance: int) -> None:
        if request.session_id is not None:
            self.sessions.bind(request.session_id, instance)

    def _cached_fraction(self, request: Request, view: ClusterView, instance: int) -> float:
        """Fraction of the prompt the router believes `instance` holds."""
        if request.input_tokens <= 0:
            return 0.0
        cached = cached_tokens(
            view, instance, request.block_hashes, request.block_tokens, request.input_tokens
        )
        return cached / request.input_tokens

    def _offload_decode(
        self, request: Request, home: InstanceLoad, candidates: list[InstanceLoad]
    ) -> Decision:
        """C_s prefills with its cache; the least-loaded C decodes and takes the session.
        A tie keeps the session home: a transfer to an equally loaded peer buys nothing."""
        decoder = min(candidates, key=lambda i: (i.load, i.index != home.index, i.index))
        if decoder.index == home.index:
            return Decision(instance=home.index, route=ROUTE_HEAVY_COLO)
        self._move_session(request, decoder.index)
        return Decision(
            instance=decoder.index, route=ROUTE_HEAVY_OFFLOAD, prefill_instance=home.index
        )


def _ps_decision(view: ClusterView, policy: str, decoder: int) -> Decision:
    """Cold prefill on the least-loaded PS, KV pulled by `decoder`."""
    ps = least_load(prefill_service(view, policy))
    return Decision(instance=decoder, route=ROUTE_PS, prefill_instance=ps.index, prefill_cold=True)


@POLICIES.register("ps_always")
class PSAlways(_Offload):
    """H2: every HEAVY prefill on a prefill service, the session's instance decodes."""

    name: ClassVar[str] = "ps_always"
    needs_roles: ClassVar[tuple[str, ...]] = ("PS", "C")  # HEAVY prefills on a PS, decodes on C

    def _heavy(
        self,
        request: Request,
        view: ClusterView,
        home: InstanceLoad,
        candidates: list[InstanceLoad],
    ) -> Decision:
        return _ps_decision(view, self.name, home.index)


@POLICIES.register("ps_flexd")
class PSFlexD(_Offload):
    """H2: HEAVY prefill on a prefill service, the least-loaded C decodes and keeps the
    session (it now holds this turn's KV)."""

    name: ClassVar[str] = "ps_flexd"
    needs_roles: ClassVar[tuple[str, ...]] = ("PS", "C")  # HEAVY prefills on a PS, decodes on C

    def _heavy(
        self,
        request: Request,
        view: ClusterView,
        home: InstanceLoad,
        candidates: list[InstanceLoad],
    ) -> Decision:
        decoder = least_load(candidates).index
        self._move_session(request, decoder)
        return _ps_decision(view, self.name, decoder)


@POLICIES.register("ps_cost")
class PSCost(_Offload):
    """H2: ps_always only when the modeled cost says the prefill service is cheaper."""

    name: ClassVar[str] = "ps_cost"
    needs_roles: ClassVar[tuple[str, ...]] = ("PS", "C")  # HEAVY prefills on a PS, decodes on C
    Params: ClassVar[type[StrictModel]] = PSCostParams

    def __init__(self, params: StrictModel, *, seed: int = 0) -> None:
        super().__init__(params, seed=seed)
        self.cost_cfg = require_params(params, PSCostParams)

    def offload_cost_s(self, request: Request, view: ClusterView, home: int, ps: int) -> float:
        """PS cold prefill of the whole prompt + moving its KV to the session's instance."""
        tokens = request.input_tokens
        return view.costs.prefill_s(ps, tokens) + view.costs.transfer_s(tokens, ps, home)

    def colocated_cost_s(self, request: Request, view: ClusterView, home: int) -> float:
        """The session's instance prefills what it lacks, and stalls its decodes meanwhile."""
        cached = cached_tokens(
            view, home, request.block_hashes, request.block_tokens, request.input_tokens
        )
        uncached = request.input_tokens - cached
        prefill_s = view.costs.prefill_s(home, uncached, cached_tokens=cached)
        return prefill_s + self.cost_cfg.interference_s

    def _heavy(
        self,
        request: Request,
        view: ClusterView,
        home: InstanceLoad,
        candidates: list[InstanceLoad],
    ) -> Decision:
        ps = least_load(prefill_service(view, self.name))
        offload_s = self.offload_cost_s(request, view, home.index, ps.index)
        if offload_s < self.colocated_cost_s(request, view, home.index):
            return Decision(
                instance=home.index, route=ROUTE_PS, prefill_instance=ps.index, prefill_cold=True
            )
        return Decision(instance=home.index, route=ROUTE_HEAVY_COLO)


@POLICIES.register("offload_decode")
class OffloadDecode(_Offload):
    """H3 (V2): C_s cached prefill, least-loaded C decodes, the session migrates."""

    name: ClassVar[str] = "offload_decode"

    def _heavy(
        self,
        request: Request,
        view: ClusterView,
        home: InstanceLoad,
        candidates: list[InstanceLoad],
    ) -> Decision:
        return self._offload_decode(request, home, candidates)


@POLICIES.register("cache_gate")
class CacheGate(_Offload):
    """H4: offload_decode only for HEAVY requests whose prompt is mostly cached on C_s;
    cold HEAVY (typically turn 1) stays co-located."""

    name: ClassVar[str] = "cache_gate"
    Params: ClassVar[type[StrictModel]] = CacheGateParams

    def __init__(self, params: StrictModel, *, seed: int = 0) -> None:
        super().__init__(params, seed=seed)
        self.gate_cfg = require_params(params, CacheGateParams)

    def _heavy(
        self,
        request: Request,
        view: ClusterView,
        home: InstanceLoad,
        candidates: list[InstanceLoad],
    ) -> Decision:
        if self._cached_fraction(request, view, home.index) >= self.gate_cfg.threshold:
            return self._offload_decode(request, home, candidates)
        return Decision(instance=home.index, route=ROUTE_HEAVY_COLO)


class PDSplitParams(ParamsModel):
    """How each pool picks its instance."""

    prefill_pick: Literal["cache_aware", "least_load"] = Field(
        "cache_aware",
        description="Prefill instance: the longest prefix match in the prefill pool (ties "
        "by load, then index), or the least-loaded one.",
    )
    decode_pick: Literal["least_load", "least_outstanding"] = Field(
        "least_load",
        description="Decode instance: fewest running + waiting requests, or fewest "
        "outstanding tokens (KV the instance has yet to hold).",
    )


@POLICIES.register("pd_split")
class PDSplit(Policy):
    """Full PD separation: every request prefills in the PS pool and decodes in the C pool.
    Route PD."""

    name: ClassVar[str] = "pd_split"
    Params: ClassVar[type[StrictModel]] = PDSplitParams
    needs_roles: ClassVar[tuple[str, ...]] = ("PS", "C")

    def __init__(self, params: StrictModel, *, seed: int = 0) -> None:
        super().__init__(params, seed=seed)
        self.cfg = require_params(params, PDSplitParams)

    def route(self, request: Request, view: ClusterView) -> Decision:
        prefill_pool = prefill_service(view, self.name)
        decode_pool = [inst for inst in view.instances if inst.role == "C"]
        if not decode_pool:
            raise UserError(
                f"policy {self.name!r} needs at least one instance with role C (the decode "
                "pool) in cluster.instances"
            )
        if self.cfg.prefill_pick == "cache_aware" and request.block_hashes:
            blocks = request.block_hashes
            prefill = min(
                prefill_pool,
                key=lambda i: (-view.match_blocks(i.index, blocks), i.load, i.index),
            )
        else:
            prefill = least_load(prefill_pool)
        if self.cfg.decode_pick == "least_outstanding":
            decoder = least_outstanding(decode_pool)
        else:
            decoder = least_load(decode_pool)
        return Decision(instance=decoder.index, route=ROUTE_PD, prefill_instance=prefill.index)
