"""`costs.prefill_weight_read`: a prefill reads the active weights once, as a decode step
does, so it takes no less than active weight bytes / (HBM × MBU) however few its new
tokens. By hand on llama-3.3-70b, 4×H100: 141.2 GB of bf16 weights over 4 × 3.35 TB/s ×
0.8 is 13.17 ms, the compute of ~185 tokens at MFU 0.5. Off (the default) a prefill is
its compute alone. Under `step_model: mixed` a batch's steps pay it once a step, and not
beside running decodes (whose steps read the weights already)."""

from __future__ import annotations

import pytest

from btb_lab.config.costs import CostSettings
from btb_lab.model.costmodel import RooflineCostModel
from btb_lab.records import Request
from tests.unit.test_sim_engine import Scripted, nodes, req, run

WEIGHTS_S = 2 * 70.6e9 / (4 * 3.35e12 * 0.8)  # bf16 active weights / (HBM × MBU)
P_TOK_S = 2 * 70.6e9 / (4 * 989e12 * 0.5)  # one prompt token's linear layers at MFU 0.5
SHARED = tuple(range(1, 9))  # 8 blocks of 512 tokens


def _hit(rid: str, t: float, suffix: int) -> Request:
    """The 8 shared blocks plus `suffix` new tokens in a ninth block of its own."""
    return Request(rid, t, 8 * 512 + suffix, 2, (*SHARED, 1000 + int(t * 10)), 512)


def test_the_floor_is_one_read_of_the_weights() -> None:
    costs = RooflineCostModel(nodes(1), CostSettings(prefill_weight_read=True))
    inst = costs.per_instance[0]
    assert inst.prefill_floor_s == pytest.approx(WEIGHTS_S, rel=1e-3)
    assert inst.prefill_floor_s == inst.decode_step_s
    assert inst.prefill_floor_s / inst.prefill_token_s == pytest.approx(184.5, abs=0.1)
    assert costs.prefill_s(0, 1) == inst.prefill_floor_s
    assert costs.prefill_s(0, 16, 4096) == inst.prefill_floor_s
    assert costs.prefill_s(0, 1000) == 1000 * inst.prefill_token_s  # compute-bound above
    off = RooflineCostModel(nodes(1), CostSettings()).per_instance[0]
    assert off.prefill_floor_s == 0.0
    assert not off.prefill_terms  # the engine keeps its per-token fast path
    with pytest.raises(ValueError, match="a fitted profile"):
        CostSettings(prefill_weight_read=True, model={"profile": "p.yaml"})


@pytest.mark.parametrize("on", [False, True])
def test_a_prompt_found_almost_whole_in_cache_pays_the_read(on: bool) -> None:
    """r2 finds r1's 8 blocks and computes 16 tokens: 1.1 ms of compute, 13.2 ms read."""
    recs, _ = run([req("r1", 0.0, SHARED), _hit("r2", 100.0, 16)], Scripted({}),
                  prefill_weight_read=on)  # fmt: skip
    r1, r2 = recs["r1"], recs["r2"]
    assert r1.prefill_s == pytest.approx(4096 * P_TOK_S, rel=1e-3)  # compute-bound: unchanged
    assert r2.cached_tokens == 4096
    expected = WEIGHTS_S if on else 16 * P_TOK_S
    assert r2.prefill_s == pytest.approx(expected, rel=1e-3)
    assert r2.first_token_s - r2.arrival_s == pytest.approx(expected, rel=1e-3)


def test_a_mixed_batch_reads_the_weights_once_a_step_not_once_a_prefill() -> None:
    """Two cache hits arriving together at an idle instance run as one batch of one step:
    one weight read for both (the serial engine reads them once each)."""
    reqs = [req("r1", 0.0, SHARED), _hit("a", 100.0, 16), _hit("b", 100.0, 16)]
    mixed, _ = run(reqs, Scripted({}), prefill_weight_read=True, step_model="mixed")
    assert mixed["a"].first_token_s == pytest.approx(100.0 + WEIGHTS_S, rel=1e-6)
    assert mixed["b"].first_token_s == mixed["a"].first_token_s
    serial, _ = run(reqs, Scripted({}), prefill_weight_read=True)
    assert serial["b"].first_token_s == pytest.approx(100.0 + 2 * WEIGHTS_S, rel=1e-6)


def test_beside_running_decodes_a_mixed_step_adds_no_read() -> None:
    """r1 decodes 2,000 tokens; r2's small prefill rides on its steps, which read the
    weights already: the same records with and without the setting."""
    reqs = [req("r1", 0.0, SHARED, out=2000), _hit("r2", 1.0, 16)]
    on, _ = run(reqs, Scripted({}), prefill_weight_read=True, step_model="mixed")
    off, _ = run(reqs, Scripted({}), step_model="mixed")
    assert on["r2"].first_token_s == off["r2"].first_token_s
    assert on["r1"].finish_s == off["r1"].finish_s
    # r1's own cold prefill (4,096 tokens, compute-bound) is the same too
    assert on["r1"].first_token_s == off["r1"].first_token_s
