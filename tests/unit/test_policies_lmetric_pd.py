"""LMetric (new prefill tokens × batch size) and the full PD-separation baseline, by hand."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from btb_lab.errors import UserError
from btb_lab.policies import build_policy
from btb_lab.policies.base import Decision
from tests.unit.test_policies_fakes import FakeView, cluster, request

BLOCKS = list(range(100, 120))  # 20 blocks = 10,240 tokens


def view_with(batches: list[int], held: list[int], **kw: object) -> FakeView:
    """Instances with `batches` running requests, instance i holding `held[i]` leading
    blocks of BLOCKS."""
    return FakeView(
        cluster(batches, **kw),  # type: ignore[arg-type]
        routed={i: set(BLOCKS[:n]) for i, n in enumerate(held)},
    )


@pytest.mark.parametrize(
    ("batches", "chosen"),
    [
        # new tokens 2048 / 10240 / 5120; scores 8192 / 10240 / 10240
        ([4, 1, 2], 0),
        # 10240 each: the tie goes to the fewest new tokens (instance 0)
        ([5, 1, 2], 0),
        # 12288 / 10240 / 10240: 1 and 2 tie, 2 has fewer new tokens
        ([6, 1, 2], 2),
        # an idle instance scores 0 whatever it holds
        ([6, 1, 0], 2),
        ([0, 0, 0], 0),  # all idle: the fewest new tokens
    ],
)
def test_lmetric_picks_the_smallest_product(batches: list[int], chosen: int) -> None:
    policy = build_policy("lmetric")
    decision = policy.route(request(blocks=BLOCKS), view_with(batches, [16, 0, 10]))
    assert decision == Decision(chosen, "LMETRIC")


def test_a_full_hit_still_computes_one_token_so_load_decides() -> None:
    policy = build_policy("lmetric")
    # 0 and 1 hold everything: new tokens 1, scores 3 and 2; 2 holds nothing (10240 × 1)
    assert policy.route(request(blocks=BLOCKS), view_with([3, 2, 1], [20, 20, 0])).instance == 1


def test_waiting_requests_count_only_with_running_waiting() -> None:
    view = view_with([1, 1], [20, 0])
    view.loads[0].waiting = 50_000  # a huge queue on the holder
    assert build_policy("lmetric").route(request(blocks=BLOCKS), view).instance == 0
    both = build_policy("lmetric", {"batch": "running_waiting"})
    assert both.route(request(blocks=BLOCKS), view).instance == 1


def test_lmetric_ignores_sessions_unless_sticky() -> None:
    free, sticky = build_policy("lmetric"), build_policy("lmetric", {"sticky_sessions": True})
    first = view_with([0, 1], [0, 0])
    for policy in (free, sticky):
        assert policy.route(request(session="s", blocks=BLOCKS), first).instance == 0
    later = view_with([2, 1], [0, 20])  # instance 1 now holds the context, 0 is busier
    assert free.route(request(session="s", blocks=BLOCKS), later) == Decision(1, "LMETRIC")
    assert sticky.route(request(session="s", blocks=BLOCKS), later) == Decision(0, "STICKY")


def test_sticky_lmetric_breaks_affinity_like_session_affinity() -> None:
    policy = build_policy("lmetric", {"sticky_sessions": True})
    policy.route(request(session="s", blocks=BLOCKS), view_with([0, 0, 0, 0], [0, 0, 0, 0]))
    hot = view_with([9, 2, 1, 0], [20, 10, 0, 0])  # 9 > 2 × mean 3: break
    # among 1, 2, 3: scores 5120 × 2, 10240 × 1, 0 → 3
    assert policy.route(request(session="s", blocks=BLOCKS), hot) == Decision(3, "BROKEN")
    assert policy.route(request(blocks=BLOCKS), hot) == Decision(3, "NO_SESSION")


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"batch": "queue"}, "batch"),
        ({"overload_factor": 0}, "overload_factor"),
        ({"sticky": True}, "sticky"),
    ],
)
def test_lmetric_params_are_validated(params: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        build_policy("lmetric", params)
    assert [e["loc"] for e in err.value.errors()] == [(field,)]


# --- pd_split -----------------------------------------------------------------------------

ROLES = ["PS", "PS", "C", "C", "C"]


def pd_view(
    loads: list[int], held: dict[int, int], outstanding: list[int] | None = None
) -> FakeView:
    return FakeView(
        cluster(loads, roles=ROLES, outstanding=outstanding),
        routed={i: set(BLOCKS[:n]) for i, n in held.items()},
    )


def test_pd_split_prefills_in_the_prefill_pool_and_decodes_in_the_decode_pool() -> None:
    policy = build_policy("pd_split")
    # PS 1 holds more of the prompt though it is busier; C 4 is the least-loaded decoder
    decision = policy.route(request(blocks=BLOCKS), pd_view([0, 3, 2, 5, 1], {0: 4, 1: 12}))
    assert decision == Decision(instance=4, route="PD", prefill_instance=1)
    assert decision.prefill_cold is False  # the prefill pool keeps its prefix caches


def test_pd_split_routes_every_request_through_the_pools_whatever_its_size() -> None:
    policy = build_policy("pd_split")
    view = pd_view([1, 0, 0, 0, 0], {})
    for tokens in (10, 5_000, 90_000):
        d = policy.route(request(blocks=[7], input_tokens=tokens), view)
        assert (d.prefill_instance, d.instance) == (1, 2)


def test_pd_split_pick_rules_are_parameters() -> None:
    view = pd_view([0, 3, 2, 5, 2], {1: 12}, outstanding=[0, 0, 900, 50, 100])
    plain = build_policy(
        "pd_split", {"prefill_pick": "least_load", "decode_pick": "least_outstanding"}
    )
    decision = plain.route(request(blocks=BLOCKS), view)
    assert (decision.prefill_instance, decision.instance) == (0, 3)
    # equal loads on C 2 and C 4: the lower index decodes
    assert build_policy("pd_split").route(request(blocks=BLOCKS), view).instance == 2


def test_pd_split_needs_both_pools() -> None:
    policy = build_policy("pd_split")
    with pytest.raises(UserError, match="role PS"):
        policy.route(request(blocks=BLOCKS), FakeView(cluster([0, 0])))
    with pytest.raises(UserError, match="role C"):
        policy.route(request(blocks=BLOCKS), FakeView(cluster([0, 0], roles=["PS", "PS"])))
    with pytest.raises(ValidationError):
        build_policy("pd_split", {"prefill_pick": "random"})
