"""BTB with cache actions beyond replicate: the BTB write-up's future work, item 3.

`btb_cache` is BTB (burst detection, warming, routing, the cache-aware fallback) that
also decides `CacheAction`s about a burst's prefix, in the write-up's burst vocabulary:

* pin (`pin`): while a prefix is active, every warm replica holding it in HBM pins it
  for `pin_ttl_s` (default `idle_expiry_s`), renewed at each arrival of the prefix, so
  background and decoy traffic between the burst's requests cannot evict it.
* promote (`promote`): a warm target that holds the prefix in host RAM has it promoted
  RAM → HBM over its host link instead of being sent a copy (or recomputing it); and
  when no instance holds a complete HBM copy to copy from (where BTB falls back to
  cache-aware routing), up to M instances holding it in host RAM promote it and serve
  the burst.
* demote (`demote_on_expiry`): when an active prefix expires (no arrival for
  `idle_expiry_s`: the burst is over), the replicas it was pinned on demote it to host
  RAM at once, freeing HBM for the next burst rather than waiting for the LRU.
* evict (`evict_decoys`): a prefix seen, never active, whose last arrival is
  `decoy_evict_after_s` old (a decoy: repeated, not a burst) is evicted from every
  instance holding it, HBM and host RAM; a later arrival of it recomputes.

Actions decided when nothing about the current request calls for them (a demote or an
evict noticed at some arrival) ride on the next decision. A demote of the prefix the
current request brings back is dropped.

Real cluster: refused (`cluster_refusal`, checked when a hypothesis is loaded). vLLM's
prefix cache has no per-prefix pin (its free blocks are evicted LRU); its only eviction
command is `POST /reset_prefix_cache` (served with `VLLM_SERVER_DEV_MODE=1`), which drops
every unused cached block, not one prefix; CPU offload (the OffloadingConnector,
`--kv-offloading-backend native`, or LMCache) stores and loads blocks by itself, with no
request to demote or promote a given prefix. A promote can only be approximated there by
a prefix-only request (BTB's `mode: prefill` warm), which loads the prefix from CPU when
the connector holds it and recomputes it otherwise.
"""

from __future__ import annotations

import math
from typing import ClassVar

from pydantic import Field, model_validator

from btb_lab.config.base import StrictModel
from btb_lab.policies.base import (
    POLICIES,
    CacheAction,
    ClusterView,
    Decision,
    WarmAction,
)
from btb_lab.policies.btb import BTB, ROUTE_WARM_HIT, BTBParams, _Active, prefix_key
from btb_lab.policies.common import least_load, require_params, serving
from btb_lab.records import Request

__all__ = ["CLUSTER_REFUSAL", "CacheBTB", "CacheBTBParams"]

CLUSTER_REFUSAL = (
    "btb_cache runs on the simulator only: vLLM has no per-prefix pin, demote or promote "
    "(CPU offload connectors move blocks by themselves) and evicts only the whole prefix "
    "cache (POST /reset_prefix_cache, with VLLM_SERVER_DEV_MODE=1)"
)


class CacheBTBParams(BTBParams):
    """BTB plus the cache actions it takes about active prefixes and decoys."""

    pin: bool = Field(True, description="Pin an active prefix on its warm replicas' HBM.")
    pin_ttl_s: float | None = Field(
        None,
        gt=0,
        description="How long a pin lasts after the prefix's last arrival; unset: "
        "idle_expiry_s (a pin ends when the burst expires).",
    )
    promote: bool = Field(
        True,
        description="Warm targets holding the prefix in host RAM promote it to HBM instead "
        "of receiving a copy; with no HBM copy anywhere, holders in RAM promote it.",
    )
    demote_on_expiry: bool = Field(
        True,
        description="When an active prefix expires, demote it to host RAM on the replicas "
        "it was pinned on.",
    )
    evict_decoys: bool = Field(
        False,
        description="Evict a prefix that was seen but never became active, "
        "decoy_evict_after_s after its last arrival, from every instance holding it.",
    )
    decoy_evict_after_s: float = Field(
        5.0,
        gt=0,
        description="evict_decoys only: seconds since a never-active prefix's last arrival "
        "before it is evicted.",
    )

    @model_validator(mode="after")
    def _actions_consistent(self) -> CacheBTBParams:
        if not (self.pin or self.promote or self.demote_on_expiry or self.evict_decoys):
            raise ValueError(
                "btb_cache needs at least one of pin, promote, demote_on_expiry, evict_decoys "
                "(with none it is btb)"
            )
        if self.pin_ttl_s is not None and not self.pin:
            raise ValueError("pin_ttl_s needs pin: true")
        if "decoy_evict_after_s" in self.model_fields_set and not self.evict_decoys:
            raise ValueError("decoy_evict_after_s needs evict_decoys: true")
        return self


@POLICIES.register("btb_cache")
class CacheBTB(BTB):
    """BTB that pins, promotes, demotes and evicts prefixes as well as copying them."""

    name: ClassVar[str] = "btb_cache"
    Params: ClassVar[type[StrictModel]] = CacheBTBParams
    cluster_refusal: ClassVar[str | None] = CLUSTER_REFUSAL

    def __init__(self, params: StrictModel, *, seed: int = 0) -> None:
        super().__init__(params, seed=seed)
        self.cache_cfg = require_params(params, CacheBTBParams)
        self._deferred: list[CacheAction] = []  # decided between arrivals, sent with the next
        self._pinned_on: dict[bytes, set[int]] = {}  # active prefix → instances pinned on
        self._seen: dict[bytes, tuple[tuple[int, ...], float]] = {}  # never active: blocks, last
        self._next_decoy_check_s = -math.inf
        self.cache_actions = 0  # CacheActions emitted

    def expired(self, active: _Active) -> None:
        key = prefix_key(active.blocks)
        members = self._pinned_on.pop(key, set())
        if self.cache_cfg.demote_on_expiry:
            self._deferred += [
                CacheAction("demote", i, active.blocks) for i in sorted(members | active.targets)
            ]

    def route(self, request: Request, view: ClusterView) -> Decision:
        decision = super().route(request, view)
        y = self.prefix_len_blocks(request)
        actions: list[CacheAction] = []
        if len(request.block_hashes) >= y:
            prefix = tuple(request.block_hashes[:y])
            key = prefix_key(prefix)
            active = self._active.get(key)
            if active is None:
                if self.cache_cfg.evict_decoys:
                    self._seen[key] = (prefix, view.now_s)
            else:
                self._seen.pop(key, None)
                # the prefix is back: its pending demote would only cost a reload
                self._deferred = [a for a in self._deferred if a.blocks != prefix]
                decision = self._act_on_active(decision, view, prefix, key, active, actions)
        if self.cache_cfg.evict_decoys:
            self._evict_decoys(view, actions)
        if self._deferred:
            actions = self._deferred + actions
            self._deferred = []
        if not actions:
            return decision
        self.cache_actions += len(actions)
        decision.cache = decision.cache + tuple(actions)
        return decision

    def _act_on_active(
        self, decision: Decision, view: ClusterView, prefix: tuple[int, ...], key: bytes,
        active: _Active, actions: list[CacheAction],
    ) -> Decision:  # fmt: skip
        cfg = self.cache_cfg
        y = len(prefix)
        if cfg.promote:
            if not active.warmed:  # no HBM copy to copy from: promote where RAM holds it
                decision = self._promote_from_ram(decision, view, prefix, active, actions)
            else:
                kept: list[WarmAction] = []
                for warm in decision.warm:
                    if view.host_blocks(warm.target, prefix) >= y:
                        actions.append(CacheAction("promote", warm.target, prefix))
                    else:
                        kept.append(warm)
                decision.warm = tuple(kept)
        if cfg.pin:
            ttl_s = cfg.pin_ttl_s if cfg.pin_ttl_s is not None else cfg.idle_expiry_s
            members = self._pinned_on.setdefault(key, set())
            for inst in serving(view):
                i = inst.index
                resident = view.complete_blocks(i, prefix)
                if resident and (
                    resident >= y or i in active.targets or i == decision.instance
                    or i in members
                ):  # fmt: skip
                    actions.append(CacheAction("pin", i, prefix, ttl_s))
                    members.add(i)
        return decision

    def _promote_from_ram(
        self, decision: Decision, view: ClusterView, prefix: tuple[int, ...], active: _Active,
        actions: list[CacheAction],
    ) -> Decision:  # fmt: skip
        y = len(prefix)
        holders = [inst for inst in serving(view) if view.host_blocks(inst.index, prefix) >= y]
        if not holders:
            return decision
        chosen = self._by_load(holders)[: self.cfg.replicas]
        for inst in chosen:
            actions.append(CacheAction("promote", inst.index, prefix))
            active.targets.add(inst.index)
        active.warmed = True
        target = least_load(chosen, self.rng)
        return Decision(instance=target.index, route=ROUTE_WARM_HIT, warm=decision.warm)

    def _evict_decoys(self, view: ClusterView, actions: list[CacheAction]) -> None:
        """Evict prefixes that were seen, never became active, and have gone quiet."""
        now_s = view.now_s
        if now_s < self._next_decoy_check_s:
            return
        after_s = self.cache_cfg.decoy_evict_after_s
        self._next_decoy_check_s = now_s + after_s / 4
        horizon_s = now_s - after_s
        for key in [k for k, (_, last_s) in self._seen.items() if last_s < horizon_s]:
            blocks, _ = self._seen.pop(key)
            for inst in serving(view):
                if view.host_blocks(inst.index, blocks) > 0:
                    actions.append(CacheAction("evict", inst.index, blocks))
