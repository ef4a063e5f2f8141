"""Known-answer runs of the seeds' next-direction policies on the simulator engine: the
placements they make and the latencies those placements give, worked out by hand."""

from __future__ import annotations

import pytest

from btb_lab.policies import build_policy
from btb_lab.policies.base import Decision, WarmAction
from btb_lab.records import Request
from tests.unit.test_sim_engine import P_TOK, Scripted, run

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


@pytest.mark.parametrize(
    ("first_chunk", "queue_tokens", "ttft_tokens"),
    [
        (2, 1024, 1024 + 512),  # chunk 2 computes only blocks 3-4, then w2's own block
        (4, 0, 512),  # the whole prefix was prefilled at t=0: w2 computes its block only
    ],
)
def test_a_later_chunk_recomputes_only_the_blocks_it_adds(
    first_chunk: int, queue_tokens: int, ttft_tokens: int
) -> None:
    """WarmAction(prefill, n_blocks=depth) as btb's chunks use it: the target prefills
    only the blocks it does not hold yet, so chunks cost what one whole prefill costs."""
    prefix = (1, 2, 3, 4)
    w1 = Request("w1", 0.0, 5 * 512, 2, (*prefix, 900), 512)
    w2 = Request("w2", 1.0, 5 * 512, 2, (*prefix, 901), 512)
    chunk = (WarmAction(None, 1, 4, "prefill"),) if first_chunk < 4 else ()
    script = {
        "w1": Decision(0, warm=(WarmAction(None, 1, first_chunk, "prefill"),)),
        "w2": Decision(1, warm=chunk),
    }
    recs, engine = run([w1, w2], Scripted(script))
    r = recs["w2"]
    assert r.instance == "C1"
    assert r.cached_tokens == 2048
    assert r.queue_s == pytest.approx(queue_tokens * P_TOK, rel=1e-9, abs=1e-12)
    assert r.first_token_s - r.sent_s == pytest.approx(ttft_tokens * P_TOK, rel=1e-9)  # type: ignore[operator]
    assert engine.stats["warm_prefills"] == (2 if first_chunk < 4 else 1)


def test_pd_split_by_hand_prefill_pool_then_transfer_then_decode_pool() -> None:
    """Two prefill and two decode instances. Turn 1 prefills cold on P0 and its KV moves
    to the idle D; turn 2 of the same context goes back to P0, which holds it, and only
    its new block is computed there."""
    from btb_lab.model.hardware import GPU_PRESETS, MODEL_PRESETS, make_instance

    llama, h100 = MODEL_PRESETS["llama-3.3-70b"], GPU_PRESETS["H100"]
    roles = ["PS", "PS", "C", "C"]
    insts = [make_instance(i, f"{r}{i}", r, h100, 4, llama) for i, r in enumerate(roles)]
    t1 = Request("t1", 0.0, 4 * 512, 3, (1, 2, 3, 4), 512, session_id="s")
    t2 = Request("t2", 5.0, 5 * 512, 3, (1, 2, 3, 4, 5), 512, session_id="s")
    recs, _ = run([t1, t2], build_policy("pd_split"), insts)
    kvb = 320 * 1024
    for rec, tokens, computed in ((recs["t1"], 2048, 2048), (recs["t2"], 2560, 512)):
        transfer = 0.001 + tokens * kvb / 200e9
        assert (rec.prefill_instance, rec.instance, rec.route) == ("PS0", "C2", "PD")
        assert rec.cached_tokens == tokens - computed
        assert rec.kv_transfer_s == pytest.approx(transfer)
        ttft = rec.first_token_s - rec.sent_s  # type: ignore[operator]
        assert ttft == pytest.approx(computed * P_TOK + transfer, rel=1e-9)
