"""Known answers for the per-instance prefix cache and the router's routed-block LRU."""

from __future__ import annotations

import sys

import pytest

from btb_lab.sim import cache as cache_module
from btb_lab.sim.cache import PrefixCache, RoutedBlocks, SimInvariantError
from btb_lab.sim.decode import TIME_EPS_S
from tests.unit.test_sim_cache_model import implementations

BT = 16


@pytest.fixture(autouse=True, params=implementations())
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on both implementations of the cache."""
    monkeypatch.setenv(cache_module.IMPL_ENV, request.param)
    _, cache_cls, routed_cls = cache_module.implementation()
    monkeypatch.setattr(sys.modules[__name__], "PrefixCache", cache_cls)
    monkeypatch.setattr(sys.modules[__name__], "RoutedBlocks", routed_cls)
    return str(request.param)


def cache(blocks: int, *, ram: int = 0, disk: set[int] | None = None) -> PrefixCache:
    return PrefixCache("C0", blocks * BT, BT, ram_cap_blocks=ram, disk=disk)


def resident(c: PrefixCache, hashes: list[int]) -> list[int]:
    """The blocks of `hashes` resident in HBM."""
    return [h for h in hashes if c.lead([h])]


def test_lru_evicts_the_least_recently_used_block_first() -> None:
    c = cache(4)
    c.insert([1, 2, 3, 4])
    c.insert([1])  # 1 becomes the most recent: 2 is now the oldest
    c.insert([5])
    assert resident(c, [1, 2, 3, 4, 5]) == [1, 3, 4, 5]
    c.insert([6])
    assert resident(c, [1, 2, 3, 4, 5, 6]) == [1, 4, 5, 6]
    assert c.n_hbm() == 4


def test_reserved_tokens_shrink_what_the_cache_may_hold() -> None:
    c = cache(4)
    c.insert([1, 2, 3, 4])
    c.reserved = 2 * BT + 1  # 2 blocks and a token: only one whole block is left
    c.fit()
    assert resident(c, [1, 2, 3, 4]) == [4]
    c.check()


def test_pinned_blocks_are_never_evicted_and_become_most_recent_when_released() -> None:
    c = cache(4)
    assert c.insert_pinned([1, 2], 0) == 2 * BT
    assert (c.pin_count(1), c.pin_count(2), c.pinned_tokens) == (1, 1, 2 * BT)
    c.insert([3, 4, 5, 6], fit=False)
    c.fit()  # the two oldest (1, 2) are pinned: they stay, and 3, 4 go
    assert resident(c, [1, 2, 3, 4, 5, 6]) == [1, 2, 5, 6]
    c.reserved = BT  # room for 3 blocks: the oldest unpinned one, 5, goes
    c.fit()
    assert resident(c, [1, 2, 5, 6]) == [1, 2, 6]
    c.unpin([1, 2], 2)  # now evictable, and the most recent
    assert (c.n_pinned(), c.pinned_tokens) == (0, 0)
    c.reserved = 2 * BT
    c.fit()
    assert resident(c, [1, 2, 6]) == [1, 2]
    c.insert([7])
    assert resident(c, [1, 2, 7]) == [2, 7]
    c.check()


def test_the_last_unpin_makes_a_block_the_most_recent() -> None:
    c = cache(3)
    c.insert_pinned([1], 0)
    c.insert_pinned([1], 0)  # two holders
    c.insert([2, 3])
    c.unpin([1], 1)  # one holder left: still pinned, so the oldest unpinned block goes
    c.insert([4])
    assert resident(c, [1, 2, 3, 4]) == [1, 3, 4]
    c.insert([3, 4])  # 1 is the oldest again
    c.unpin([1], 1)  # now evictable, but the most recent: 3 goes before it
    c.insert([5])
    assert resident(c, [1, 3, 4, 5]) == [1, 4, 5]


def test_pins_are_counted_per_holder() -> None:
    c = cache(8)
    c.insert_pinned([1, 2, 3], 0)
    assert c.insert_pinned([1, 2, 4], 1) == 2 * BT  # pins 2 and 4, not 1 again
    assert [c.pin_count(h) for h in (1, 2, 3, 4)] == [1, 2, 1, 1]
    assert c.pinned_tokens == 4 * BT
    assert c.lead_pinned([1, 2, 3, 9]) == 3
    assert c.lead_pinned([4, 1]) == 2
    assert c.lead_pinned([5, 1]) == 0
    c.unpin([1, 2, 3], 3)
    assert [c.pin_count(h) for h in (1, 2, 3, 4)] == [0, 1, 0, 1]
    assert c.pinned_tokens == 2 * BT
    assert c.pin([2, 4, 9], 0, 2) == 2 * BT  # 2 and 4 again, 9 is past `upto`
    assert c.pin([1, 2], 2, 2) == 0
    assert [c.pin_count(h) for h in (2, 4, 9)] == [2, 2, 0]
    assert c.pinned_tokens == 2 * BT  # still two distinct blocks


def test_pinned_blocks_above_the_budget_are_an_invariant_error() -> None:
    c = cache(2)
    c.insert_pinned([1, 2], 0)
    c.reserved = BT
    with pytest.raises(SimInvariantError, match="pinned blocks exceed the KV budget"):
        c.fit()


def test_host_ram_overflows_to_the_shared_disk() -> None:
    disk: set[int] = set()
    c = cache(2, ram=2, disk=disk)
    for h in (1, 2, 3, 4, 5):
        c.insert([h])
    # HBM holds 4, 5; RAM the two evicted after 1 (2, 3); 1 fell through to disk
    assert resident(c, [1, 2, 3, 4, 5]) == [4, 5]
    assert disk == {1}
    # (n_hbm, n, n_ram, n_disk, m, ready_s)
    assert c.locate([1, 2, 3, 4, 5, 9], 3.0) == (0, 5, 2, 1, 5, 3.0)
    assert c.locate([4, 5, 2, 9, 1], 3.0) == (2, 3, 1, 0, 3, 3.0)
    assert c.locate([4, 5], 3.0) == (2, 2, 0, 0, 2, 3.0)
    # another instance sees the same disk
    other = cache(2, ram=2, disk=disk)
    assert other.locate([1, 2], 0.0) == (0, 1, 0, 1, 1, 0.0)
    c.check()


def test_without_a_disk_tier_ram_overflow_is_dropped() -> None:
    c = cache(1, ram=1)
    for h in (1, 2, 3):
        c.insert([h])
    assert c.locate([1], 0.0) == (0, 0, 0, 0, 0, 0.0)
    assert c.locate([2, 3], 0.0) == (0, 2, 1, 0, 2, 0.0)
    without_ram = cache(1)
    without_ram.insert([1])
    without_ram.insert([2])
    assert without_ram.locate([1, 2], 0.0) == (0, 0, 0, 0, 0, 0.0)


def test_touch_promotes_from_lower_tiers_without_fitting() -> None:
    disk: set[int] = set()
    c = cache(2, ram=2, disk=disk)
    for h in (1, 2, 3, 4, 5):
        c.insert([h])
    c.touch([1, 2, 3], 2)  # 1 from disk, 2 from RAM; 3 stays in RAM
    assert resident(c, [1, 2, 3, 4, 5]) == [1, 2, 4, 5]  # over budget until a fit
    c.fit()  # 4, 5 are the oldest now: they go to RAM, pushing 3 to disk
    assert resident(c, [1, 2, 3, 4, 5]) == [1, 2]
    assert c.locate([1, 2, 4, 5, 3], 0.0) == (2, 5, 2, 1, 5, 0.0)
    assert disk == {1, 3}  # disk keeps what it was given
    c.check()  # HBM and RAM stay disjoint


def test_pending_blocks_extend_the_run_until_they_are_inserted() -> None:
    c = cache(8)
    c.insert([1])
    c.expect([1, 2, 3], 1, 5.0)  # a prefill here completes 2 and 3 at t=5
    assert c.locate([1, 2, 3, 4], 1.0) == (1, 1, 0, 0, 3, 5.0)
    c.expect_copy([3, 4], 7.0)  # a copy lands 3 and 4 at t=7: the later time wins
    c.expect_copy([4], 6.0)
    assert c.pending_run([4], 0, 0.0) == (1, 7.0)
    assert c.pending_run([1, 2, 3, 4], 1, 0.0) == (4, 7.0)
    c.expect([2, 3], 0, 2.0)  # a prefill's mark replaces the earlier one
    assert c.pending_run([2, 3], 0, 0.0) == (2, 2.0)
    c.insert_arrived([2, 3, 4], 2.0, TIME_EPS_S)  # 2, 3 are due, 4 is not
    assert c.lead([1, 2, 3, 4]) == 3
    assert c.pending_run([1, 2, 3, 4], 3, 0.0) == (4, 7.0)
    assert c.pending_run([2, 3], 0, 0.0) == (0, 0.0)  # no longer pending
    c.insert([4])
    assert c.locate([1, 2, 3, 4, 5], 9.0) == (4, 4, 0, 0, 4, 9.0)


def test_check_reports_a_broken_budget() -> None:
    c = cache(2)
    c.insert([1, 2, 3], fit=False)
    with pytest.raises(SimInvariantError, match="HBM cache above its budget"):
        c.check()
    c.fit()
    c.check()
    c.reserved = 3 * BT
    with pytest.raises(SimInvariantError, match="reserved KV above budget"):
        c.check()


def test_routed_blocks_are_an_lru_of_what_was_routed() -> None:
    r = RoutedBlocks(cap_blocks=3)
    r.note([1, 2, 3])
    r.note([1])
    r.note([4])  # 2 is the oldest
    assert r.lead([2]) == 0
    assert r.lead([3, 1, 4]) == 3
    assert r.lead([1, 4, 2, 3]) == 2
    assert r.lead([3]) == 1


def fresh(*values: int) -> list[int]:
    """Equal ids in new int objects (as generated ids or another load batch give them)."""
    return [int(str((1 << 62) + v)) for v in values]


def test_walks_answer_by_key_when_the_order_or_the_objects_change() -> None:
    """The compiled cache remembers which block followed which; that hint must never
    change an answer: blocks evicted and their entries reused, a run walked in another
    order, equal ids in other objects."""
    r = RoutedBlocks(3)
    a, b, c, d, e, f = fresh(1, 2, 3, 4, 5, 6)
    r.note([a, b, c])
    r.note([d, e, f])  # evicts a, b, c: their entries hold d, e, f now
    assert (r.lead([a, b, c]), r.lead([d, e, f])) == (0, 3)
    assert r.lead(fresh(4, 5, 6)) == 3
    assert (r.lead([d, a, f]), r.lead([d, f, e]), r.lead([e, f])) == (1, 3, 2)
    r.note([f, e, d])
    assert (r.lead([f, e, d]), r.lead(fresh(6, 5)), r.lead([f, d, a])) == (3, 2, 2)

    cc = cache(6)
    ids = fresh(*range(10, 16))
    cc.insert(ids)
    assert cc.drop(ids[2:4]) == 2
    cc.insert([ids[0], ids[1], *fresh(20, 21)])
    assert cc.lead(ids) == 2
    assert cc.lead(fresh(10, 11, 20, 21, 14)) == 5
    assert cc.lead(fresh(10, 11, 12)) == 2
    assert cc.locate(fresh(10, 11, 20, 99), 0.0)[:2] == (3, 3)
    cc.insert_pinned(fresh(10, 11, 20, 21), 0)
    cc.unpin(fresh(10, 11, 20, 21), 4)
    cc.check()
    assert resident(cc, fresh(10, 11, 12, 13, 14, 15, 20, 21)) == fresh(10, 11, 14, 15, 20, 21)
