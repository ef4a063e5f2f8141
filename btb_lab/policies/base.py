"""The one interface every routing policy is written against, in both worlds.

A policy sees a `ClusterView` and returns a `Decision`. The simulator builds the view
from its model state; the cluster router builds it from its own bookkeeping. A policy
never imports the simulator or an HTTP client, so the same code routes in both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from pydantic import ValidationError

from btb_lab.config.base import ParamsModel, StrictModel
from btb_lab.records import EventRecord, Request
from btb_lab.registry import Registry

__all__ = [
    "POLICIES",
    "CacheAction",
    "ClusterView",
    "CostModel",
    "Decision",
    "InstanceLoad",
    "NoParams",
    "Policy",
    "WarmAction",
    "build_policy",
]


@dataclass(slots=True)
class InstanceLoad:
    """What the router knows of one instance's load right now."""

    index: int
    name: str
    role: str  # "C" (co-located prefill+decode) or "PS" (prefill service)
    running: int
    waiting: int
    outstanding_tokens: int  # prompt + output tokens routed there and not yet finished

    @property
    def load(self) -> int:
        """Load as SGLang's router counts it: running + waiting requests."""
        return self.running + self.waiting


class CostModel(Protocol):
    """Modeled costs a cost-based policy may consult (same formulas in both worlds)."""

    def prefill_s(self, instance: int, tokens: int, cached_tokens: int = 0) -> float:
        """Prefilling `tokens` uncached prompt tokens after `cached_tokens` of cached
        prefix on `instance` (a fitted profile charges for the context and the cache)."""
        ...

    def transfer_s(self, tokens: int, source: int, target: int) -> float: ...


class ClusterView(Protocol):
    """Read-only state a policy may use to decide."""

    @property
    def now_s(self) -> float: ...

    @property
    def instances(self) -> Sequence[InstanceLoad]: ...

    @property
    def costs(self) -> CostModel: ...

    def match_blocks(self, instance: int, block_hashes: Sequence[int]) -> int:
        """Leading blocks of `block_hashes` the router believes `instance` holds
        (what it routed there, or what is resident, depending on the router view)."""
        ...

    def complete_blocks(self, instance: int, block_hashes: Sequence[int]) -> int:
        """Leading blocks whose KV is complete on `instance`, i.e. a valid copy source."""
        ...

    def host_blocks(self, instance: int, block_hashes: Sequence[int]) -> int:
        """Leading blocks `instance` holds in HBM or host RAM (0 where the router cannot
        see the host tier, as on a real cluster)."""
        ...


@dataclass(slots=True, frozen=True)
class WarmAction:
    """Make the first `n_blocks` of the current request's prefix resident on `target`,
    copying from `source` over RDMA (`rdma`) or recomputing it there (`prefill`)."""

    source: int | None
    target: int
    n_blocks: int
    mode: Literal["rdma", "prefill"] = "rdma"


CacheActionKind = Literal["pin", "unpin", "evict", "demote", "promote"]


@dataclass(slots=True, frozen=True)
class CacheAction:
    """A cache action on the leading run of `blocks` on `instance` (any prefix, not only
    the routed request's): `pin` keeps its HBM blocks from eviction for `ttl_s` (a pin
    already held is extended), `unpin` releases such a pin, `evict` drops its unpinned
    blocks from HBM and host RAM, `demote` moves its unpinned HBM blocks to host RAM,
    `promote` moves its host-RAM blocks back to HBM over the host link."""

    kind: CacheActionKind
    instance: int
    blocks: tuple[int, ...]
    ttl_s: float | None = None


@dataclass(slots=True)
class Decision:
    """Where a request runs. With `prefill_instance` set, that instance prefills and the
    KV moves to `instance`, which decodes (prefill offload / PD split)."""

    instance: int
    route: str = "COLO"
    prefill_instance: int | None = None
    prefill_cold: bool = False  # prefill ignores cached prefixes (a PS with no session cache)
    warm: tuple[WarmAction, ...] = ()
    cache: tuple[CacheAction, ...] = ()


class NoParams(ParamsModel):
    """A policy without parameters."""


class Policy:
    """Base class: subclasses set `name`, `Params`, and implement `route`. One policy
    object lives for one run (variant × repeat), so it may keep state (session maps,
    burst detectors)."""

    name: ClassVar[str] = ""
    Params: ClassVar[type[StrictModel]] = NoParams
    # why the cluster backend cannot carry this policy out (None: it can)
    cluster_refusal: ClassVar[str | None] = None
    # roles every request is routed to, checked against the cluster when a hypothesis loads
    needs_roles: ClassVar[tuple[str, ...]] = ()

    def __init__(self, params: StrictModel, *, seed: int = 0) -> None:
        self.params = params
        self.seed = seed
        # what the policy itself noticed (a burst detector firing), read by the backend
        # after the run and stored with the run's other events
        self.events: list[EventRecord] = []

    def route(self, request: Request, view: ClusterView) -> Decision:
        raise NotImplementedError

    def on_finish(self, request: Request, instance: int, now_s: float) -> None:
        """Called when a request completes; stateful policies may override."""


POLICIES: Registry[type[Policy]] = Registry("policy")


def build_policy(name: str, params: dict[str, Any] | None = None, *, seed: int = 0) -> Policy:
    """Instantiate a registered policy with validated params (raises pydantic's
    ValidationError for bad params, UserError for an unknown name)."""
    cls = POLICIES.get(name)
    parsed = cls.Params.model_validate(params or {})
    return cls(parsed, seed=seed)


# Re-exported so callers catching parameter errors need not import pydantic.
PolicyParamsError = ValidationError
