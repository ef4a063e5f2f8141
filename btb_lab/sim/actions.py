"""Cache actions a policy decides as data (`CacheAction`): pin, unpin, evict, demote
and promote a prefix on one instance, carried out and charged here.

- pin: the prefix's leading HBM-resident blocks take one reference (the same ref-counted
  pins running requests hold, so the cache never evicts them) until `ttl_s` has passed;
  pinning a held prefix again extends the hold and pins blocks that became resident
  since. Pins need `kv_prefix_sharing` (without it the cache pins nothing). A pin that
  would push pinned + reserved KV over the budget is skipped.
- unpin: the hold is released now (the blocks become the most recent unpinned ones).
- evict: the hold is released and the prefix's unpinned blocks leave HBM and host RAM.
- demote: the hold is released and the unpinned HBM blocks move to host RAM at once
  (their HBM frees now); the copy is charged on the instance's host link, `ram_token_s`
  per token, which delays a later promote there. Spilling by LRU costs the engine
  nothing, as before: only a decided demote is charged.
- promote: the prefix's host-RAM blocks (within its leading run over HBM and RAM) come
  back to HBM over the host link (setup + `ram_token_s` per token, one transfer at a time
  per instance); they are pending there until then, so a prefill may wait for them.

This layer sits on `transfers.py` and below `engine.py`; its counters enter the run's
stats only when a policy decides actions, so runs without them are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from btb_lab.policies.base import CacheAction
from btb_lab.records import Request
from btb_lab.sim.decode import TIME_EPS_S
from btb_lab.sim.instance import InstanceState
from btb_lab.sim.scheduler import PRI_TRANSFER
from btb_lab.sim.transfers import Transfers

__all__ = ["EV_CACHE", "CacheActions"]

EV_CACHE = 4  # a hold expiring or a promote landing (`Engine._run`'s handler index)


@dataclass(slots=True)
class _Hold:
    """A policy's pin on a prefix of one instance."""

    n_blocks: int  # leading blocks pinned
    expiry_s: float
    version: int  # the expiry event that may release it


@dataclass(slots=True, frozen=True)
class _Expiry:
    key: tuple[int, tuple[int, ...]]
    version: int


@dataclass(slots=True, frozen=True)
class _Promote:
    hashes: list[int]
    start_s: float
    tokens: int
    request_id: str


class CacheActions(Transfers):
    """The engine's cache actions, on top of KV movement and scheduling."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the policy's pins: (instance, prefix blocks) -> hold
        self.holds: dict[tuple[int, tuple[int, ...]], _Hold] = {}
        self.hold_versions = 0

    def _cache_action(self, req: Request, action: CacheAction) -> None:
        """Carry out one cache action a policy asked for at `req`'s arrival."""
        if not 0 <= action.instance < len(self.insts):
            raise ValueError(f"cache action on instance {action.instance}: out of range")
        inst = self.insts[action.instance]
        blocks = action.blocks
        kind = action.kind
        if kind == "pin":
            self._pin(inst, blocks, action.ttl_s)
            return
        if kind == "promote":
            self._promote(inst, blocks, req.request_id)
            return
        self._release(inst, blocks)
        if kind == "evict":
            freed = inst.cache.drop(blocks)
            self._count("cache_evicts", 1)
            self._count("cache_evicted_blocks", freed)
            self._note(inst, "evict", self.now, self.now, freed, req.request_id)
            self._kick(inst)
        elif kind == "demote":
            moved = inst.cache.demote(blocks)
            if not moved:
                self._count("cache_actions_skipped", 1)
                return
            tokens = len(moved) * self.block_tokens
            start = max(self.now, inst.host_free_s)
            done = inst.host_free_s = start + tokens * inst.ram_tok_s
            self._count("cache_demotes", 1)
            self._count("cache_demoted_tokens", tokens)
            self._count("cache_host_link_s", done - start)
            self._note(inst, "demote", start, done, tokens, req.request_id)
            self._kick(inst)

    def _count(self, name: str, value: float) -> None:
        self.stats[name] = self.stats.get(name, 0) + value

    def _note(
        self, inst: InstanceState, kind: str, start_s: float, end_s: float, tokens: float,
        request_id: str,
    ) -> None:  # fmt: skip
        if self.events is not None:
            self.events.cache_action(start_s, end_s, inst.name, kind, tokens, request_id)

    def _pin(self, inst: InstanceState, blocks: tuple[int, ...], ttl_s: float | None) -> None:
        cache = inst.cache
        n = cache.lead(blocks)
        key = (inst.index, blocks)
        hold = self.holds.get(key)
        expiry = self.now + (ttl_s if ttl_s is not None else float("inf"))
        if hold is not None:
            if n > hold.n_blocks and self._pin_fits(inst, blocks, hold.n_blocks, n):
                hold.n_blocks = n
            hold.expiry_s = max(hold.expiry_s, expiry)
            return
        if not self.sharing or n == 0 or not self._pin_fits(inst, blocks, 0, n):
            self._count("cache_actions_skipped", 1)
            return
        self.hold_versions += 1
        self.holds[key] = _Hold(n, expiry, self.hold_versions)
        self._count("cache_pins", 1)
        self._count("cache_pinned_tokens", n * self.block_tokens)
        if expiry != float("inf"):
            self._push(expiry, PRI_TRANSFER, EV_CACHE, inst.index, _Expiry(key, self.hold_versions))

    def _pin_fits(
        self, inst: InstanceState, blocks: tuple[int, ...], start: int, upto: int
    ) -> bool:
        """Pin `blocks[start:upto]` unless pinned + reserved KV would pass the budget."""
        cache = inst.cache
        new = sum(1 for h in blocks[start:upto] if not cache.pin_count(h))
        if cache.pinned_tokens + new * self.block_tokens + cache.reserved > cache.cap_tokens:
            return False
        cache.pin(blocks, start, upto)
        return True

    def _release(self, inst: InstanceState, blocks: tuple[int, ...]) -> None:
        """Drop the policy's pin on `blocks` on `inst`, if it holds one."""
        hold = self.holds.pop((inst.index, blocks), None) if self.holds else None
        if hold is not None:
            inst.cache.unpin(blocks, hold.n_blocks)
            self._kick(inst)

    def _promote(self, inst: InstanceState, blocks: tuple[int, ...], request_id: str) -> None:
        cache = inst.cache
        run = blocks[: cache.host_lead(blocks)]
        moving = cache.in_ram(run)
        if not moving:
            self._count("cache_actions_skipped", 1)
            return
        tokens = len(moving) * self.block_tokens
        start = max(self.now, inst.host_free_s)
        done = inst.host_free_s = start + self.setup_s + tokens * inst.ram_tok_s
        cache.expect_copy(moving, done)
        self._count("cache_promotes", 1)
        self._count("cache_promoted_tokens", tokens)
        self._count("cache_host_link_s", done - start)
        self._push(
            done, PRI_TRANSFER, EV_CACHE, inst.index, _Promote(moving, start, tokens, request_id)
        )

    def _on_cache(self, index: int, payload: _Expiry | _Promote) -> None:
        inst = self.insts[index]
        if isinstance(payload, _Promote):
            inst.cache.insert_arrived(payload.hashes, self.now, TIME_EPS_S)
            self._note(
                inst, "promote", payload.start_s, self.now, payload.tokens, payload.request_id
            )
            self._kick(inst)
            return
        hold = self.holds.get(payload.key)
        if hold is None or hold.version != payload.version:
            return  # released (or replaced) since
        if hold.expiry_s > self.now + TIME_EPS_S:  # extended: wait until the new expiry
            self._push(hold.expiry_s, PRI_TRANSFER, EV_CACHE, index, payload)
            return
        del self.holds[payload.key]
        inst.cache.unpin(payload.key[1], hold.n_blocks)
        self._kick(inst)
