"""A fitted profile's cost terms as the engine charges them, by hand: the fixed prefill
cost, prefill attention over the context, the cost per cached prefix token, the cost per
running sequence per decode step and a measured KV transfer; a profile holding the
roofline's own coefficients reproduces the roofline run bit for bit, and each added term
makes a run slower. The policies' `prefill_s` / `transfer_s` price what the engine charges."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from btb_lab.config.costs import CostSettings
from btb_lab.config.sim import SimSettings
from btb_lab.model.costmodel import RooflineCostModel
from btb_lab.model.hardware import InstanceSpec
from btb_lab.model.profile import (
    DecodeFit,
    EngineProfile,
    PrefillFit,
    ProfileCostModel,
    TransferFit,
)
from btb_lab.policies.base import Decision, Policy
from btb_lab.records import Request, RequestRecord
from btb_lab.sim.backend import run_engine
from btb_lab.sim.bench import BenchCacheAware, bench_instances, bench_workload
from tests.unit.test_sim_engine import Scripted, nodes, req

TOKEN_S = 1e-4  # per uncached prompt token
STEP_S = 0.01  # fixed part of a decode step
CONTEXT_S = 1e-6  # per context token per decode step


DEFAULTS = {"fixed_s": 0.0, "context_s": 0.0, "cached_s": 0.0, "seq_s": 0.0,
            "token_s": TOKEN_S, "step_s": STEP_S, "step_context_s": CONTEXT_S}  # fmt: skip


def profiled(
    insts: list[InstanceSpec] | None = None, transfer: TransferFit | None = None, /, **terms: float
) -> ProfileCostModel:
    """A profile with the given terms (`DEFAULTS` otherwise) over `insts`."""
    t = DEFAULTS | terms
    profile = EngineProfile(
        name="hand",
        prefill=PrefillFit(fixed_s=t["fixed_s"], per_token_s=t["token_s"],
                           per_token_context_s=t["context_s"], per_cached_token_s=t["cached_s"]),
        decode=DecodeFit(fixed_s=t["step_s"], per_seq_s=t["seq_s"],
                         per_context_token_s=t["step_context_s"]),
        transfer=transfer,
    )  # fmt: skip
    return ProfileCostModel(
        insts or nodes(), CostSettings(), profile, path="hand.yaml", sha256="0" * 64
    )


def run(
    reqs: list[Request], costs: RooflineCostModel, policy: Policy | None = None
) -> dict[str, RequestRecord]:
    recs: list[RequestRecord] = []
    run_engine(costs, SimSettings(), policy or Scripted({}), reqs, recs.append, audit=True)
    return {r.request_id: r for r in recs}


def test_fixed_prefill_cost_is_charged_once_per_prefill() -> None:
    r = Request("a", 1.0, 1024, 3, (1, 2), 512)
    rec = run([r], profiled(fixed_s=0.05))["a"]
    decode = (0.01 + 1e-6 * 1025) + (0.01 + 1e-6 * 1026)  # two steps after the first token
    assert rec.prefill_s == pytest.approx(0.1524, rel=1e-12)  # 0.05 + 1024 × 1e-4
    assert rec.first_token_s == pytest.approx(1.0 + 0.1524, rel=1e-12)
    assert rec.finish_s == pytest.approx(1.0 + 0.1524 + decode, rel=1e-12)


@pytest.mark.parametrize(
    ("terms", "first_s", "second_s"),
    [
        # r1: 2560 new tokens on nothing; r2: 512 new tokens on 2048 cached
        ({}, 2560e-4, 512e-4),
        # attention: ctx · n · (c + n/2): r1 1e-9 · 2560 · 1280, r2 1e-9 · 512 · (2048 + 256)
        ({"context_s": 1e-9}, 0.256 + 0.0032768, 0.0512 + 0.001179648),
        # cached prefix: per cached token, r1 has none, r2 2048
        ({"cached_s": 2e-6}, 0.256, 0.0512 + 0.004096),
        ({"fixed_s": 0.02, "context_s": 1e-9, "cached_s": 2e-6},
         0.02 + 0.256 + 0.0032768, 0.02 + 0.0512 + 0.001179648 + 0.004096),
    ],
)  # fmt: skip
def test_prefill_attention_and_cached_terms_by_hand(
    terms: dict[str, float], first_s: float, second_s: float
) -> None:
    shared = (1, 2, 3, 4)
    reqs = [req("r1", 0.0, (*shared, 100)), req("r2", 10.0, (*shared, 200))]
    recs = run(reqs, profiled(**terms))
    r1, r2 = recs["r1"], recs["r2"]
    assert (r1.cached_tokens, r2.cached_tokens) == (0, 2048)
    assert r1.prefill_s == pytest.approx(first_s, rel=1e-12)
    assert r2.prefill_s == pytest.approx(second_s, rel=1e-12)
    assert r2.first_token_s == pytest.approx(10.0 + second_s, rel=1e-12)


@pytest.mark.parametrize("seq_s", [0.0, 0.003])
def test_decode_step_charges_each_running_sequence(seq_s: float) -> None:
    """Two 512-token prompts at 0 on one instance: r1 prefills, then r2 (r1's decode
    waits), then both decode their two remaining steps together (batch 2)."""
    a = Request("a", 0.0, 512, 3, (1,), 512)
    b = Request("b", 0.0, 512, 3, (2,), 512)
    recs = run([a, b], profiled(seq_s=seq_s))
    both_in = 2 * 512 * 1e-4
    steps = sum(0.01 + 2 * seq_s + 1e-6 * 2 * (513 + i) for i in range(2))
    assert recs["b"].first_token_s == pytest.approx(both_in, rel=1e-12)
    for rid in ("a", "b"):
        assert recs[rid].finish_s == pytest.approx(both_in + steps, rel=1e-12)
    # and alone, one sequence per step
    solo = run([a], profiled(seq_s=seq_s))["a"]
    alone = sum(0.01 + seq_s + 1e-6 * (513 + i) for i in range(2))
    assert solo.finish_s == pytest.approx(512e-4 + alone, rel=1e-12)


def test_measured_transfer_moves_offloaded_kv_at_the_fitted_cost() -> None:
    transfer = TransferFit(fixed_s=0.004, per_token_s=2e-6)
    costs = profiled(None, transfer)
    script = {"a": Decision(1, route="HEAVY_OFFLOAD", prefill_instance=0)}
    rec = run([Request("a", 0.0, 2048, 3, (1, 2, 3, 4), 512)], costs, Scripted(script))["a"]
    assert rec.kv_transfer_s == pytest.approx(0.004 + 2048 * 2e-6, rel=1e-12)
    assert costs.transfer_s(2048, 0, 1) == pytest.approx(rec.kv_transfer_s, rel=1e-12)
    assert rec.first_token_s == pytest.approx(2048e-4 + 0.004 + 2048 * 2e-6, rel=1e-12)


def test_policies_price_a_prefill_as_the_engine_charges_it() -> None:
    costs = profiled(fixed_s=0.02, context_s=1e-9, cached_s=2e-6)
    shared = (1, 2, 3, 4)
    recs = run([req("r1", 0.0, (*shared, 100)), req("r2", 10.0, (*shared, 200))], costs)
    assert costs.prefill_s(0, 2560) == recs["r1"].prefill_s
    assert costs.prefill_s(0, 512, cached_tokens=2048) == recs["r2"].prefill_s
    # the roofline ignores the cached prefix, as its engine does
    roof = RooflineCostModel(nodes(), CostSettings())
    assert roof.prefill_s(0, 512, cached_tokens=2048) == roof.prefill_s(0, 512)


def _bench_run(costs: RooflineCostModel) -> list[RequestRecord]:
    reqs = bench_workload(1500, seed=11)
    out: list[RequestRecord] = []
    settings = SimSettings(kv_visibility="at_admission")
    run_engine(costs, settings, BenchCacheAware(Policy.Params()), reqs, out.append)
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_a_profile_of_the_roofline_terms_reproduces_the_roofline_and_each_term_slows_it() -> None:
    roof = RooflineCostModel(bench_instances(), CostSettings())
    c = roof.per_instance[0]
    same = {"token_s": c.prefill_token_s, "step_s": c.decode_step_s,
            "step_context_s": c.decode_context_token_s}  # fmt: skip
    base = _bench_run(roof)
    assert [asdict(r) for r in _bench_run(profiled(bench_instances(), **same))] == [
        asdict(r) for r in base
    ]

    def ttft(recs: list[RequestRecord]) -> float:
        return _mean([r.first_token_s - r.arrival_s for r in recs if r.first_token_s])

    def decode(recs: list[RequestRecord]) -> float:
        return _mean([r.decode_s / max(1, r.output_tokens - 1) for r in recs])

    for term, value in (("fixed_s", 0.01), ("context_s", 1e-9), ("cached_s", 1e-6)):
        slower = _bench_run(profiled(bench_instances(), **same, **{term: value}))
        assert ttft(slower) > ttft(base), term
        assert decode(slower) >= decode(base) * 0.99, term  # decode is not what changed
    slower = _bench_run(profiled(bench_instances(), **same, seq_s=1e-4))
    assert decode(slower) > decode(base)
