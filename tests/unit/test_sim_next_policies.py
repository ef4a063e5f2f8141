"""Known-answer runs of the seeds' next-direction policies on the simulator engine: the
placements they make and the latencies those placements give, worked out by hand."""

from __future__ import annotations

import pytest

from btb_lab.policies import build_policy
from btb_lab.records import Request
from tests.unit.test_sim_engine import P_TOK, run

HEAVY_BLOCKS = 80  # 40,960 tokens: HEAVY at the 32,768-token threshold


def session_turn(rid: str, t: float, session: str, first_block: int, out: int = 2) -> Request:
    blocks = tuple(range(first_block, first_block + HEAVY_BLOCKS))
    return Request(rid, t, HEAVY_BLOCKS * 512, out, blocks, 512, session_id=session)


@pytest.mark.parametrize(("policy", "b_instance"), [("session_affinity", "C0"),
                                                    ("session_count", "C1")])  # fmt: skip
def test_turn1_placement_by_sessions_not_by_ongoing_tokens(policy: str, b_instance: str) -> None:
    """Session A's first turn runs on C0 and finishes; A is between turns when session B's
    first turn arrives. Both instances are empty, so ongoing tokens tie and B lands on C0
    with A; session_count counts A as active on C0 and puts B on the idle C1."""
    a1 = session_turn("a1", 0.0, "A", 0)
    b1 = session_turn("b1", 10.0, "B", 1000)
    a2 = session_turn("a2", 10.0, "A", 0)  # A's next turn: the same context, cached on C0
    recs, _ = run([a1, b1, a2], build_policy(policy))
    assert recs["a1"].finish_s is not None
    assert recs["a1"].finish_s < 10.0
    assert recs["b1"].instance == b_instance
    assert recs["a2"].instance == "C0"  # sticky either way
    assert recs["a2"].cached_tokens == HEAVY_BLOCKS * 512
    cold = HEAVY_BLOCKS * 512 * P_TOK
    b_ttft = recs["b1"].first_token_s - recs["b1"].sent_s  # type: ignore[operator]
    a2_ttft = recs["a2"].first_token_s - recs["a2"].sent_s  # type: ignore[operator]
    assert b_ttft == pytest.approx(cold, rel=1e-9)  # B arrives first: it prefills at once
    if b_instance == "C1":
        # A's fully cached turn has nothing to prefill on its own instance
        assert a2_ttft == pytest.approx(0.0, abs=1e-12)
    else:
        # it waits for B's whole cold prefill on C0, then has nothing to compute
        assert recs["a2"].queue_s == pytest.approx(cold, rel=1e-9)
        assert a2_ttft == pytest.approx(cold, rel=1e-9)
