"""The KV memory of one simulated instance: a block-level prefix cache over HBM, host RAM
and the cluster's shared disk, with the blocks and tokens running requests hold; plus the
router's own record of what it routed to an instance (`RoutedBlocks`).

Blocks are named by their hash. The engine decides when to reserve, pin and insert; this
module keeps the containers and their invariants, so it can be rebuilt over runs of blocks
without touching the engine.

The classes here are the reference implementation. `_cachec.c` implements the same two
classes in C, one table entry per block instead of four dicts; the engine uses it when it
is built (`implementation()`; `BTB_LAB_SIM_CACHE=python` forces the classes below).
Both give byte-identical records (tests/unit/test_sim_cache_impl.py).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Container, Sequence
from typing import Any

__all__ = ["IMPL_ENV", "PrefixCache", "RoutedBlocks", "SimInvariantError", "implementation"]

IMPL_ENV = "BTB_LAB_SIM_CACHE"


class SimInvariantError(AssertionError):
    """A model invariant broke (only checked with `audit=True`, as tests do)."""


def _lead(blocks: Container[int], hashes: Sequence[int]) -> int:
    """Leading blocks of `hashes` in `blocks`. (`PrefixCache.locate` and the engine's
    router view run this loop inline: they are on the per-arrival hot path.)"""
    n = 0
    for h in hashes:
        if h not in blocks:
            return n
        n += 1
    return n


class PrefixCache:
    """KV memory of one instance, `cap_tokens` in all, in blocks of `block_tokens`.

    - `reserved` (tokens, kept by the engine): KV that admitted requests hold outside the
      cache (prompt not yet cached, output).
    - pinned blocks: HBM blocks in use by admitted requests, with a reference count each
      (`pinned_tokens` is their number × block_tokens). Pinned blocks stay in HBM and are
      never evicted; when the last reference goes they become the most recently used
      unpinned block.
    - HBM: an LRU of resident blocks (pinned or not). `fit` evicts the least recently
      used unpinned blocks to host RAM (an LRU of `ram_cap_blocks`, 0 for none), whose own
      overflow goes to the shared disk set (unbounded; None when there is no disk tier).
    - pending: blocks expected here (a prefill running here, a copy in flight), with the
      time they will be complete; a block leaves it when inserted.

    Invariants (checked by `check`): pinned ⊆ HBM; HBM ∩ RAM = ∅; `len(ram) <=
    ram_cap_blocks`; `pinned_tokens + reserved <= cap_tokens` (the engine admits only what
    fits); and after every `fit`, `len(hbm) × block_tokens <= cap_tokens - reserved`: the
    unpinned blocks fill what the running requests leave.

    Where a pinned block stands in the LRU never matters: `fit` requeues it when met, and
    when its last reference goes it becomes the most recent unpinned block. So blocks that
    are pinned, or about to be, are not reordered (`promote`, `insert_pinned`), which
    leaves one LRU move per block a request holds, when it lets go.
    `tests/unit/test_sim_cache_model.py` checks this against a cache that reorders every
    block it is told to, operation by operation.

    The hot loops (`locate`, `insert_pinned`, `unpin`, `fit`) run per block of every
    request; keep them tight when re-implementing this over runs of blocks.
    """

    __slots__ = (
        "_hbm",
        "_pending",
        "_pins",
        "_ram",
        "block_tokens",
        "cache_whole",
        "cap_tokens",
        "disk",
        "name",
        "pinned_tokens",
        "ram_cap_blocks",
        "reserved",
        "stale_pending",
    )

    def __init__(
        self,
        name: str,
        cap_tokens: int,
        block_tokens: int,
        *,
        ram_cap_blocks: int = 0,
        disk: set[int] | None = None,
        cache_whole: bool = False,
    ) -> None:
        self.name = name
        # prefix_cache_budget whole: the cache may fill the whole budget whatever is
        # reserved (the seed simulator's double counting)
        self.cache_whole = cache_whole
        self.cap_tokens = cap_tokens
        self.block_tokens = block_tokens
        self.ram_cap_blocks = ram_cap_blocks
        self.disk = disk  # shared by every instance of the cluster
        self.reserved = 0
        self.pinned_tokens = 0  # pinned blocks × block_tokens, kept in step with the pins
        self._hbm: OrderedDict[int, None] = OrderedDict()
        self._ram: OrderedDict[int, None] = OrderedDict()
        self._pins: dict[int, int] = {}
        self._pending: dict[int, float] = {}
        # set when a block may be resident and pending at once (promoted from RAM or disk
        # while a copy or prefill of it is on its way); until then `insert_pinned` need not
        # clear the marks of the blocks its caller already pins
        self.stale_pending = False

    # ------------------------------------------------------------------ queries
    def n_hbm(self) -> int:
        """Blocks resident in HBM, pinned or not."""
        return len(self._hbm)

    def n_pinned(self) -> int:
        return len(self._pins)

    def pin_count(self, h: int) -> int:
        """References held on block `h` (0 when it is not pinned)."""
        return self._pins.get(h, 0)

    def lead(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` resident in HBM (complete, so a valid copy source)."""
        return _lead(self._hbm, hashes)

    def lead_pinned(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` pinned here: reusing them takes no new memory."""
        return _lead(self._pins, hashes)

    def locate(self, hashes: Sequence[int], now_s: float) -> tuple[int, int, int, int, int, float]:
        """Where the leading run of `hashes` is, as `(n_hbm, n, n_ram, n_disk, m,
        ready_s)`: the blocks before the first one outside HBM; the run's length over
        HBM, RAM and disk, with how many of it are in RAM and on disk; the run's end `m >=
        n` extended over blocks pending here, and when those are complete (`now_s` when
        none). One call for what a prefill start needs to know."""
        hbm = self._hbm
        n = 0
        for h in hashes:  # _lead(hbm, hashes), inline
            if h not in hbm:
                break
            n += 1
        n_hbm = n
        n_ram = n_disk = 0
        ram = self._ram
        disk = self.disk
        if n < len(hashes) and (ram or disk is not None):
            # the run goes on through RAM and disk (and HBM again after them)
            for h in hashes[n:]:
                if h in hbm:
                    pass
                elif h in ram:
                    n_ram += 1
                elif disk is not None and h in disk:
                    n_disk += 1
                else:
                    break
                n += 1
        if self._pending and n < len(hashes):
            m, ready_s = self.pending_run(hashes, n, now_s)
            return n_hbm, n, n_ram, n_disk, m, ready_s
        return n_hbm, n, n_ram, n_disk, n, now_s

    def pending_run(self, hashes: Sequence[int], start: int, ready_s: float) -> tuple[int, float]:
        """Extend a leading run at `hashes[start:]` over blocks pending here: returns the
        run's new end and the latest of `ready_s` and their completion times."""
        pending = self._pending
        end = start
        for h in hashes[start:]:
            t = pending.get(h)
            if t is None:
                break
            end += 1
            if t > ready_s:
                ready_s = t
        return end, ready_s

    # ------------------------------------------------------------------ updates
    def insert(self, hashes: Sequence[int], *, fit: bool = True) -> None:
        """Make `hashes` resident in HBM as the most recently used (from RAM if there),
        no longer pending; then `fit` unless told not to."""
        hbm = self._hbm
        ram = self._ram
        pending = self._pending
        move = hbm.move_to_end
        for h in hashes:
            if h in hbm:
                move(h)
            else:
                hbm[h] = None
                if ram:
                    ram.pop(h, None)
        if pending:
            for h in hashes:
                pending.pop(h, None)
        if fit:
            self.fit()

    def touch(self, hashes: Sequence[int], n: int) -> None:
        """Reuse the leading `n` blocks of `hashes` (all present in some tier): each
        becomes the most recent HBM block, promoted from RAM or disk. Unlike `insert` this
        neither fits nor clears pending marks."""
        hbm = self._hbm
        ram = self._ram
        pending = self._pending
        for h in hashes[:n]:
            if h in hbm:
                hbm.move_to_end(h)
            else:
                hbm[h] = None
                ram.pop(h, None)
                if h in pending:
                    self.stale_pending = True

    def promote(self, hashes: Sequence[int], start: int, n: int) -> None:
        """`touch(hashes, n)` for blocks about to be pinned, whose order does not matter
        (see the class docstring): of `hashes[start:n]` (all present in some tier), those
        in RAM or on disk become resident; none is reordered."""
        hbm = self._hbm
        ram = self._ram
        pending = self._pending
        for h in hashes[start:n]:
            if h not in hbm:
                hbm[h] = None
                ram.pop(h, None)
                if h in pending:
                    self.stale_pending = True

    def insert_arrived(self, hashes: Sequence[int], now_s: float, eps_s: float) -> None:
        """A copy of `hashes` landed at `now_s`: insert the blocks still expected by then
        (a block no longer pending became resident otherwise, or was never expected)."""
        pending = self._pending
        inf = float("inf")
        self.insert([h for h in hashes if pending.get(h, inf) <= now_s + eps_s])

    def expect(self, hashes: Sequence[int], start: int, done_s: float) -> None:
        """A prefill here completes `hashes[start:]` at `done_s`: mark the blocks not in
        HBM as pending until then (replacing any earlier mark)."""
        hbm = self._hbm
        pending = self._pending
        for h in hashes[start:]:
            if h not in hbm:
                pending[h] = done_s

    def expect_copy(self, hashes: Sequence[int], done_s: float) -> None:
        """A copy of `hashes` lands at `done_s`: mark the blocks not in HBM as pending until
        then, or until their current mark if that is later."""
        hbm = self._hbm
        pending = self._pending
        for h in hashes:
            if h not in hbm:
                pending[h] = max(pending.get(h, 0.0), done_s)

    def fit(self) -> None:
        """Evict least recently used unpinned blocks to host RAM (RAM's own overflow to
        disk) until HBM fits in the KV the running requests leave; pinned blocks met on
        the way stay, requeued as the most recent."""
        if self.cache_whole:
            allowed = self.cap_tokens // self.block_tokens
        else:
            allowed = (self.cap_tokens - self.reserved) // self.block_tokens
        hbm = self._hbm
        if len(hbm) <= allowed:
            return
        ram = self._ram
        ram_cap = self.ram_cap_blocks
        disk = self.disk
        pins = self._pins
        pop = hbm.popitem
        skipped = 0
        excess = len(hbm) - allowed
        # popitem(False): the oldest; positional, as a keyword costs more per eviction
        while excess:
            h, _ = pop(False)
            if pins and h in pins:
                # in use by a running request: it stays resident (now the most recent)
                hbm[h] = None
                skipped += 1
                if skipped > len(pins):
                    raise SimInvariantError(f"{self.name}: pinned blocks exceed the KV budget")
                continue
            excess -= 1
            if ram_cap:
                ram[h] = None
                if len(ram) > ram_cap:
                    old, _ = ram.popitem(False)
                    if disk is not None:
                        disk.add(old)
            elif disk is not None:
                disk.add(h)

    def pin(self, hashes: Sequence[int], start: int, upto: int) -> int:
        """Take a reference on `hashes[start:upto]` (resident in HBM); returns the tokens
        those blocks hold, which their holder no longer needs to reserve."""
        if upto <= start:
            return 0
        pins = self._pins
        get = pins.get
        n0 = len(pins)
        if start == 0 and upto == len(hashes):
            for h in hashes:
                pins[h] = get(h, 0) + 1
        else:
            for i in range(start, upto):
                h = hashes[i]
                pins[h] = get(h, 0) + 1
        self.pinned_tokens += (len(pins) - n0) * self.block_tokens
        return (upto - start) * self.block_tokens

    def insert_pinned(self, hashes: Sequence[int], start: int) -> int:
        """`insert(hashes, fit=False)` and `pin(hashes, start, len(hashes))` in one pass,
        where the caller already pins `hashes[:start]` (this runs once per request, so the
        two loops are fused); returns the tokens newly pinned. Blocks pinned before are
        not reordered (see the class docstring)."""
        hbm = self._hbm
        ram = self._ram
        pending = self._pending
        pins = self._pins
        get = pins.get
        n0 = len(pins)
        for h in hashes[start:] if start else hashes:
            refs = get(h, 0)
            if not refs and h not in hbm:
                hbm[h] = None
                if ram:
                    ram.pop(h, None)
            pins[h] = refs + 1
        if pending:
            # hashes[:start] were resident when pinned, so pending only if promoted so
            for h in hashes if self.stale_pending or not start else hashes[start:]:
                pending.pop(h, None)
        else:
            self.stale_pending = False
        bt = self.block_tokens
        self.pinned_tokens += (len(pins) - n0) * bt
        return (len(hashes) - start) * bt

    def unpin(self, hashes: Sequence[int], n: int) -> None:
        """Drop one reference on each of the leading `n` blocks of `hashes`; a block nobody
        pins any more becomes the most recent unpinned block."""
        pins = self._pins
        hbm = self._hbm
        n0 = len(pins)
        for h in hashes if n == len(hashes) else hashes[:n]:
            refs = pins[h] - 1
            if refs:
                pins[h] = refs
            else:
                del pins[h]
                hbm.move_to_end(h)
        self.pinned_tokens -= (n0 - len(pins)) * self.block_tokens

    def host_lead(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` held here in HBM or host RAM."""
        hbm = self._hbm
        ram = self._ram
        n = 0
        for h in hashes:
            if h not in hbm and h not in ram:
                return n
            n += 1
        return n

    def in_ram(self, hashes: Sequence[int]) -> list[int]:
        """The blocks of `hashes` in host RAM (not in HBM)."""
        ram = self._ram
        return [h for h in hashes if h in ram] if ram else []

    def drop(self, hashes: Sequence[int]) -> int:
        """Evict `hashes` outright: their unpinned HBM blocks and their host-RAM copies
        go (pinned blocks stay); returns the HBM blocks freed."""
        hbm = self._hbm
        ram = self._ram
        pins = self._pins
        freed = 0
        for h in hashes:
            if h in hbm and h not in pins:
                del hbm[h]
                freed += 1
            ram.pop(h, None)
            self._pending.pop(h, None)
        return freed

    def demote(self, hashes: Sequence[int]) -> list[int]:
        """Move the unpinned HBM blocks of `hashes` to host RAM as its most recent blocks
        (RAM's overflow to disk, as `fit` does); returns the blocks moved. Without a host
        tier nothing moves."""
        if not self.ram_cap_blocks:
            return []
        hbm = self._hbm
        ram = self._ram
        pins = self._pins
        moved = [h for h in hashes if h in hbm and h not in pins]
        for h in moved:
            del hbm[h]
            ram[h] = None
        while len(ram) > self.ram_cap_blocks:
            old, _ = ram.popitem(False)
            if self.disk is not None:
                self.disk.add(old)
        return moved

    # ------------------------------------------------------------------ audit
    def snapshot(self) -> tuple[list[int], dict[int, int], list[int], dict[int, float]]:
        """What decides every later answer, for tests: the unpinned HBM blocks oldest
        first, the pins, the host-RAM blocks oldest first, and the pending marks. (The
        pinned blocks' places in the LRU are left out: they never matter.)"""
        pins = self._pins
        unpinned = [h for h in self._hbm if h not in pins]
        return unpinned, dict(pins), list(self._ram), dict(self._pending)

    def check(self) -> None:
        """Raise `SimInvariantError` if an invariant of the class docstring is broken."""
        name = self.name
        bt = self.block_tokens
        if self.reserved > self.cap_tokens:
            raise SimInvariantError(f"{name}: reserved KV above budget")
        cache_cap = self.cap_tokens if self.cache_whole else self.cap_tokens - self.reserved
        if len(self._hbm) * bt > cache_cap:
            raise SimInvariantError(f"{name}: HBM cache above its budget")
        if len(self._pins) * bt + self.reserved > self.cap_tokens:
            raise SimInvariantError(f"{name}: pinned + reserved KV above budget")
        if self.pinned_tokens != len(self._pins) * bt:
            raise SimInvariantError(f"{name}: pinned token count {self.pinned_tokens} is off")
        for h, refs in self._pins.items():
            if refs <= 0:
                raise SimInvariantError(f"{name}: block {h} pinned {refs} times")
            if h not in self._hbm:
                raise SimInvariantError(f"{name}: pinned block {h} was evicted")
        if len(self._ram) > self.ram_cap_blocks:
            raise SimInvariantError(f"{name}: host RAM cache above its budget")
        if not self._hbm.keys().isdisjoint(self._ram):
            raise SimInvariantError(f"{name}: a block is in HBM and host RAM at once")


class RoutedBlocks:
    """What a router believes one instance holds (`router_view: routed`): the blocks of
    the requests routed or warmed there, an LRU of at most `cap_blocks`, regardless of
    what the instance actually keeps."""

    __slots__ = ("_blocks", "cap_blocks")

    def __init__(self, cap_blocks: int) -> None:
        self.cap_blocks = cap_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def note(self, hashes: Sequence[int]) -> None:
        """`hashes` were routed here: they become the most recent, the oldest drop out."""
        blocks = self._blocks
        move = blocks.move_to_end
        for h in hashes:
            if h in blocks:
                move(h)
            else:
                blocks[h] = None
        cap = self.cap_blocks
        while len(blocks) > cap:
            blocks.popitem(False)  # the oldest

    def lead(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` believed held."""
        return _lead(self._blocks, hashes)


def implementation() -> tuple[str, Any, Any]:
    """The cache this process simulates with, as `(name, PrefixCache class, RoutedBlocks
    class)`: "compiled" when `_cachec` is built, else "python"; `BTB_LAB_SIM_CACHE`
    (python or compiled) chooses. Raises ValueError for another value, or for compiled
    when it is not built."""
    wanted = os.environ.get(IMPL_ENV, "")
    if wanted not in ("", "python", "compiled"):
        raise ValueError(f"{IMPL_ENV}={wanted!r}: expected python or compiled")
    if wanted != "python":
        try:
            import btb_lab.sim._cachec as _cachec
        except ImportError as exc:
            if wanted == "compiled":
                raise ValueError(
                    f"{IMPL_ENV}=compiled, but btb_lab.sim._cachec is not built ({exc}); "
                    "reinstall with a C compiler (make install)"
                ) from None
        else:
            _cachec.init(SimInvariantError)
            return "compiled", _cachec.PrefixCache, _cachec.RoutedBlocks
    return "python", PrefixCache, RoutedBlocks
