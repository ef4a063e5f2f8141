"""Biting the Bullet (BTB, alias `early_rdma`): predictive KV replication for bursts.

If the same Y-block prefix arrives X times within Z seconds, the prefix becomes *active*:
its first Y blocks are copied over RDMA from an instance holding a complete copy to the
least-loaded instances lacking it, and every later request with that prefix goes to the
least-loaded warm instance (route WARM_HIT). When the prompt is shorter than Y blocks,
the burst has not fired, or (in `rdma` mode) no complete copy exists yet, the request is
routed exactly as `cache_aware` would route it.

Choices the seed leaves open, made here and documented:

* M counts warm *replicas including the instances that already hold the prefix* (the
  source among them): warming tops the warm set up to M, so M is the number of queues a
  burst is spread over. On the seed's 4-instance cluster with M = 4 this equals copying
  to every other instance, as the seed did.
* Warming happens once per activation, unless `recopy` (the seed): then the warm set is
  topped up to M again at any routing call where it fell below (a holder lost the prefix
  to eviction). An active prefix expires after `idle_expiry_s` without arrivals; a later
  burst must be detected again.
* An active prefix's requests go to the least-loaded instance of the warm set (holders
  and copy targets: a request may wait there for its copy), or with `route_active:
  holders` only to instances that hold the whole prefix now (the seed: a copy serves once
  it has landed).
* `mode: prefill` is the seed's future-work speculative prefill: targets recompute the
  prefix themselves (source None), so it fires without waiting for a complete copy.
  `prefill_fraction` prefills only the first part of the prefix (at least one block), and
  `prefill_chunk_blocks` prefills it a chunk at a time: the first chunk when the prefix
  becomes active, one more on every target at each later arrival of the prefix, up to the
  fraction; when the burst does not materialise, no more chunks are spent. Each chunk is a
  `WarmAction(mode="prefill", n_blocks=depth so far)`: the target recomputes only the
  blocks it does not hold yet.
* X, Z and M are looked up per request through `burst_count_for`, `burst_window_for` and
  `replicas_for`, which the subclasses in this module (`btb_adaptive`, `btb_hint`)
  override; BTB itself keeps the four constants.
* Detection keys are a blake2b digest of the prefix block ids, never Python's `hash()`.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from btb_lab.config.base import StrictModel
from btb_lab.policies.base import (
    POLICIES,
    ClusterView,
    Decision,
    InstanceLoad,
    Policy,
    WarmAction,
)
from btb_lab.policies.cache_aware import CacheAwareParams, cache_aware_decision, tie_rng
from btb_lab.policies.common import least_load, require_params, serving
from btb_lab.records import EventRecord, Request

__all__ = ["BTB", "BTBParams", "prefix_key"]

ROUTE_WARM_HIT = "WARM_HIT"


class BTBParams(CacheAwareParams):
    """BTB's detector (X, Y, Z), warming (M, mode) and its cache-aware fallback."""

    burst_count: int = Field(
        2, ge=1, description="X: arrivals of the same prefix that mark a burst."
    )
    burst_window_s: float = Field(
        1.0, gt=0, description="Z: the X arrivals must fall within this many seconds."
    )
    prefix_blocks: int = Field(
        128,
        ge=1,
        description="Y: prefix length in blocks that identifies a burst "
        "(128 × 512-token blocks = 65,536 tokens).",
    )
    prefix_tokens: int | None = Field(
        None,
        ge=1,
        description="Y in tokens instead of blocks: the prefix's full blocks, "
        "floor(prefix_tokens / block_tokens) of each request (at least one; a block that "
        "also holds suffix tokens differs per request). Set this or prefix_blocks, not both.",
    )
    replicas: int = Field(
        4,
        ge=1,
        description="M: warm replicas of an active prefix, counting the instances that "
        "already hold it (the copy source among them).",
    )
    mode: Literal["rdma", "prefill"] = Field(
        "rdma",
        description="rdma: copy KV from a complete copy; prefill: targets recompute the "
        "prefix speculatively (no source needed).",
    )
    idle_expiry_s: float = Field(
        10.0, gt=0, description="An active prefix with no arrival for this long expires."
    )
    recopy: bool = Field(
        False,
        description="Copy again whenever the warm set (holders + copies not yet landed) "
        "drops below M, e.g. after an eviction (the seed); false: warm once per activation.",
    )
    route_active: Literal["warm_set", "holders"] = Field(
        "warm_set",
        description="Where an active prefix's requests go: the least-loaded of holders and "
        "copy targets, or only instances holding the whole prefix now (the seed).",
    )

    prefill_fraction: float = Field(
        1.0,
        gt=0,
        le=1,
        description="mode prefill only: speculatively prefill this fraction of the Y-block "
        "prefix (rounded up to whole blocks, at least one); 1 = the whole prefix.",
    )
    prefill_chunk_blocks: int | None = Field(
        None,
        ge=1,
        description="mode prefill only: prefill the (fraction of the) prefix this many "
        "blocks at a time, one chunk more per later arrival of the active prefix; unset = "
        "all at once.",
    )

    @model_validator(mode="after")
    def _one_prefix_length(self) -> BTBParams:
        if self.prefix_tokens is not None and "prefix_blocks" in self.model_fields_set:
            raise ValueError("set prefix_blocks or prefix_tokens, not both")
        partial = self.prefill_fraction < 1 or self.prefill_chunk_blocks is not None
        if partial and self.mode != "prefill":
            raise ValueError("prefill_fraction and prefill_chunk_blocks need mode: prefill")
        if partial and self.route_active == "holders":
            raise ValueError(
                "prefill_fraction and prefill_chunk_blocks need route_active: warm_set (a "
                "partly prefilled target never holds the whole prefix)"
            )
        return self


def prefix_key(blocks: Sequence[int]) -> bytes:
    """A stable 16-byte key of a prefix's block ids (same in every process)."""
    if type(blocks) is tuple:  # a burst's requests share their prefix: one digest for all
        return _prefix_key_of_tuple(blocks)
    return _digest(blocks)


# (first id, last id, length) -> (prefix, key): a burst's prefixes are equal tuples, but
# hashing a 256-id tuple to look it up costs more than comparing it with the one found
_TUPLE_KEYS: dict[tuple[int, int, int], tuple[tuple[int, ...], bytes]] = {}


def _prefix_key_of_tuple(blocks: tuple[int, ...]) -> bytes:
    if not blocks:
        return _digest(blocks)
    probe = (blocks[0], blocks[-1], len(blocks))
    hit = _TUPLE_KEYS.get(probe)
    if hit is not None and hit[0] == blocks:
        return hit[1]
    key = _digest(blocks)
    if len(_TUPLE_KEYS) >= 4096:
        _TUPLE_KEYS.clear()
    _TUPLE_KEYS[probe] = (blocks, key)
    return key


def _digest(blocks: Sequence[int]) -> bytes:
    try:
        payload = struct.pack(f"<{len(blocks)}q", *blocks)
    except struct.error:  # ids wider than 64 bits: fall back to their decimal text
        payload = b",".join(str(block).encode() for block in blocks)
    return hashlib.blake2b(payload, digest_size=16).digest()


@dataclass(slots=True)
class _Active:
    """An active prefix: warmed targets, and when it was last seen."""

    last_s: float
    warmed: bool = False
    targets: set[int] = field(default_factory=set)
    landed: set[int] = field(default_factory=set)  # targets seen holding the prefix
    replicas: int = 0  # M for this prefix (btb_adaptive grows it)
    depth: dict[int, int] = field(default_factory=dict)  # target → blocks prefilled so far
    blocks: tuple[int, ...] = ()  # the prefix itself (btb_cache acts on it)


@POLICIES.register("btb", aliases=("early_rdma",))
class BTB(Policy):
    """Burst detection + RDMA warming on top of cache_aware. Routes: WARM_HIT, or the
    fallback's CACHE_HIT / COLD / BALANCE."""

    name: ClassVar[str] = "btb"
    Params: ClassVar[type[StrictModel]] = BTBParams

    def __init__(self, params: StrictModel, *, seed: int = 0) -> None:
        super().__init__(params, seed=seed)
        self.cfg = require_params(params, BTBParams)
        self.rng = tie_rng(self.cfg, seed)
        self._arrivals: dict[bytes, deque[float]] = {}
        self._active: dict[bytes, _Active] = {}
        self._next_sweep_s = -math.inf
        self.fired = 0  # prefixes that became active
        self.warm_actions = 0  # WarmActions emitted

    def prefix_len_blocks(self, request: Request) -> int:
        """Y for this request, in blocks."""
        if self.cfg.prefix_tokens is not None:  # the full blocks: a part block is per request
            return max(1, self.cfg.prefix_tokens // request.block_tokens)
        return self.cfg.prefix_blocks

    def burst_count_for(self, request: Request, view: ClusterView) -> int:
        """X for this arrival."""
        return self.cfg.burst_count

    def burst_window_for(self, request: Request, view: ClusterView) -> float:
        """Z for this arrival, seconds."""
        return self.cfg.burst_window_s

    def replicas_for(
        self, active: _Active, view: ClusterView, members: set[int], candidates: list[InstanceLoad]
    ) -> int:
        """M for an active prefix whose warm set is `members` now."""
        return self.cfg.replicas

    def longest_window_s(self) -> float:
        """The longest Z this policy may use (how long detector state is kept)."""
        return self.cfg.burst_window_s

    def speculative_blocks(self, y: int) -> int:
        """Blocks of a Y-block prefix speculative prefill makes resident in the end."""
        return max(1, min(y, math.ceil(self.cfg.prefill_fraction * y - 1e-9)))

    def is_active(self, blocks: Sequence[int]) -> bool:
        """Whether the prefix made of exactly these blocks is active now."""
        return prefix_key(blocks) in self._active

    def route(self, request: Request, view: ClusterView) -> Decision:
        now_s = view.now_s
        self._sweep(now_s)
        y = self.prefix_len_blocks(request)
        if len(request.block_hashes) < y:
            return cache_aware_decision(request, view, self.cfg, self.rng)
        prefix = request.block_hashes[:y]
        key = prefix_key(prefix)
        active = self._active.get(key)
        if active is not None and now_s - active.last_s > self.cfg.idle_expiry_s:
            del self._active[key]
            self.expired(active)
            active = None
        if active is None:
            x = self.burst_count_for(request, view)
            if not self._burst_fired(key, now_s, x, self.burst_window_for(request, view)):
                return cache_aware_decision(request, view, self.cfg, self.rng)
            active = _Active(last_s=now_s, blocks=tuple(prefix))
            self._active[key] = active
            self.fired += 1
            self.events.append(
                EventRecord(
                    time_s=now_s,
                    kind="burst_detected",
                    request_id=request.request_id,
                    value=float(x),
                    label=key.hex()[:12],
                    origin="policy",
                )
            )
        active.last_s = now_s
        return self._route_active(request, view, prefix, active)

    def _burst_fired(self, key: bytes, now_s: float, count: int, window_s: float) -> bool:
        """Count one arrival; True when `count` (X) arrivals fall within the last
        `window_s` (Z) seconds."""
        arrivals = self._arrivals.get(key)
        if arrivals is None:
            arrivals = self._arrivals[key] = deque()
        horizon_s = now_s - window_s
        while arrivals and arrivals[0] < horizon_s:
            arrivals.popleft()
        arrivals.append(now_s)
        if len(arrivals) >= count:
            del self._arrivals[key]
            return True
        return False

    def _route_active(
        self, request: Request, view: ClusterView, prefix: Sequence[int], active: _Active
    ) -> Decision:
        y = len(prefix)
        candidates = serving(view)
        if self.cfg.route_active == "holders":  # a whole resident copy, nothing else
            holders = {
                inst.index for inst in candidates if view.complete_blocks(inst.index, prefix) >= y
            }
        else:
            holders = {
                inst.index
                for inst in candidates
                if view.match_blocks(inst.index, prefix) >= y
                or view.complete_blocks(inst.index, prefix) >= y
            }
        actions: tuple[WarmAction, ...] = ()
        if self.cfg.recopy:
            # a target seen holding the prefix has landed; one that lost it counts no more
            active.landed |= active.targets & holders
            active.targets -= active.landed - holders
            active.landed &= holders
        planned = active.targets - holders
        replicas = self.replicas_for(active, view, holders | planned, candidates)
        top_up = self.cfg.recopy or replicas > self.cfg.replicas  # btb_adaptive grows M
        if not active.warmed or (top_up and len(holders | planned) < replicas):
            source: int | None = None
            if self.cfg.mode == "rdma":
                complete = [
                    inst for inst in candidates if view.complete_blocks(inst.index, prefix) >= y
                ]
                if not complete:  # nothing to copy from yet: plain cache-aware
                    return cache_aware_decision(request, view, self.cfg, self.rng)
                source = least_load(complete, self.rng).index
            members = holders | planned
            wanted = max(0, replicas - len(members))
            lacking = self._by_load([inst for inst in candidates if inst.index not in members])
            targets = [inst.index for inst in lacking[:wanted]]
            n_blocks = y
            if self.cfg.mode == "prefill":
                n_blocks = self.speculative_blocks(y)
                if self.cfg.prefill_chunk_blocks is not None:
                    n_blocks = min(n_blocks, self.cfg.prefill_chunk_blocks)
                for t in targets:
                    active.depth[t] = n_blocks
            actions = tuple(
                WarmAction(source=source, target=t, n_blocks=n_blocks, mode=self.cfg.mode)
                for t in targets
            )
            active.targets.update(targets)
            active.warmed = True
            self.warm_actions += len(actions)
        elif self.cfg.prefill_chunk_blocks is not None:
            actions = self._next_chunks(active, y)
        warm = holders if self.cfg.route_active == "holders" else holders | active.targets
        warm_instances = [inst for inst in candidates if inst.index in warm]
        if not warm_instances:  # no holder yet, or the warm set left: route as cache_aware
            decision = cache_aware_decision(request, view, self.cfg, self.rng)
            return Decision(instance=decision.instance, route=decision.route, warm=actions)
        chosen = least_load(warm_instances, self.rng)
        return Decision(instance=chosen.index, route=ROUTE_WARM_HIT, warm=actions)

    def _next_chunks(self, active: _Active, y: int) -> tuple[WarmAction, ...]:
        """One more chunk on every target not yet prefilled to the end: the burst keeps
        coming, so more of the prefix is worth computing."""
        chunk = self.cfg.prefill_chunk_blocks
        assert chunk is not None
        cap = self.speculative_blocks(y)
        actions = []
        for target in sorted(active.depth):
            depth = active.depth[target]
            if depth >= cap:
                continue
            depth = active.depth[target] = min(cap, depth + chunk)
            actions.append(WarmAction(source=None, target=target, n_blocks=depth, mode="prefill"))
        self.warm_actions += len(actions)
        return tuple(actions)

    def _by_load(self, instances: list[InstanceLoad]) -> list[InstanceLoad]:
        """Copy targets in order of load; equal loads by index, or shuffled by the tie
        stream (`tie_break: random`)."""
        if self.rng is None:
            return sorted(instances, key=lambda inst: (inst.load, inst.index))
        keyed = [(inst.load, self.rng.random(), inst) for inst in instances]
        return [inst for _, _, inst in sorted(keyed, key=lambda k: (k[0], k[1]))]

    def _sweep(self, now_s: float) -> None:
        """Forget stale detector state so memory tracks the live window, not the trace."""
        if now_s < self._next_sweep_s:
            return
        window_s = self.longest_window_s()
        self._next_sweep_s = now_s + window_s
        horizon_s = now_s - window_s
        for key in [k for k, q in self._arrivals.items() if q[-1] < horizon_s]:
            del self._arrivals[key]
        expiry_s = now_s - self.cfg.idle_expiry_s
        for key in [k for k, a in self._active.items() if a.last_s < expiry_s]:
            self.expired(self._active.pop(key))

    def expired(self, active: _Active) -> None:
        """An active prefix expired (no arrival for `idle_expiry_s`): the burst is over."""
