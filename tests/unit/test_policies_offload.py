"""The prefill-offload family (seed hypotheses H2–H4): who prefills, who decodes, where
the session goes, and when the cost or cache gate allows an offload."""

from __future__ import annotations

import pytest

from btb_lab.errors import UserError
from btb_lab.policies import build_policy
from btb_lab.policies.base import Decision, Policy
from btb_lab.policies.offload import OffloadDecode, PSCost
from tests.unit.test_policies_fakes import FakeCosts, FakeView, cluster, request

HEAVY_TOKENS = 40_960  # 80 blocks of 512 tokens
SESSION_BLOCKS = list(range(100, 180))  # the session's 80-block prompt


def pd_view(
    loads: list[int], *, cached_blocks: int = 0, home: int = 0, costs: FakeCosts | None = None
) -> FakeView:
    """C instances 0..n-1 with `loads`, plus one PS (index n, load 0); `home` holds the
    first `cached_blocks` of SESSION_BLOCKS."""
    roles = ["C"] * len(loads) + ["PS"]
    return FakeView(
        cluster([*loads, 0], roles=roles),
        routed={home: set(SESSION_BLOCKS[:cached_blocks])},
        cost_model=costs or FakeCosts(),
    )


def turn(n: int, tokens: int, session: str | None = "s") -> object:
    blocks = SESSION_BLOCKS if tokens == HEAVY_TOKENS else SESSION_BLOCKS[:2]
    return request(f"t{n}", blocks=blocks, input_tokens=tokens, session=session)


def bind_home(policy: Policy, home: int, n_instances: int) -> None:
    """Route a first WARM turn so the session lives on `home` (least outstanding tokens)."""
    outstanding = [100] * n_instances
    outstanding[home] = 0
    view = FakeView(cluster([0] * n_instances, outstanding=outstanding))
    assert policy.route(turn(0, 500), view) == Decision(instance=home, route="WARM")


@pytest.mark.parametrize(
    ("tokens", "route"), [(500, "WARM"), (2048, "MEDIUM"), (32_767, "MEDIUM"), (32_768, "HEAVY")]
)
def test_classes_by_prompt_length(tokens: int, route: str) -> None:
    policy = build_policy("offload_decode")
    assert isinstance(policy, OffloadDecode)
    assert policy.classify(request(input_tokens=tokens)) == route


def test_ps_always_prefills_cold_on_least_loaded_ps_and_home_decodes() -> None:
    policy = build_policy("ps_always")
    bind_home(policy, 1, 3)
    view = FakeView(cluster([2, 3, 2, 4, 2], roles=["C", "C", "C", "PS", "PS"]))
    assert policy.route(turn(1, HEAVY_TOKENS), view) == Decision(
        instance=1, route="PS", prefill_instance=4, prefill_cold=True
    )
    assert policy.route(turn(2, 5000), view) == Decision(instance=1, route="MEDIUM")


def test_ps_policies_need_a_ps_instance() -> None:
    policy = build_policy("ps_always")
    with pytest.raises(UserError, match="role PS"):
        policy.route(turn(1, HEAVY_TOKENS), FakeView(cluster([0, 0])))
    # non-heavy requests do not need one
    assert policy.route(turn(2, 500), FakeView(cluster([0, 0]))).route == "WARM"


def test_non_heavy_requests_never_go_to_the_prefill_service() -> None:
    policy = build_policy("ps_always")
    view = FakeView(cluster([3, 3, 0], roles=["C", "C", "PS"]))
    for n in range(10):
        decision = policy.route(turn(n, 500, session=f"s{n}"), view)
        assert decision.instance in (0, 1)
        assert decision.prefill_instance is None


def test_ps_flexd_decodes_on_least_loaded_c_and_moves_the_session() -> None:
    policy = build_policy("ps_flexd")
    bind_home(policy, 0, 3)
    view = pd_view([5, 3, 1])
    assert policy.route(turn(1, HEAVY_TOKENS), view) == Decision(
        instance=2, route="PS", prefill_instance=3, prefill_cold=True
    )
    assert policy.route(turn(2, 500), pd_view([0, 0, 0])) == Decision(instance=2, route="WARM")


def test_offload_decode_prefills_with_cache_on_home_and_decodes_on_least_loaded() -> None:
    policy = build_policy("offload_decode")
    bind_home(policy, 0, 3)
    view = pd_view([4, 2, 3])
    assert policy.route(turn(1, HEAVY_TOKENS), view) == Decision(
        instance=1, route="HEAVY_OFFLOAD", prefill_instance=0, prefill_cold=False
    )
    # the session moved to the decoder
    assert policy.route(turn(2, 500), pd_view([0, 0, 0])) == Decision(instance=1, route="WARM")


def test_offload_decode_stays_home_when_home_is_least_loaded() -> None:
    policy = build_policy("offload_decode")
    bind_home(policy, 2, 3)
    # a tie with instance 0 keeps the session home: no transfer for nothing
    assert policy.route(turn(1, HEAVY_TOKENS), pd_view([1, 3, 1])) == Decision(
        instance=2, route="HEAVY_COLO"
    )


@pytest.mark.parametrize(
    ("cached_blocks", "offloads"),
    [(0, False), (23, False), (24, True), (80, True)],  # 24 / 80 blocks = exactly 0.3
)
def test_cache_gate_offloads_at_or_above_threshold_only(cached_blocks: int, offloads: bool) -> None:
    policy = build_policy("cache_gate")
    bind_home(policy, 0, 3)
    decision = policy.route(turn(1, HEAVY_TOKENS), pd_view([4, 1, 3], cached_blocks=cached_blocks))
    if offloads:
        assert decision == Decision(instance=1, route="HEAVY_OFFLOAD", prefill_instance=0)
    else:
        assert decision == Decision(instance=0, route="HEAVY_COLO")


def test_cache_gate_threshold_is_a_parameter() -> None:
    policy = build_policy("cache_gate", {"threshold": 0.5})
    bind_home(policy, 0, 3)
    view = pd_view([4, 1, 3], cached_blocks=39)  # 0.4875 < 0.5
    assert policy.route(turn(1, HEAVY_TOKENS), view).route == "HEAVY_COLO"
    view = pd_view([4, 1, 3], cached_blocks=40)
    assert policy.route(turn(2, HEAVY_TOKENS), view).route == "HEAVY_OFFLOAD"


def test_cache_gate_keeps_cold_first_turns_colocated() -> None:
    policy = build_policy("cache_gate")
    view = FakeView(cluster([5, 0, 0], outstanding=[0, 10, 20]))
    assert policy.route(turn(1, HEAVY_TOKENS, session="new"), view) == Decision(
        instance=0, route="HEAVY_COLO"
    )


def test_ps_cost_offloads_only_when_modeled_cost_is_lower() -> None:
    # C prefills 8,333 tok/s (the seed's rate); the PS is 4× faster; transfer 1 s + 1M tok/s
    costs = FakeCosts(prefill_tokens_per_s={3: 33_332.0}, transfer_setup_s=1.0)
    policy = build_policy("ps_cost", {"interference_s": 0.5})
    assert isinstance(policy, PSCost)
    bind_home(policy, 0, 3)
    # cold on C_s: 4.92 s + 0.5 > PS 1.23 s + 1.04 s → offload to the PS
    cold = pd_view([2, 2, 2], costs=costs)
    assert policy.offload_cost_s(turn(1, HEAVY_TOKENS), cold, 0, 3) == pytest.approx(
        40_960 / 33_332 + 1.0 + 0.04096
    )
    assert policy.colocated_cost_s(turn(1, HEAVY_TOKENS), cold, 0) == pytest.approx(
        40_960 / 8333 + 0.5
    )
    assert policy.route(turn(1, HEAVY_TOKENS), cold) == Decision(
        instance=0, route="PS", prefill_instance=3, prefill_cold=True
    )
    # 90% cached on C_s: 0.49 s + 0.5 < 2.27 s → stay co-located
    warm = pd_view([2, 2, 2], cached_blocks=72, costs=costs)
    assert policy.route(turn(2, HEAVY_TOKENS), warm) == Decision(instance=0, route="HEAVY_COLO")


def test_ps_cost_with_seed_rates_never_offloads() -> None:
    """H2: with a PS as fast as C, the cold full prefill plus transfer never wins."""
    policy = build_policy("ps_cost", {"interference_s": 0.5})
    for cached in (0, 40, 80):
        view = pd_view([2, 2, 2], cached_blocks=cached)
        assert policy.route(turn(cached, HEAVY_TOKENS, session=None), view).route == "HEAVY_COLO"


def test_ps_cost_interference_term_decides_the_borderline() -> None:
    costs = FakeCosts(transfer_setup_s=0.0, transfer_tokens_per_s=1e12)  # free transfer
    view = pd_view([2, 2, 2], costs=costs)
    # cold: PS 4.92 s vs C_s 4.92 s + interference: any positive interference offloads
    assert build_policy("ps_cost", {"interference_s": 0.0}).route(
        turn(1, HEAVY_TOKENS, session=None), view
    ).route == ("HEAVY_COLO")
    assert build_policy("ps_cost", {"interference_s": 0.01}).route(
        turn(1, HEAVY_TOKENS, session=None), view
    ).route == ("PS")


def test_requests_without_session_use_least_outstanding_tokens() -> None:
    policy = build_policy("offload_decode")
    view = FakeView(cluster([0, 0, 0], outstanding=[30, 10, 20]))
    assert policy.route(turn(1, 500, session=None), view) == Decision(instance=1, route="WARM")
    view = FakeView(cluster([0, 0, 0], outstanding=[5, 10, 20]))
    assert policy.route(turn(2, 500, session=None), view) == Decision(instance=0, route="WARM")


def test_heavy_session_affinity_breaks_past_overload_factor() -> None:
    policy = build_policy("cache_gate")
    bind_home(policy, 0, 3)
    # home load 7 > 2.0 × mean 3: the session moves (least outstanding tokens)
    view = FakeView(cluster([7, 1, 1], outstanding=[0, 50, 10]))
    assert policy.route(turn(1, 500), view) == Decision(instance=2, route="WARM")
