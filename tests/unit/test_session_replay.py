"""`workload.session_replay`: under `closed` a turn is sent only once its session's earlier
turns have finished, at its arrival or that finish, whichever is later; under
`closed_think` at that finish plus the trace's gap before it; open replay (the default)
sends every request at its arrival. The gate's rule by hand, then the simulator on a
session whose second turn arrives while the first is still being prefilled."""

from __future__ import annotations

import pytest

from btb_lab.config.costs import CostSettings
from btb_lab.config.sim import SimSettings
from btb_lab.model.costmodel import RooflineCostModel
from btb_lab.records import Request, RequestRecord
from btb_lab.sim.backend import run_engine
from btb_lab.workload.sessions import SessionGate
from tests.unit.test_sim_engine import P_TOK, Scripted, nodes


def turn(rid: str, t: float, session: str | None, k: int, trace: str = "0") -> Request:
    return Request(rid, t, 512, 2, (1,), 512, session_id=session, trace_id=trace, turn=k)


def ids(released: list[tuple[float, Request]]) -> list[tuple[float, str]]:
    return [(t, r.request_id) for t, r in released]


def test_a_turn_waits_for_every_request_of_the_earlier_turns() -> None:
    gate = SessionGate()
    a1, b1 = turn("a1", 0.0, "s", 1), turn("b1", 0.0, "s", 1)  # two requests of turn 1
    c2, d3 = turn("c2", 1.0, "s", 2), turn("d3", 2.0, "s", 3)
    assert gate.arrive(a1, 0.0) == 0.0
    assert gate.arrive(b1, 0.0) == 0.0  # one turn's requests do not wait for each other
    assert gate.arrive(c2, 1.0) is None
    assert gate.arrive(d3, 2.0) is None
    assert gate.holding == 2
    assert gate.finish("0", "s", 1, 3.0) == []  # b1 still running
    # turn 1 done: turn 2 goes now, turn 3 still waits
    assert ids(gate.finish("0", "s", 1, 4.0)) == [(4.0, "c2")]
    assert ids(gate.finish("0", "s", 2, 5.0)) == [(5.0, "d3")]
    assert gate.finish("0", "s", 3, 6.0) == []
    assert (gate.holding, gate.held_total) == (0, 2)


def test_no_session_other_sessions_and_other_windows_never_wait() -> None:
    gate = SessionGate()
    assert gate.arrive(turn("x1", 0.0, "s", 1), 0.0) == 0.0
    assert gate.arrive(turn("n", 0.1, None, 5), 0.1) == 0.1  # no session
    assert gate.arrive(turn("y2", 0.2, "t", 2), 0.2) == 0.2  # another session
    assert gate.arrive(turn("z2", 0.3, "s", 2, trace="1"), 0.3) == 0.3  # another window's
    assert gate.arrive(turn("x2", 0.4, "s", 2), 0.4) is None
    assert gate.finish("0", None, 5, 0.5) == []
    assert gate.finish("0", "t", 2, 0.6) == []
    assert ids(gate.finish("0", "s", 1, 0.7)) == [(0.7, "x2")]


def test_a_later_request_of_a_held_turn_queues_behind_it() -> None:
    """Once a turn of the session is held, a request of that same turn arriving later is
    held too (sent in arrival order), not sent past it."""
    gate = SessionGate()
    assert gate.arrive(turn("a1", 0.0, "s", 1), 0.0) == 0.0
    assert gate.arrive(turn("b2", 1.0, "s", 2), 1.0) is None
    assert gate.arrive(turn("c2", 2.0, "s", 2), 2.0) is None
    assert ids(gate.finish("0", "s", 1, 3.0)) == [(3.0, "b2"), (3.0, "c2")]


def test_closed_think_sends_a_turn_its_trace_gap_after_the_answer() -> None:
    """Turns at 0, 10 and 25 s (think gaps 10 and 15 s). Turn 1 answers at 12 s, after
    turn 2 arrived: turn 2 goes at 12 + 10. Turn 2 answers at 23 s: turn 3, arriving at
    25, goes at 23 + 15 = 38 (under closed it would have gone at its arrival, 25)."""
    gate = SessionGate(think=True)
    t1, t2, t3 = turn("t1", 0.0, "s", 1), turn("t2", 10.0, "s", 2), turn("t3", 25.0, "s", 3)
    assert gate.arrive(t1, 0.0) == 0.0
    assert gate.arrive(t2, 10.0) is None
    assert ids(gate.finish("0", "s", 1, 12.0)) == [(22.0, "t2")]
    assert gate.finish("0", "s", 2, 23.0) == []
    assert gate.arrive(t3, 25.0) == 38.0
    assert gate.held_total == 2  # both later turns went after their arrival
    closed = SessionGate()
    closed.arrive(turn("t1", 0.0, "s", 1), 0.0)
    closed.finish("0", "s", 1, 12.0)
    assert closed.arrive(turn("t3", 25.0, "s", 3), 25.0) == 25.0


@pytest.mark.parametrize("replay", ["open", "closed", "closed_think"])
def test_the_simulator_sends_the_next_turn_after_the_answer(replay: str) -> None:
    """Turn 1: 8 blocks, 50 output tokens. Turn 2 extends its prompt by one block and
    arrives 10 ms in, while turn 1 is still being prefilled (8 × 512 × P_TOK ≈ 146 ms);
    both go to the one instance."""
    first = Request("t1", 0.0, 4096, 50, tuple(range(1, 9)), 512, session_id="s", turn=1)
    second = Request("t2", 0.01, 4608, 5, tuple(range(1, 10)), 512, session_id="s", turn=2)
    recs: list[RequestRecord] = []
    costs = RooflineCostModel(nodes(1), CostSettings())
    _, stats, _ = run_engine(
        costs, SimSettings(), Scripted({}), [first, second], recs.append, audit=True,
        sessions=replay,
    )  # fmt: skip
    r1, r2 = sorted(recs, key=lambda r: r.request_id)
    assert r2.arrival_s == 0.01  # the trace's arrival, either way
    if replay == "open":
        assert r2.sent_s == 0.01  # sent before its first turn had an answer
        # it queues behind turn 1's prefill, and its TTFT counts that wait
        ttft = 4096 * P_TOK - 0.01 + 512 * P_TOK
        assert r2.first_token_s - r2.sent_s == pytest.approx(ttft, rel=1e-9)
        assert "session_held" not in stats
    else:
        # sent at the answer (closed_think: plus the 10 ms gap between the two arrivals)
        think_s = 0.01 if replay == "closed_think" else 0.0
        assert r2.sent_s == pytest.approx(r1.finish_s + think_s, rel=1e-12)
        assert r2.cached_tokens == 4096  # and finds turn 1's prompt cached
        assert stats["session_held"] == 1
        assert r2.first_token_s - r2.sent_s == pytest.approx(512 * P_TOK, rel=1e-9)
    assert r1.first_token_s == pytest.approx(4096 * P_TOK, rel=1e-9)


def test_a_driver_that_woke_early_sends_at_the_arrival_and_holds_nothing() -> None:
    """The load driver's sleep may end a little before a request's arrival: the gate says
    to send it at its arrival, and it is not counted as held (found on the CPU vLLM run)."""
    for gate in (SessionGate(), SessionGate(think=True)):
        assert gate.arrive(turn("t1", 1.0, "s", 1), 0.999) == 1.0
        assert gate.arrive(turn("n1", 2.0, None, 1), 1.999) == 2.0  # nor one without a session
        assert gate.held_total == 0
