"""Known-answer runs of the seeds' next-direction policies on the simulator engine: the
placements they make and the latencies those placements give, worked out by hand."""

from __future__ import annotations

import pytest

from btb_lab.policies import build_policy
from btb_lab.policies.base import Decision, WarmAction
from btb_lab.records import Request
from tests.unit.test_sim_engine import P_TOK, Scripted, nodes, run

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
    # a fully cached prompt still computes its last block (the last token's logits)
    assert recs["a2"].cached_tokens == (HEAVY_BLOCKS - 1) * 512
    cold = HEAVY_BLOCKS * 512 * P_TOK
    last_block = 512 * P_TOK
    b_ttft = recs["b1"].first_token_s - recs["b1"].sent_s  # type: ignore[operator]
    a2_ttft = recs["a2"].first_token_s - recs["a2"].sent_s  # type: ignore[operator]
    assert b_ttft == pytest.approx(cold, rel=1e-9)  # B arrives first: it prefills at once
    if b_instance == "C1":
        # A's cached turn computes only its last block on its own instance
        assert a2_ttft == pytest.approx(last_block, rel=1e-9)
    else:
        # it waits for B's whole cold prefill on C0, then computes its last block
        assert recs["a2"].queue_s == pytest.approx(cold, rel=1e-9)
        assert a2_ttft == pytest.approx(cold + last_block, rel=1e-9)


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
    insts = [make_instance(i, f"{r}{i}", r, h100, 4, llama, kv_connector=True)
             for i, r in enumerate(roles)]  # fmt: skip
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


@pytest.mark.parametrize(("kind", "head_start_s", "warm_prefills"),
                         [("labeling", 0.01, 2), (None, 0.0, 1)])  # fmt: skip
def test_a_hinted_first_arrival_starts_speculative_prefill_at_once(
    kind: str | None, head_start_s: float, warm_prefills: int
) -> None:
    """btb_hint, mode prefill, M = 2 on two instances, Y = the 4-block prefix. Hinted: r1
    fires the detector, both instances start prefilling the prefix at t = 0 and r1 waits
    for C0's copy; r2 (t = 0.01) lands on C1, 0.01 s into its copy. Unhinted: r1 runs cold
    on C0, r2 fires X = 2 and C1's speculative prefill starts only then."""
    prefix = (1, 2, 3, 4)
    reqs = []
    for rid, t, own in (("r1", 0.0, 900), ("r2", 0.01, 901)):
        r = Request(rid, t, 5 * 512, 2, (*prefix, own), 512)
        r.job_kind = kind
        reqs.append(r)
    policy = build_policy("btb_hint", {"mode": "prefill", "replicas": 2, "prefix_blocks": 4})
    recs, engine = run(reqs, policy)
    r1, r2 = recs["r1"], recs["r2"]
    assert (r1.instance, r2.instance, r2.route) == ("C0", "C1", "WARM_HIT")
    assert r1.first_token_s - r1.sent_s == pytest.approx(2560 * P_TOK, rel=1e-9)  # type: ignore[operator]
    r2_ttft = r2.first_token_s - r2.sent_s  # type: ignore[operator]
    assert r2_ttft == pytest.approx(2560 * P_TOK - head_start_s, rel=1e-9)
    assert r2.cached_tokens == 2048
    assert engine.stats["warm_prefills"] == warm_prefills


def test_adaptive_btb_with_collapsed_ranges_replays_btb_exactly() -> None:
    """On the engine, btb_adaptive whose X, Z, M ranges have no width gives BTB's records
    to the last time stamp; with room to grow M it warms more replicas on the burst."""
    from btb_lab.workload.generators import GenContext, generate

    work = generate(
        "bursted",
        {"windows": 1, "burst_size": 40, "prefix_tokens": 8192, "decoys_per_window": 1,
         "decoy_repeats": 2, "background_rate_per_s": 0.3, "burst_spread_s": 4},
        GenContext(seed=2),
    )  # fmt: skip
    fixed = {"prefix_tokens": 8192, "replicas": 2}
    collapsed = {**fixed, "replicas_max": 2, "burst_count_max": 2, "burst_window_max_s": 1.0}

    def replay(name: str, params: dict[str, object]) -> tuple[list[tuple[object, ...]], float]:
        recs, engine = run(work, build_policy(name, params), nodes(4))
        rows = sorted((r.request_id, r.instance, r.route, r.first_token_s, r.finish_s)
                      for r in recs.values())  # fmt: skip
        return rows, engine.stats["warm_copies"]

    btb_rows, btb_copies = replay("btb", fixed)
    same_rows, same_copies = replay("btb_adaptive", collapsed)
    assert same_rows == btb_rows
    assert same_copies == btb_copies == 1
    _, grown = replay("btb_adaptive", {**fixed, "replicas_max": 4, "grow_at_load": 1})
    assert grown > btb_copies
