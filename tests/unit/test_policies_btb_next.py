"""The BTB write-up's future work as BTB settings and subclasses: partial and chunked
speculative prefill, adaptive X / Z / M (btb_adaptive) and job-kind hints (btb_hint)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from btb_lab.policies import build_policy
from btb_lab.policies.base import Decision
from btb_lab.policies.btb import BTB
from btb_lab.policies.btb_detect import AdaptiveBTB, HintBTB
from btb_lab.records import Request
from tests.unit.test_policies_fakes import FakeView, cluster, request

Y = 128
PREFIX = list(range(5000, 5000 + Y))


def burst(n: int, *, kind: str | None = None, prefix: list[int] | None = None) -> Request:
    blocks = [*(prefix or PREFIX), 90_000 + n]
    r = request(f"b{n}", blocks=blocks)
    r.job_kind = kind
    return r


def make(name: str, **params: object) -> BTB:
    policy = build_policy(name, dict(params))
    assert isinstance(policy, BTB)
    return policy


def prefill_targets(decision: Decision) -> list[tuple[int, int]]:
    assert all(a.mode == "prefill" and a.source is None for a in decision.warm)
    return [(a.target, a.n_blocks) for a in decision.warm]


# --- partial and chunked speculative prefill --------------------------------------------


def test_partial_prefill_warms_a_fraction_of_the_prefix_rounded_up() -> None:
    policy = make("btb", mode="prefill", replicas=3, prefill_fraction=0.3)
    view = FakeView(cluster([5, 1, 4, 2]))
    policy.route(burst(1), view)
    decision = policy.route(burst(2), view)
    assert prefill_targets(decision) == [(1, 39), (3, 39), (2, 39)]  # ceil(0.3 × 128) = 39
    view.now = 0.5
    assert policy.route(burst(3), view).warm == ()  # all at once: nothing more later


@pytest.mark.parametrize(("fraction", "blocks"), [(1.0, 128), (0.5, 64), (0.001, 1), (0.25, 32)])
def test_speculative_blocks_is_at_least_one_block(fraction: float, blocks: int) -> None:
    assert make("btb", mode="prefill", prefill_fraction=fraction).speculative_blocks(Y) == blocks


def test_chunked_prefill_adds_one_chunk_per_later_arrival_up_to_the_fraction() -> None:
    policy = make("btb", mode="prefill", replicas=2, prefill_chunk_blocks=50, prefill_fraction=0.9)
    view = FakeView(cluster([5, 1, 4]), routed={0: set(PREFIX)})  # 0 holds it: M counts it
    policy.route(burst(1), view)
    fired = policy.route(burst(2), view)  # active: the first chunk on the one extra replica
    assert prefill_targets(fired) == [(1, 50)]
    assert fired.route == "WARM_HIT"
    view.now = 0.2
    assert prefill_targets(policy.route(burst(3), view)) == [(1, 100)]
    view.now = 0.3
    assert prefill_targets(policy.route(burst(4), view)) == [(1, 116)]  # ceil(0.9 × 128)
    view.now = 0.4
    assert policy.route(burst(5), view).warm == ()  # prefilled as far as it goes
    assert policy.warm_actions == 3


def test_chunked_prefill_stops_when_the_burst_does_not_come() -> None:
    """A decoy: two arrivals fire the detector, then nothing; only the first chunk is spent
    and the expired prefix asks for nothing more."""
    policy = make("btb", mode="prefill", replicas=3, prefill_chunk_blocks=16, idle_expiry_s=5.0)
    view = FakeView(cluster([5, 1, 4, 2]), routed={0: set(PREFIX)})
    policy.route(burst(1), view)
    assert prefill_targets(policy.route(burst(2), view)) == [(1, 16), (3, 16)]
    view.now = 30.0  # one more arrival long after: expired, counts as a first arrival
    assert policy.route(burst(3), view).warm == ()
    assert policy.warm_actions == 2  # two first chunks of 16 blocks, nothing more


def test_chunks_follow_every_target_of_the_prefix() -> None:
    policy = make("btb", mode="prefill", replicas=4, prefill_chunk_blocks=64)
    view = FakeView(cluster([0, 1, 2, 3]), routed={3: set(PREFIX)})
    policy.route(burst(1), view)
    assert prefill_targets(policy.route(burst(2), view)) == [(0, 64), (1, 64), (2, 64)]
    view.now = 0.1
    assert prefill_targets(policy.route(burst(3), view)) == [(0, 128), (1, 128), (2, 128)]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"prefill_fraction": 0.5}, "need mode: prefill"),
        ({"prefill_chunk_blocks": 8}, "need mode: prefill"),
        (
            {"mode": "prefill", "prefill_chunk_blocks": 8, "route_active": "holders"},
            "route_active: warm_set",
        ),
        ({"mode": "prefill", "prefill_fraction": 0}, "greater than 0"),
        ({"mode": "prefill", "prefill_fraction": 1.5}, "less than or equal to 1"),
        ({"mode": "prefill", "prefill_chunk_blocks": 0}, "greater than or equal to 1"),
    ],
)
def test_speculative_settings_are_validated(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        build_policy("btb", params)


# --- btb_adaptive -------------------------------------------------------------------------


def adaptive(**params: object) -> AdaptiveBTB:
    policy = make("btb_adaptive", **params)
    assert isinstance(policy, AdaptiveBTB)
    return policy


def test_adaptive_x_rises_with_cache_pressure() -> None:
    policy = adaptive(kv_budget_tokens=100_000, burst_count=2, burst_count_max=6)
    view = FakeView(cluster([0, 0], outstanding=[10_000, 90_000]))  # emptiest: 10% pressure
    assert policy.burst_count_for(burst(1), view) == 2  # 2 + round(4 × 0.1)
    view.loads[0].outstanding_tokens = 50_000
    assert policy.burst_count_for(burst(1), view) == 4  # 2 + 4 × 0.5
    view.loads[0].outstanding_tokens = 400_000  # beyond the budget: capped at full pressure
    assert policy.burst_count_for(burst(1), view) == 6
    assert adaptive().burst_count_for(burst(1), view) == 2  # no budget, no pressure term


def test_adaptive_x_under_pressure_needs_more_arrivals_to_fire() -> None:
    policy = adaptive(kv_budget_tokens=100_000, burst_count=2, burst_count_max=4)
    view = FakeView(
        cluster([0, 0, 0], outstanding=[100_000] * 3), routed={0: set(PREFIX)}
    )  # full pressure: X = 4
    routes = []
    for n in range(4):
        view.now = n * 0.1
        routes.append(policy.route(burst(n), view).route)
    assert routes == ["CACHE_HIT", "CACHE_HIT", "CACHE_HIT", "WARM_HIT"]
    assert policy.events[0].value == 4.0  # the X that fired is recorded


def test_adaptive_z_widens_with_queue_load() -> None:
    policy = adaptive(burst_window_s=1.0, burst_window_max_s=5.0, load_ref=8.0)
    assert policy.burst_window_for(burst(1), FakeView(cluster([0, 0]))) == 1.0
    assert policy.burst_window_for(burst(1), FakeView(cluster([2, 6]))) == 3.0  # mean 4 / 8
    assert policy.burst_window_for(burst(1), FakeView(cluster([20, 30]))) == 5.0
    # with the idle window two arrivals 2 s apart are no burst; under load they are
    idle, busy = adaptive(), adaptive()
    calm = FakeView(cluster([0, 0, 0]), routed={0: set(PREFIX)})
    loaded = FakeView(cluster([8, 8, 8]), routed={0: set(PREFIX)})
    for policy, view in ((idle, calm), (busy, loaded)):
        policy.route(burst(1), view)
        view.now = 2.0
        policy.route(burst(2), view)
    assert (idle.fired, busy.fired) == (0, 1)


def test_adaptive_m_grows_while_every_warm_replica_is_loaded() -> None:
    policy = adaptive(replicas=2, replicas_max=4, grow_at_load=3)
    view = FakeView(cluster([0, 0, 0, 0, 0]), routed={0: set(PREFIX)})
    policy.route(burst(1), view)
    first = policy.route(burst(2), view)
    assert [(a.source, a.target) for a in first.warm] == [(0, 1)]  # M = 2: holder 0 + 1
    view.loads = cluster([3, 2, 0, 0, 0])  # replica 1 has only 2: no growth
    view.now = 0.1
    assert policy.route(burst(3), view).warm == ()
    view.loads = cluster([3, 3, 0, 1, 0])  # both at 3: one more, the least-loaded (2)
    view.now = 0.2
    grown = policy.route(burst(4), view)
    assert [(a.source, a.target) for a in grown.warm] == [(0, 2)]
    assert grown.instance == 2
    view.loads = cluster([4, 4, 3, 0, 0])
    view.now = 0.3
    assert [a.target for a in policy.route(burst(5), view).warm] == [3]  # M = 4
    view.loads = cluster([9, 9, 9, 9, 0])
    view.now = 0.4
    assert policy.route(burst(6), view).warm == ()  # replicas_max reached
    assert policy.warm_actions == 3


def test_adaptive_with_its_ranges_collapsed_is_plain_btb() -> None:
    """X, Z, M ranges of width zero and no growth: every decision equals BTB's."""
    fixed = make("btb", replicas=3)
    same = adaptive(
        replicas=3, replicas_max=3, burst_count_max=2, burst_window_max_s=1.0,
        kv_budget_tokens=10, grow_at_load=1,
    )  # fmt: skip
    loads = [[5, 1, 4, 2, 3, 0], [0, 0, 9, 9, 1, 1], [70, 1, 4, 2, 3, 1]]
    for n in range(60):
        view = FakeView(cluster(loads[n % 3]), routed={0: set(PREFIX), 2: set(PREFIX[:60])})
        view.now = n * 0.37
        r = burst(n, prefix=PREFIX if n % 4 else list(range(7000, 7000 + Y)))
        assert same.route(r, view) == fixed.route(r, view)
    assert fixed.fired > 0


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"burst_count": 3, "burst_count_max": 2}, "burst_count_max"),
        ({"burst_window_s": 2.0, "burst_window_max_s": 1.0}, "burst_window_max_s"),
        ({"replicas": 5, "replicas_max": 4}, "replicas_max"),
        ({"load_ref": 0}, "greater than 0"),
        ({"kv_budget_tokens": 0}, "greater than or equal to 1"),
        ({"grow_load": 3}, "Extra inputs"),
    ],
)
def test_adaptive_params_are_validated(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        build_policy("btb_adaptive", params)


# --- btb_hint -----------------------------------------------------------------------------


def hinted(**params: object) -> HintBTB:
    policy = make("btb_hint", **params)
    assert isinstance(policy, HintBTB)
    return policy


def test_a_hinted_first_arrival_marks_its_prefix_active() -> None:
    policy = hinted(mode="prefill", replicas=3)
    view = FakeView(cluster([5, 1, 4, 2]))
    decision = policy.route(burst(1, kind="labeling"), view)
    assert policy.is_active(PREFIX)
    assert prefill_targets(decision) == [(1, Y), (3, Y), (2, Y)]
    assert decision.instance == 1  # the least-loaded of the warm set, waiting for its copy


def test_an_unhinted_prefix_still_needs_x_arrivals() -> None:
    policy = hinted(hint_kinds=["labeling"])
    view = FakeView(cluster([5, 1, 4]), routed={0: set(PREFIX)})
    for kind in (None, "chat", "subagent_fanout"):  # none of them in hint_kinds
        p = hinted(hint_kinds=["labeling"])
        assert p.route(burst(1, kind=kind), view) == Decision(0, "CACHE_HIT")
        assert not p.is_active(PREFIX)
    assert policy.route(burst(1), view).route == "CACHE_HIT"
    assert policy.route(burst(2), view).route == "WARM_HIT"  # X = 2 within Z


def test_rdma_hint_fires_at_once_and_copies_when_a_complete_copy_exists() -> None:
    policy = hinted()
    view = FakeView(cluster([5, 1, 4]), routed={}, complete={})
    first = policy.route(burst(1, kind="batch_extraction"), view)
    assert policy.is_active(PREFIX)
    assert first == Decision(1, "COLD")  # nothing to copy from: cache_aware's choice
    view.routed = {1: set(PREFIX)}
    view.complete = {1: set(PREFIX)}
    view.now = 5.0  # long after: no second arrival within Z was needed
    second = policy.route(burst(2), view)
    assert [(a.source, a.target) for a in second.warm] == [(1, 2), (1, 0)]
    assert second.route == "WARM_HIT"


def test_a_misleading_hint_costs_a_warm_but_nothing_more() -> None:
    policy = hinted(mode="prefill", replicas=2, idle_expiry_s=2.0)
    view = FakeView(cluster([0, 0, 0]))  # nobody holds the prefix: M = 2 speculative copies
    assert prefill_targets(policy.route(burst(1, kind="labeling"), view)) == [(0, Y), (1, Y)]
    view.now = 30.0  # the decoy's next request, long after: active expired, fires again
    assert len(policy.route(burst(2, kind="labeling"), view).warm) == 2
    assert policy.fired == 2


def test_hinted_burst_count_two_needs_two_hinted_arrivals() -> None:
    policy = hinted(burst_count=4, hinted_burst_count=2)
    view = FakeView(cluster([5, 1, 4]), routed={0: set(PREFIX)})
    assert policy.route(burst(1, kind="labeling"), view).route == "CACHE_HIT"
    assert policy.route(burst(2, kind="labeling"), view).route == "WARM_HIT"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"hint_kinds": []}, "at least 1"),
        ({"hint_kinds": [""]}, "empty names"),
        ({"hinted_burst_count": 3}, "must not exceed burst_count"),
        ({"hinted_burst_count": 0}, "greater than or equal to 1"),
    ],
)
def test_hint_params_are_validated(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        build_policy("btb_hint", params)


def test_default_hint_kinds_are_the_workloads_burst_job_kinds() -> None:
    from btb_lab.records import BURST_JOB_KINDS

    assert hinted().hint.hint_kinds == list(BURST_JOB_KINDS)
