"""BTB (early_rdma): burst detection, warming from complete copies only, routing to the
least-loaded warm replica, and the exact cache_aware fallback."""

from __future__ import annotations

import hashlib
import struct

import pytest

from btb_lab.policies import build_policy
from btb_lab.policies.base import Decision, WarmAction
from btb_lab.policies.btb import BTB, prefix_key
from btb_lab.policies.cache_aware import CacheAware
from tests.unit.test_policies_fakes import FakeView, cluster, request

Y = 128
PREFIX = list(range(5000, 5000 + Y))


def burst_request(n: int, *, suffix: int = 2) -> object:
    """A request sharing the 128-block PREFIX, with its own suffix blocks."""
    return request(f"b{n}", blocks=[*PREFIX, *(90_000 + n * 10 + k for k in range(suffix))])


def make_btb(**params: object) -> BTB:
    policy = build_policy("btb", dict(params))
    assert isinstance(policy, BTB)
    return policy


def six_instances(loads: list[int] | None = None) -> FakeView:
    """Instance 0 holds a complete copy of PREFIX; the others are cold."""
    return FakeView(cluster(loads or [5, 1, 4, 2, 3, 0]), routed={0: set(PREFIX)})


def test_fires_on_the_xth_arrival_inside_z_and_warms_m_minus_holders() -> None:
    policy = make_btb()
    view = six_instances()
    view.now = 10.0
    first = policy.route(burst_request(1), view)
    assert first == Decision(instance=0, route="CACHE_HIT")  # one arrival: cache_aware
    assert not policy.is_active(PREFIX)
    view.now = 10.6
    second = policy.route(burst_request(2), view)
    assert policy.is_active(PREFIX)
    # M = 4 warm replicas including the holder 0: the 3 least-loaded cold ones are 5, 1, 3
    assert second.warm == (
        WarmAction(source=0, target=5, n_blocks=Y),
        WarmAction(source=0, target=1, n_blocks=Y),
        WarmAction(source=0, target=3, n_blocks=Y),
    )
    assert second.route == "WARM_HIT"
    assert second.instance == 5  # least-loaded of the warm set {0, 5, 1, 3}
    assert (policy.fired, policy.warm_actions) == (1, 3)


def test_arrival_exactly_z_apart_counts_as_within_the_window() -> None:
    policy = make_btb()
    view = six_instances()
    policy.route(burst_request(1), view)
    view.now = 1.0
    assert policy.route(burst_request(2), view).route == "WARM_HIT"


def test_arrivals_spread_past_z_never_fire() -> None:
    policy = make_btb()
    view = six_instances()
    for n in range(8):
        view.now = n * 1.01
        decision = policy.route(burst_request(n), view)
        assert decision.warm == ()
        assert decision == Decision(instance=0, route="CACHE_HIT")
    assert policy.fired == 0


def test_burst_count_x_is_a_parameter() -> None:
    policy = make_btb(burst_count=3, burst_window_s=0.5)
    view = six_instances()
    routes = []
    for n, t in enumerate([0.0, 0.2, 0.9, 1.0, 1.3]):
        view.now = t
        routes.append(policy.route(burst_request(n), view).route)
    # 0.9 drops 0.0 and 0.2 from the window; 0.9, 1.0, 1.3 are three within 0.5 s
    assert routes == ["CACHE_HIT", "CACHE_HIT", "CACHE_HIT", "CACHE_HIT", "WARM_HIT"]


def test_never_warms_from_an_incomplete_source() -> None:
    policy = make_btb()
    # the router routed PREFIX to 0, but its prefill has not finished: nothing is complete
    view = FakeView(cluster([5, 1, 4, 2, 3, 0]), routed={0: set(PREFIX)}, complete={})
    policy.route(burst_request(1), view)
    view.now = 0.1
    fired = policy.route(burst_request(2), view)
    assert policy.is_active(PREFIX)
    assert fired == Decision(instance=0, route="CACHE_HIT")  # exactly cache_aware, no warm
    view.now = 0.2
    assert policy.route(burst_request(3), view).warm == ()
    # the copy on 0 completes: the next request of the active prefix warms from it
    view.complete = {0: set(PREFIX)}
    view.now = 0.3
    warmed = policy.route(burst_request(4), view)
    assert [a.source for a in warmed.warm] == [0, 0, 0]
    assert warmed.route == "WARM_HIT"


def test_source_is_a_complete_copy_not_a_routed_one() -> None:
    policy = make_btb()
    # 1 is believed to hold PREFIX and is less loaded, but only 2 holds it completely
    view = FakeView(
        cluster([5, 0, 4, 2, 3, 1]),
        routed={1: set(PREFIX), 2: set(PREFIX)},
        complete={2: set(PREFIX)},
    )
    policy.route(burst_request(1), view)
    decision = policy.route(burst_request(2), view)
    assert {a.source for a in decision.warm} == {2}
    # holders 1 and 2 count towards M = 4, so two copies go to the least-loaded cold ones
    assert [a.target for a in decision.warm] == [5, 3]


def test_later_requests_go_to_the_least_loaded_warm_replica() -> None:
    policy = make_btb()
    view = six_instances()
    policy.route(burst_request(1), view)
    policy.route(burst_request(2), view)  # warm set {0, 5, 1, 3}
    # instance 4 is now idle but cold; among the warm set 3 is least loaded
    view.loads = cluster([9, 7, 0, 2, 0, 6])
    view.now = 0.5
    decision = policy.route(burst_request(3), view)
    assert decision == Decision(instance=3, route="WARM_HIT")
    view.loads = cluster([1, 7, 0, 2, 0, 6])
    view.now = 0.7
    assert policy.route(burst_request(4), view) == Decision(instance=0, route="WARM_HIT")
    assert policy.warm_actions == 3  # warming happened once


def test_short_prefix_behaves_exactly_as_cache_aware() -> None:
    btb = make_btb()
    reference = build_policy("cache_aware")
    assert isinstance(reference, CacheAware)
    short = PREFIX[: Y - 1]
    scenarios = [
        FakeView(cluster([5, 1, 4]), routed={0: set(short)}),
        FakeView(cluster([70, 1, 4]), routed={0: set(short)}),
        FakeView(cluster([3, 1, 4]), routed={}),
        FakeView(cluster([2, 2, 2]), routed={1: set(short[:5]), 2: set(short[:5])}),
    ]
    for n in range(40):
        view = scenarios[n % len(scenarios)]
        view.now = n * 0.01
        req = request(f"s{n}", blocks=short)
        assert btb.route(req, view) == reference.route(req, view)
    assert btb.fired == 0


def test_prefix_in_tokens_converts_per_request_block_size() -> None:
    policy = make_btb(prefix_tokens=65_536)
    assert policy.prefix_len_blocks(request(blocks=[1], block_tokens=512)) == 128
    assert policy.prefix_len_blocks(request(blocks=[1], block_tokens=16)) == 4096
    # the full blocks alone: the 66th 1000-token block holds suffix tokens too, which
    # differ per request, so a key of 66 blocks never repeated and BTB never fired
    assert policy.prefix_len_blocks(request(blocks=[1], block_tokens=1000)) == 65
    assert make_btb(prefix_tokens=100).prefix_len_blocks(request(blocks=[1])) == 1
    assert make_btb().prefix_len_blocks(request(blocks=[1], block_tokens=16)) == 128


def test_prefill_mode_warms_without_a_complete_copy() -> None:
    policy = make_btb(mode="prefill", replicas=3)
    view = FakeView(cluster([5, 1, 4, 2]), routed={}, complete={})
    policy.route(burst_request(1), view)
    decision = policy.route(burst_request(2), view)
    assert decision.warm == (
        WarmAction(source=None, target=1, n_blocks=Y, mode="prefill"),
        WarmAction(source=None, target=3, n_blocks=Y, mode="prefill"),
        WarmAction(source=None, target=2, n_blocks=Y, mode="prefill"),
    )
    assert decision.instance == 1


def test_active_prefix_expires_after_idle_time() -> None:
    policy = make_btb(idle_expiry_s=5.0)
    view = six_instances()
    policy.route(burst_request(1), view)
    policy.route(burst_request(2), view)
    view.now = 4.9
    assert policy.route(burst_request(3), view).route == "WARM_HIT"  # 4.9 s idle: alive
    view.now = 10.0  # 5.1 s idle: expired; one arrival is not a burst
    assert policy.route(burst_request(4), view) == Decision(instance=0, route="CACHE_HIT")
    assert not policy.is_active(PREFIX)
    view.now = 10.5  # a new burst is detected and warms again
    assert len(policy.route(burst_request(5), view).warm) == 3
    assert policy.fired == 2


def test_detector_state_is_swept() -> None:
    policy = make_btb()
    view = six_instances()
    for n in range(200):  # 200 distinct one-off prefixes, 0.1 s apart
        view.now = n * 0.1
        policy.route(request(f"u{n}", blocks=range(n * 1000, n * 1000 + Y)), view)
    assert len(policy._arrivals) <= 25  # only the last ~2 s of prefixes are kept


def test_prefix_key_is_a_blake2b_digest_of_the_block_ids() -> None:
    blocks = (1, 2, 3)
    expected = hashlib.blake2b(struct.pack("<3q", *blocks), digest_size=16).digest()
    assert prefix_key(blocks) == expected
    assert prefix_key((1, 2, 4)) != expected
    huge = (2**70, 5)  # wider than 64 bits: still a stable digest
    assert prefix_key(huge) == hashlib.blake2b(b"1180591620717411303424,5", digest_size=16).digest()
    # tuples are memoized (a burst shares its prefix); lists and equal tuples agree
    assert prefix_key([1, 2, 3]) == prefix_key(tuple(int(str(b)) for b in blocks)) == expected
    # the memo finds a prefix by its ends and length: one that differs inside is another
    assert (
        prefix_key((1, 7, 3))
        == hashlib.blake2b(struct.pack("<3q", 1, 7, 3), digest_size=16).digest()
    )
    assert prefix_key(blocks) == expected
    assert prefix_key(blocks) == expected  # a hit gives the same digest


@pytest.mark.parametrize("name", ["btb", "early_rdma"])
def test_alias_builds_the_same_policy(name: str) -> None:
    policy = build_policy(name, {"replicas": 2})
    view = six_instances()
    policy.route(burst_request(1), view)
    assert [a.target for a in policy.route(burst_request(2), view).warm] == [5]
