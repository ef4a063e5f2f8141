"""Mixed prefill/decode steps (`sim.step_model: mixed`, sim/steps.py) by hand: prefills
that wait together start in one step and pay the profile's fixed prefill cost once; a
decoding sequence keeps producing tokens during another request's prefill, each such step
a decode step plus the prefill's share; the step budget (`max_batched_tokens`) splits a
batch and chunks a long prefill; the settings refuse what mixed steps do not model."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from btb_lab.config.sim import SimSettings
from btb_lab.model.costmodel import RooflineCostModel
from btb_lab.policies.base import Policy
from btb_lab.records import Request, RequestRecord
from btb_lab.sim.backend import fidelity_facts, run_engine
from btb_lab.sim.bench import BenchCacheAware, bench_instances, bench_workload
from tests.unit.test_sim_engine import Scripted
from tests.unit.test_sim_profile_costs import profiled

FIXED_S = 0.05  # the profile's fixed cost per prefill (per step, mixed)
TOKEN_S = 1e-4  # per uncached prompt token (test_sim_profile_costs.DEFAULTS)
STEP_S = 0.01  # fixed part of a decode step
CONTEXT_S = 1e-6  # per context token per decode step


def run(
    reqs: list[Request], costs: RooflineCostModel, **settings: object
) -> dict[str, RequestRecord]:
    recs: list[RequestRecord] = []
    run_engine(costs, SimSettings(**settings), Scripted({}), reqs, recs.append, audit=True)  # type: ignore[arg-type]
    return {r.request_id: r for r in recs}


def mixed(reqs: list[Request], **settings: object) -> dict[str, RequestRecord]:
    return run(reqs, profiled(fixed_s=FIXED_S), step_model="mixed", **settings)


def serial(reqs: list[Request]) -> dict[str, RequestRecord]:
    return run(reqs, profiled(fixed_s=FIXED_S))


def step_s(context_tokens: int) -> float:
    return STEP_S + CONTEXT_S * context_tokens


def test_two_prefills_arriving_together_pay_the_fixed_cost_once() -> None:
    a = Request("a", 0.0, 512, 3, (1,), 512)
    b = Request("b", 0.0, 512, 3, (2,), 512)
    recs = mixed([a, b])
    batch = FIXED_S + 2 * 512 * TOKEN_S  # 0.1524, not 2 × 0.1012
    decode = step_s(2 * 513) + step_s(2 * 514)  # both decode their two steps together
    for rid in ("a", "b"):
        assert recs[rid].first_token_s == pytest.approx(batch, rel=1e-12)
        assert recs[rid].finish_s == pytest.approx(batch + decode, rel=1e-12)
        assert recs[rid].prefill_s == pytest.approx(batch, rel=1e-12)
    # serial: one prefill after the other, each paying the fixed cost
    one = FIXED_S + 512 * TOKEN_S
    old = serial([a, b])
    assert old["a"].first_token_s == pytest.approx(one, rel=1e-12)
    assert old["b"].first_token_s == pytest.approx(2 * one, rel=1e-12)


def test_a_decoding_sequence_keeps_producing_tokens_during_a_prefill() -> None:
    """a decodes 10 steps from 0.1012; b arrives during a's second step, so its prefill
    joins a's third step, which lasts a decode step plus b's whole prefill; then a and b
    decode together until b's two steps are done, and a goes on alone."""
    a = Request("a", 0.0, 512, 11, (1,), 512)
    t_a = FIXED_S + 512 * TOKEN_S
    t_b_arrives = t_a + step_s(513) + 0.5 * step_s(514)
    b = Request("b", t_b_arrives, 512, 3, (2,), 512)
    recs = mixed([a, b])
    assert recs["a"].first_token_s == pytest.approx(t_a, rel=1e-12)
    cut = t_a + step_s(513) + step_s(514)  # the boundary after a's second step
    slowed = step_s(515) + FIXED_S + 512 * TOKEN_S  # a's third step carries b's prefill
    first_b = cut + slowed
    assert recs["b"].first_token_s == pytest.approx(first_b, rel=1e-12)
    together = step_s(516 + 513) + step_s(517 + 514)  # a's steps 4–5, b's two steps
    assert recs["b"].finish_s == pytest.approx(first_b + together, rel=1e-12)
    alone = sum(step_s(518 + i) for i in range(5))  # a's steps 6–10
    assert recs["a"].finish_s == pytest.approx(first_b + together + alone, rel=1e-12)
    # serial: a's decode pauses for b's whole prefill, so b's first token comes one
    # decode step sooner and a ends at the same time (the slowed step costs what the pause
    # did; only batching several prefills and chunking long ones change totals)
    old = serial([a, b])
    assert old["b"].first_token_s == pytest.approx(cut + FIXED_S + 512 * TOKEN_S, rel=1e-12)
    assert old["a"].finish_s == pytest.approx(recs["a"].finish_s, rel=1e-12)


def test_the_step_budget_splits_a_batch() -> None:
    """Three 1024-token prefills at 0 with a 2048-token budget: two fit the first step; the
    third starts in the next, beside the two new decodes (which take one token each)."""
    reqs = [Request(r, 0.0, 1024, 3, (i, i + 10), 512) for i, r in enumerate("abc")]
    recs = mixed(reqs, max_batched_tokens=2048)
    first = FIXED_S + 2 * 1024 * TOKEN_S
    assert recs["a"].first_token_s == pytest.approx(first, rel=1e-12)
    assert recs["b"].first_token_s == pytest.approx(first, rel=1e-12)
    second = step_s(2 * 1025) + FIXED_S + 1024 * TOKEN_S
    assert recs["c"].first_token_s == pytest.approx(first + second, rel=1e-12)
    # a budget for all three: one step
    wide = mixed(reqs, max_batched_tokens=3072)
    for rid in "abc":
        assert wide[rid].first_token_s == pytest.approx(FIXED_S + 3 * 1024 * TOKEN_S, rel=1e-12)


def test_a_prefill_longer_than_the_budget_runs_in_chunks() -> None:
    """5120 tokens with a 2048-token budget: ceil(5120 / 2048) = 3 steps, each paying the
    fixed cost."""
    r = Request("a", 0.0, 5120, 2, tuple(range(10)), 512)
    recs = mixed([r], max_batched_tokens=2048)
    assert recs["a"].first_token_s == pytest.approx(3 * FIXED_S + 5120 * TOKEN_S, rel=1e-12)
    assert serial([r])["a"].first_token_s == pytest.approx(FIXED_S + 5120 * TOKEN_S, rel=1e-12)


def test_a_cached_prefix_leaves_the_budget_to_others() -> None:
    """b reuses a's two cached blocks, so only 512 of its 1536 tokens count against the
    budget: b and c (1024 new) fit one 1536-token step together."""
    a = Request("a", 0.0, 1024, 2, (1, 2), 512)
    b = Request("b", 5.0, 1536, 2, (1, 2, 3), 512)
    c = Request("c", 5.0, 1024, 2, (7, 8), 512)
    recs = mixed([a, b, c], max_batched_tokens=1536)
    assert recs["b"].cached_tokens == 1024
    assert recs["b"].first_token_s == pytest.approx(recs["c"].first_token_s, rel=1e-12)
    assert recs["c"].first_token_s == pytest.approx(
        5.0 + FIXED_S + (512 + 1024) * TOKEN_S, rel=1e-12
    )


@pytest.mark.parametrize(
    "other",
    [
        {"admission": "all_that_fit", "kv_visibility": "at_admission"},
        {"warm_copy_blocks_target": True},
    ],
)
def test_mixed_steps_refuse_what_they_do_not_model(other: dict[str, object]) -> None:
    with pytest.raises(ValidationError, match="step_model: mixed"):
        SimSettings(step_model="mixed", **other)  # type: ignore[arg-type]


@pytest.mark.parametrize("visibility", ["after_prefill", "at_admission"])
def test_a_busy_mixed_run_loses_nothing_and_batches_prefills(visibility: str) -> None:
    """1500 bench requests on a profile with a fixed prefill cost, audited at every event:
    every request finishes once, no first token comes before its arrival plus the
    uncached part of its own prefill, and prefills do share steps."""
    reqs = bench_workload(1500, seed=11)
    costs = profiled(bench_instances(), fixed_s=0.02, token_s=2e-5)
    recs: list[RequestRecord] = []
    settings = SimSettings(kv_visibility=visibility, step_model="mixed")  # type: ignore[arg-type]
    policy = BenchCacheAware(Policy.Params())
    _, stats, _ = run_engine(costs, settings, policy, reqs, recs.append, audit=True)
    assert 0 < stats["prefill_batches"] < len(reqs)
    assert sorted(r.request_id for r in recs) == sorted(r.request_id for r in reqs)
    assert all(r.ok for r in recs)
    for r in recs:
        assert r.first_token_s is not None
        assert r.finish_s is not None
        lower = (r.input_tokens - r.cached_tokens) * 2e-5
        assert r.first_token_s - r.arrival_s >= lower - 1e-9
        assert r.finish_s >= r.first_token_s


def test_the_step_model_is_recorded_with_the_fidelity_facts() -> None:
    costs = profiled(fixed_s=FIXED_S)
    facts = fidelity_facts(
        SimSettings(step_model="mixed", max_batched_tokens=4096), costs, Scripted({}), 512, "none"
    )
    assert (facts["sim.step_model"], facts["sim.max_batched_tokens"]) == ("mixed", 4096)
    assert facts["engine_steps"].startswith("mixed: waiting prefills start together, up to 4096")
    assert fidelity_facts(SimSettings(), costs, Scripted({}), 512, "none")[
        "engine_steps"
    ].startswith("serial")
