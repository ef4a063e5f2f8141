"""Registry, parameter validation, the simple baselines, cache_aware, session_affinity,
and determinism of every registered policy."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from btb_lab.errors import UserError
from btb_lab.policies import POLICIES, build_policy
from btb_lab.policies.base import Decision, Policy
from tests.unit.test_policies_fakes import FakeView, cluster, request

ALL_POLICIES = [
    "round_robin", "random", "least_load", "cache_aware", "session_affinity", "btb",
    "ps_always", "ps_flexd", "ps_cost", "offload_decode", "cache_gate", "session_count",
    "btb_adaptive", "btb_hint", "lmetric", "pd_split", "btb_cache",
]  # fmt: skip


# --- registry and parameters -------------------------------------------------------------


def test_every_policy_is_registered_with_the_early_rdma_alias() -> None:
    assert set(ALL_POLICIES) <= set(POLICIES)
    assert POLICIES.get("early_rdma") is POLICIES.get("btb")
    assert type(build_policy("early_rdma")).name == "btb"


def test_unknown_policy_is_a_user_error_listing_the_names() -> None:
    with pytest.raises(UserError) as err:
        build_policy("nope")
    message = str(err.value)
    assert "'nope'" in message
    for name in ("cache_aware", "btb", "early_rdma", "cache_gate"):
        assert name in message


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_every_param_has_a_description_and_a_default(name: str) -> None:
    params_model = POLICIES.get(name).Params
    for field_name, info in params_model.model_fields.items():
        assert info.description, f"{name}.{field_name} lacks a description"
        assert not info.is_required(), f"{name}.{field_name} lacks a default"
    build_policy(name)  # defaults alone must validate


def test_bad_param_value_names_the_field() -> None:
    with pytest.raises(ValidationError) as err:
        build_policy("cache_gate", {"threshold": 2.0})
    assert [e["loc"] for e in err.value.errors()] == [("threshold",)]


def test_misspelled_param_is_rejected_not_ignored() -> None:
    with pytest.raises(ValidationError) as err:
        build_policy("cache_aware", {"balance_abss": 10})
    assert err.value.errors()[0]["loc"] == ("balance_abss",)
    assert err.value.errors()[0]["type"] == "extra_forbidden"


def test_btb_rejects_both_prefix_lengths() -> None:
    with pytest.raises(ValidationError, match="prefix_blocks or prefix_tokens"):
        build_policy("btb", {"prefix_blocks": 64, "prefix_tokens": 32768})


def test_offload_rejects_medium_above_heavy() -> None:
    with pytest.raises(ValidationError, match="medium_input_tokens"):
        build_policy("cache_gate", {"heavy_input_tokens": 1000, "medium_input_tokens": 2000})


# --- simple baselines --------------------------------------------------------------------


def test_round_robin_cycles_over_serving_instances_only() -> None:
    view = FakeView(cluster([0, 0, 0, 0], roles=["C", "PS", "C", "C"]))
    policy = build_policy("round_robin")
    picks = [policy.route(request(str(i)), view).instance for i in range(7)]
    assert picks == [0, 2, 3, 0, 2, 3, 0]


def test_random_is_seeded_uniform_and_skips_prefill_service() -> None:
    view = FakeView(cluster([0, 0, 0, 0], roles=["C", "C", "PS", "C"]))

    def picks(seed: int) -> list[int]:
        policy = build_policy("random", seed=seed)
        return [policy.route(request(str(i)), view).instance for i in range(300)]

    first = picks(7)
    assert first == picks(7)
    assert first != picks(8)
    assert set(first) == {0, 1, 3}
    assert min(first.count(i) for i in (0, 1, 3)) > 60  # roughly uniform (100 expected)


def test_least_load_picks_fewest_running_plus_waiting_ties_by_index() -> None:
    loads = cluster([5, 3, 3, 9])
    loads[1].waiting = 1  # 1 now has load 4, so 2 is the unique minimum
    policy = build_policy("least_load")
    assert policy.route(request(), FakeView(loads)).instance == 2
    assert policy.route(request(), FakeView(cluster([4, 2, 2, 2]))).instance == 1


# --- cache_aware -------------------------------------------------------------------------


def test_cache_aware_prefers_the_longest_prefix_match() -> None:
    blocks = [10, 11, 12, 13]
    view = FakeView(cluster([1, 9, 3]), routed={0: {10}, 1: {10, 11, 12}, 2: {10, 11}})
    decision = build_policy("cache_aware").route(request(blocks=blocks), view)
    assert decision == Decision(instance=1, route="CACHE_HIT")


def test_cache_aware_breaks_match_ties_by_load_then_index() -> None:
    blocks = [1, 2, 3]
    policy = build_policy("cache_aware")
    routed = {0: {1, 2}, 1: {1, 2}, 2: {1, 2}, 3: {1}}
    assert (
        policy.route(request(blocks=blocks), FakeView(cluster([4, 2, 3, 0]), routed)).instance == 1
    )
    assert (
        policy.route(request(blocks=blocks), FakeView(cluster([4, 2, 2, 0]), routed)).instance == 1
    )
    assert (
        policy.route(request(blocks=blocks), FakeView(cluster([1, 2, 1, 0]), routed)).instance == 0
    )


def test_cache_aware_without_a_match_goes_to_least_load() -> None:
    view = FakeView(cluster([3, 1, 2]), routed={0: {99}})
    decision = build_policy("cache_aware").route(request(blocks=[1, 2]), view)
    assert decision == Decision(instance=1, route="COLD")


@pytest.mark.parametrize(
    ("loads", "balanced"),
    [
        ([65, 10, 30], False),  # max > 64 and 65 > 1.5 × 10: imbalanced
        ([64, 10, 30], True),  # max not above balance_abs
        ([100, 70, 80], True),  # max above 64 but 100 ≤ 1.5 × 70
        ([106, 70, 80], False),  # both thresholds passed
    ],
)
def test_cache_aware_balances_only_past_both_thresholds(loads: list[int], balanced: bool) -> None:
    view = FakeView(cluster(loads), routed={0: {1, 2, 3}})
    decision = build_policy("cache_aware").route(request(blocks=[1, 2, 3]), view)
    if balanced:
        assert decision == Decision(instance=0, route="CACHE_HIT")
    else:
        assert decision == Decision(instance=1, route="BALANCE")


def test_cache_aware_spread_mode_tests_max_minus_min_like_sglang() -> None:
    routed = {0: {1}}
    policy = build_policy("cache_aware", {"balance_abs_on": "spread"})
    # max 70 > 64 (seed rule would balance) but spread 60 ≤ 64: SGLang keeps the match
    assert policy.route(request(blocks=[1]), FakeView(cluster([70, 10]), routed)).route == (
        "CACHE_HIT"
    )
    assert policy.route(request(blocks=[1]), FakeView(cluster([80, 10]), routed)).route == (
        "BALANCE"
    )
    seed_rule = build_policy("cache_aware")
    assert seed_rule.route(request(blocks=[1]), FakeView(cluster([70, 10]), routed)).route == (
        "BALANCE"
    )


def test_cache_aware_threshold_ignores_small_matches() -> None:
    view = FakeView(cluster([5, 0]), routed={0: {1}})
    blocks = [1, 2, 3, 4]  # instance 0 matches 25%
    assert build_policy("cache_aware").route(request(blocks=blocks), view).instance == 0
    strict = build_policy("cache_aware", {"cache_threshold": 0.3})
    assert strict.route(request(blocks=blocks), view) == Decision(instance=1, route="COLD")
    assert build_policy("cache_aware", {"cache_threshold": 0.2}).route(
        request(blocks=blocks), view
    ) == Decision(instance=0, route="CACHE_HIT")


# --- session_affinity --------------------------------------------------------------------


def test_session_first_turn_goes_to_least_outstanding_tokens_then_sticks() -> None:
    policy = build_policy("session_affinity")
    view = FakeView(cluster([1, 1, 1], outstanding=[500, 100, 300]))
    assert policy.route(request(session="s"), view) == Decision(instance=1, route="NEW")
    # instance 1 became the busiest in tokens and load, but not overloaded: stick
    view = FakeView(cluster([1, 2, 1], outstanding=[0, 900, 0]))
    assert policy.route(request(session="s"), view) == Decision(instance=1, route="STICKY")


@pytest.mark.parametrize(("home_load", "sticks"), [(6, True), (7, False)])
def test_session_affinity_breaks_exactly_past_the_overload_factor(
    home_load: int, sticks: bool
) -> None:
    policy = build_policy("session_affinity")
    policy.route(request(session="s"), FakeView(cluster([0, 0, 0, 0])))  # binds to 0
    others = [2, 2, 2] if home_load == 6 else [2, 2, 1]  # mean load 3 in both cases
    view = FakeView(cluster([home_load, *others], outstanding=[0, 50, 40, 60]))
    decision = policy.route(request(session="s"), view)
    if sticks:  # 6 == 2.0 × 3 is not above the factor
        assert decision == Decision(instance=0, route="STICKY")
    else:  # 7 > 6: placed by least outstanding tokens among the others, and rebound
        assert decision == Decision(instance=2, route="BROKEN")
        calm = FakeView(cluster([0, 0, 0, 0]))
        assert policy.route(request(session="s"), calm) == Decision(instance=2, route="STICKY")


@pytest.mark.parametrize("name", ["session_affinity", "session_count", "ps_always"])
@pytest.mark.parametrize(
    ("loads", "min_load", "route"),
    [
        ([1, 0, 0, 0], 0, "BROKEN"),  # 1 > 2.0 × mean 0.25: one request breaks it
        ([1, 0, 0, 0], 2, "STICKY"),  # at most 2 running there: not an overload
        ([2, 0, 0, 0], 2, "STICKY"),
        ([3, 0, 0, 0], 2, "BROKEN"),  # above both
        ([10, 6, 6, 6], 12, "STICKY"),  # 10 ≤ 2.0 × 7: the factor alone keeps it
    ],
)
def test_a_minimum_load_keeps_affinity_at_light_load(
    name: str, loads: list[int], min_load: int, route: str
) -> None:
    """`overload_min_load`: the home is overloaded only above both the factor × mean and
    this load (the session family shares the rule)."""
    policy = build_policy(name, {"overload_min_load": min_load})
    policy.route(request(session="s"), FakeView(cluster([0, 0, 0, 0])))  # binds to 0
    decision = policy.route(request(session="s"), FakeView(cluster(loads)))
    assert (decision.instance == 0) == (route == "STICKY")
    if name == "session_affinity":
        assert decision.route == route


def test_session_affinity_factor_is_a_parameter() -> None:
    policy = build_policy("session_affinity", {"overload_factor": 1.5})
    policy.route(request(session="s"), FakeView(cluster([0, 0])))
    assert policy.route(request(session="s"), FakeView(cluster([5, 1]))).route == "BROKEN"
    default = build_policy("session_affinity")  # 5 ≤ 2.0 × mean 3: sticks
    default.route(request(session="s"), FakeView(cluster([0, 0])))
    assert default.route(request(session="s"), FakeView(cluster([5, 1]))).route == "STICKY"


def test_requests_without_session_keep_no_state() -> None:
    policy = build_policy("session_affinity")
    first = policy.route(request(), FakeView(cluster([0, 0], outstanding=[10, 0])))
    second = policy.route(request(), FakeView(cluster([0, 0], outstanding=[0, 10])))
    assert (first.instance, second.instance) == (1, 0)
    assert first.route == second.route == "NO_SESSION"


# --- determinism -------------------------------------------------------------------------


def _replay(policy: Policy, seed: int) -> list[tuple[object, ...]]:
    """Drive a policy through a seeded workload on a view that evolves with its own
    decisions, returning every decision."""
    rng = random.Random(seed)
    loads = cluster([0] * 6, roles=["C", "C", "C", "C", "C", "PS"])
    routed: dict[int, set[int]] = {}
    view = FakeView(loads, routed)
    shared = [list(range(1000 * g, 1000 * g + 140)) for g in range(3)]
    out: list[tuple[object, ...]] = []
    in_flight: list[int] = []
    for n in range(400):
        view.now = n * 0.05
        prefix = shared[rng.randrange(3)][: rng.choice([8, 130, 140])]
        blocks = prefix + [10_000_000 + n * 10 + k for k in range(rng.randrange(4))]
        req = request(
            str(n),
            blocks=blocks,
            session=f"s{rng.randrange(20)}" if rng.random() < 0.8 else None,
            input_tokens=rng.choice([500, 5000, 40_000, 80_000]),
        )
        decision = policy.route(req, view)
        out.append((decision.instance, decision.route, decision.prefill_instance, decision.warm))
        for inst in (decision.instance, decision.prefill_instance):
            if inst is not None:
                routed.setdefault(inst, set()).update(blocks)
        loads[decision.instance].running += 1
        loads[decision.instance].outstanding_tokens += req.input_tokens
        in_flight.append(decision.instance)
        if len(in_flight) > 12:
            done = in_flight.pop(rng.randrange(len(in_flight)))
            loads[done].running -= 1
    return out


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_same_seed_gives_the_same_choices(name: str) -> None:
    first = _replay(build_policy(name, seed=3), seed=11)
    second = _replay(build_policy(name, seed=3), seed=11)
    assert first == second
    assert len({d[0] for d in first}) > 1  # the workload exercises more than one instance


def test_random_policy_depends_on_its_seed() -> None:
    assert _replay(build_policy("random", seed=1), 11) != _replay(
        build_policy("random", seed=2), 11
    )
