"""`workload.session_replay: closed`: a turn is sent only once its session's earlier turns
have finished, at its arrival or that finish, whichever is later; open replay (the
default) sends every request at its arrival. The gate's rule by hand, then the simulator
on a session whose second turn arrives while the first is still being prefilled."""

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


def test_a_turn_waits_for_every_request_of_the_earlier_turns() -> None:
    gate = SessionGate()
    a1, b1 = turn("a1", 0.0, "s", 1), turn("b1", 0.0, "s", 1)  # two requests of turn 1
    c2, d3 = turn("c2", 1.0, "s", 2), turn("d3", 2.0, "s", 3)
    assert gate.arrive(a1)
    assert gate.arrive(b1)  # one turn's requests do not wait for each other
    assert not gate.arrive(c2)
    assert not gate.arrive(d3)
    assert gate.holding == 2
    assert gate.finish("0", "s", 1) == []  # b1 still running
    assert gate.finish("0", "s", 1) == [c2]  # turn 1 done: turn 2 goes, turn 3 still waits
    assert gate.finish("0", "s", 2) == [d3]
    assert gate.finish("0", "s", 3) == []
    assert (gate.holding, gate.held_total) == (0, 2)


def test_no_session_other_sessions_and_other_windows_never_wait() -> None:
    gate = SessionGate()
    assert gate.arrive(turn("x1", 0.0, "s", 1))
    assert gate.arrive(turn("n", 0.1, None, 5))  # no session
    assert gate.arrive(turn("y2", 0.2, "t", 2))  # another session
    assert gate.arrive(turn("z2", 0.3, "s", 2, trace="1"))  # the same name in another window
    assert not gate.arrive(turn("x2", 0.4, "s", 2))
    assert gate.finish("0", None, 5) == []
    assert gate.finish("0", "t", 2) == []
    assert [r.request_id for r in gate.finish("0", "s", 1)] == ["x2"]


def test_a_later_request_of_a_held_turn_queues_behind_it() -> None:
    """Once a turn of the session is held, a request of that same turn arriving later is
    held too (sent in arrival order), not sent past it."""
    gate = SessionGate()
    assert gate.arrive(turn("a1", 0.0, "s", 1))
    assert not gate.arrive(turn("b2", 1.0, "s", 2))
    assert not gate.arrive(turn("c2", 2.0, "s", 2))
    assert [r.request_id for r in gate.finish("0", "s", 1)] == ["b2", "c2"]


@pytest.mark.parametrize("replay", ["open", "closed"])
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
        closed_sessions=replay == "closed",
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
        assert r2.sent_s == r1.finish_s  # sent at the answer
        assert r2.cached_tokens == 4096  # and finds turn 1's prompt cached
        assert stats["session_held"] == 1
        assert r2.first_token_s - r2.sent_s == pytest.approx(512 * P_TOK, rel=1e-9)
    assert r1.first_token_s == pytest.approx(4096 * P_TOK, rel=1e-9)
