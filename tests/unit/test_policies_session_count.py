"""session_count (H8): first turns placed by active heavy sessions per instance, later
turns exactly as session_affinity."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from btb_lab.policies import build_policy
from btb_lab.policies.base import Decision
from btb_lab.policies.session_affinity import SessionCount
from tests.unit.test_policies_fakes import FakeView, cluster, request

HEAVY = 40_000
LIGHT = 4_000


def make(**params: object) -> SessionCount:
    policy = build_policy("session_count", dict(params))
    assert isinstance(policy, SessionCount)
    return policy


def test_first_turn_avoids_the_instance_with_active_heavy_sessions() -> None:
    """Between turns a heavy session holds no tokens, so a snapshot of ongoing tokens
    calls its instance empty; session_count still counts it there."""
    policy = make()
    view = FakeView(cluster([0, 0], outstanding=[0, 10]))  # 0 wins outstanding-token ties
    assert policy.route(request(session="h1", input_tokens=HEAVY), view) == Decision(0, "NEW")
    assert policy.route(request(session="h2", input_tokens=HEAVY), view) == Decision(1, "NEW")
    # both turns finish; instance 1 still has some other work outstanding
    view.now = 1.0
    view.loads[1].outstanding_tokens = 5_000
    policy.on_finish(request(session="h1", input_tokens=HEAVY), 0, 1.0)
    policy.on_finish(request(session="h2", input_tokens=HEAVY), 1, 1.0)
    # one active heavy session on each: equal counts, outstanding tokens decide → 0
    assert policy.route(request(session="h3", input_tokens=HEAVY), view) == Decision(0, "NEW")
    assert (policy.active_sessions(0, 1.0), policy.active_sessions(1, 1.0)) == (2, 1)
    # ongoing-token placement puts the next session on 0 again; session_count on 1
    affinity = build_policy("session_affinity")
    assert affinity.route(request(session="h4", input_tokens=HEAVY), view) == Decision(0, "NEW")
    assert policy.route(request(session="h4", input_tokens=LIGHT), view) == Decision(1, "NEW")


def test_a_session_idle_longer_than_active_s_no_longer_counts() -> None:
    policy = make(active_s=10.0)
    view = FakeView(cluster([0, 0], outstanding=[0, 7]))
    assert policy.route(request(session="h", input_tokens=HEAVY), view).instance == 0
    policy.on_finish(request(session="h", input_tokens=HEAVY), 0, 2.0)
    view.now = 12.0  # exactly active_s after it finished: still active
    assert policy.active_sessions(0, 12.0) == 1
    assert policy.route(request(session="a", input_tokens=LIGHT), view).instance == 1
    view.now = 12.5  # past active_s: h is idle, the outstanding-token tie-break picks 0
    assert policy.active_sessions(0, 12.5) == 0
    assert policy.route(request(session="b", input_tokens=LIGHT), view).instance == 0


def test_a_turn_in_flight_keeps_its_session_active_however_long_it_runs() -> None:
    policy = make(active_s=1.0)
    view = FakeView(cluster([0, 0], outstanding=[0, 7]))
    policy.route(request(session="h", input_tokens=HEAVY), view)
    assert policy.active_sessions(0, 500.0) == 1


def test_light_sessions_count_only_with_count_all() -> None:
    heavy_only, every = make(), make(count="all")
    view = FakeView(cluster([0, 0], outstanding=[0, 7]))
    for policy in (heavy_only, every):
        assert policy.route(request(session="l", input_tokens=LIGHT), view).instance == 0
    assert heavy_only.route(request(session="m", input_tokens=LIGHT), view).instance == 0
    assert every.route(request(session="m", input_tokens=LIGHT), view).instance == 1


def test_a_session_becomes_heavy_on_its_first_heavy_prompt() -> None:
    policy = make()
    view = FakeView(cluster([0, 0], outstanding=[0, 7]))
    policy.route(request(session="s", input_tokens=LIGHT), view)  # NEW on 0
    assert policy.active_sessions(0, 0.0) == 0
    assert policy.route(request(session="s", input_tokens=HEAVY), view) == Decision(0, "STICKY")
    assert policy.active_sessions(0, 0.0) == 1


def test_later_turns_stick_and_break_exactly_like_session_affinity() -> None:
    policy, affinity = make(), build_policy("session_affinity")
    calm = FakeView(cluster([0, 0, 0, 0]))
    for p in (policy, affinity):
        p.route(request(session="s", input_tokens=HEAVY), calm)  # both bind s to 0
    hot = FakeView(cluster([9, 1, 1, 1], outstanding=[0, 30, 10, 20]))  # 9 > 2 × mean 3
    got, want = policy.route(request(session="s"), hot), affinity.route(request(session="s"), hot)
    assert got == want == Decision(2, "BROKEN")
    # the session moved: it counts on 2 now, not on 0
    assert policy.active_sessions(0, 0.0) == 0
    assert policy.active_sessions(2, 0.0) == 1


def test_requests_without_a_session_go_by_outstanding_tokens() -> None:
    policy = make()
    view = FakeView(cluster([0, 0, 0], outstanding=[5, 3, 9]))
    assert policy.route(request(input_tokens=HEAVY), view) == Decision(1, "NO_SESSION")
    assert policy.active_sessions(1, 0.0) == 0


def test_only_serving_instances_take_sessions() -> None:
    policy = make()
    view = FakeView(cluster([0, 0, 0], outstanding=[9, 9, 0], roles=["C", "C", "PS"]))
    assert policy.route(request(session="s", input_tokens=HEAVY), view).instance == 0


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"active_s": 0}, "active_s"),
        ({"heavy_input_tokens": 0}, "heavy_input_tokens"),
        ({"count": "some"}, "count"),
        ({"overload_factor": -1}, "overload_factor"),
        ({"active": 3}, "active"),
    ],
)
def test_bad_params_name_their_field(params: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        build_policy("session_count", params)
    assert [e["loc"] for e in err.value.errors()] == [(field,)]
