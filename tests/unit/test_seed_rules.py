"""Known-answer tests of the seed simulator's rules (SEED-SIMULATOR.md), each a setting of
its own: a two- or three-request case per rule, worked by hand, under the rule and under
btb-lab's causal default."""

from __future__ import annotations

import sys

import pytest

from btb_lab.config.costs import CostSettings
from btb_lab.config.hypothesis import Hypothesis
from btb_lab.config.sim import SimSettings
from btb_lab.model.costmodel import RooflineCostModel
from btb_lab.model.hardware import GPU_PRESETS, InstanceSpec
from btb_lab.policies import build_policy
from btb_lab.policies.base import Decision, Policy, WarmAction
from btb_lab.policies.btb import BTB
from btb_lab.records import Request, RequestRecord
from btb_lab.sim.backend import run_replay
from btb_lab.sim.engine import Engine
from tests.unit.test_policies_fakes import FakeView, cluster, request
from tests.unit.test_sim_engine import (
    KVB,
    LLAMA,
    P_TOK,
    MatchThenLoad,
    Scripted,
    decode_step_s,
    nodes,
    run,
)

H100 = GPU_PRESETS["H100"]


def small_node(index: int, kv_tokens: int) -> InstanceSpec:
    """A 4×H100 llama instance whose KV budget is exactly `kv_tokens` tokens."""
    return InstanceSpec(index, f"C{index}", "C", H100, 4, LLAMA, kv_tokens * KVB)


# -- decode_steps --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("rule", "steps"),
    [("after_first_token", [1025]), ("output_tokens", [1024, 1025])],
)
def test_decode_steps(rule: str, steps: list[int]) -> None:
    """2 output tokens: vLLM decodes once after the prefill's token; the seed decodes
    twice, starting from context = input."""
    r = Request("a", 0.0, 1024, 2, (1, 2), 512)
    recs, _ = run([r], Scripted({}), decode_steps=rule)
    rec = recs["a"]
    assert rec.first_token_s == pytest.approx(1024 * P_TOK, rel=1e-12)
    assert rec.finish_s == pytest.approx(
        1024 * P_TOK + sum(decode_step_s(k) for k in steps), rel=1e-12
    )


def test_one_token_requests_still_decode_once_under_the_seed_rule() -> None:
    r = Request("a", 0.0, 512, 1, (1,), 512)
    causal, _ = run([r], Scripted({}))
    seed, _ = run([r], Scripted({}), decode_steps="output_tokens")
    assert causal["a"].finish_s == pytest.approx(512 * P_TOK)
    assert seed["a"].finish_s == pytest.approx(512 * P_TOK + decode_step_s(512), rel=1e-12)


# -- prefix_cache_budget -------------------------------------------------------------------
@pytest.mark.parametrize(("budget", "cached"), [("unreserved", 0), ("whole", 1024)])
def test_prefix_cache_budget(budget: str, cached: int) -> None:
    """A (blocks 1, 2) finishes; B (3, 4, long output) reserves 2,024 of 2,048 tokens, so
    an unreserved-capped cache keeps no block, while a cache capped at the whole budget
    (the seed's double counting) keeps A's and B's 4 blocks; C (1, 2) waits for B and
    then finds A's prefix only in the second case."""
    reqs = [
        Request("a", 0.0, 1024, 1, (1, 2), 512),
        Request("b", 1.0, 1024, 1000, (3, 4), 512),
        Request("c", 1.001, 1024, 1, (1, 2), 512),
    ]
    recs, _ = run(
        reqs, Scripted({}), [small_node(0, 2048)], prefix_cache_budget=budget,
        host_ram_tier=False, kv_prefix_sharing=False, prompt_cache_hit="whole_prompt",
    )  # fmt: skip
    assert recs["c"].cached_tokens == cached
    assert recs["c"].queue_s > 0  # it waited for B's memory


# -- output_blocks_cached ------------------------------------------------------------------
@pytest.mark.parametrize(("rule", "extra"), [(False, 0), (True, 2)])
def test_output_blocks_enter_the_cache_at_admission(rule: bool, extra: int) -> None:
    """1,024 input + 600 output tokens = ceil(1624 / 512) = 4 blocks, 2 of them output."""
    r = Request("a", 0.0, 1024, 600, (1, 2), 512)
    _, engine = run([r], Scripted({}), output_blocks_cached=rule)
    unpinned, pinned, _, _ = engine.insts[0].cache.snapshot()
    hbm = unpinned + list(pinned)
    assert sorted(h for h in hbm if h < 0) == ([-2, -1] if extra else [])
    assert {1, 2} <= set(hbm)
    assert len(hbm) == 2 + extra


def test_output_blocks_take_cache_space() -> None:
    """With a 2-block whole-budget cache (1,025 tokens), A's output block pushes its first
    prompt block out (LRU), so B (same two blocks) hits nothing: a match is a leading run."""
    reqs = [Request("a", 0.0, 1024, 1, (1, 2), 512), Request("b", 5.0, 1024, 1, (1, 2), 512)]
    plain, _ = run(reqs, Scripted({}), [small_node(0, 1025)], prefix_cache_budget="whole",
                   host_ram_tier=False, kv_prefix_sharing=False,
                   kv_visibility="at_admission")  # fmt: skip
    seed, _ = run(reqs, Scripted({}), [small_node(0, 1025)], prefix_cache_budget="whole",
                  host_ram_tier=False, kv_prefix_sharing=False,
                  output_blocks_cached=True, kv_visibility="at_admission")  # fmt: skip
    assert plain["b"].cached_tokens == 512  # its last block computed again (vLLM)
    assert seed["b"].cached_tokens == 0


# -- router_match_tiers --------------------------------------------------------------------
@pytest.mark.parametrize(("tiers", "matched"), [("hbm", 1), ("hbm_ram", 3)])
def test_router_match_counts_host_ram(tiers: str, matched: int) -> None:
    costs = RooflineCostModel(nodes(1), CostSettings())
    sim = SimSettings(router_view="resident", router_match_tiers=tiers)
    engine = Engine(costs, sim, Scripted({}), block_tokens=512)
    cache = engine.insts[0].cache
    cache.insert([7, 8, 9], fit=False)
    assert cache.demote([8, 9]) == [8, 9]  # in host RAM, as an eviction would leave them
    assert engine.view.match_blocks(0, [7, 8, 9, 10]) == matched


# -- warm_copy_blocks_target ---------------------------------------------------------------
@pytest.mark.parametrize("blocking", [False, True])
def test_warm_copy_blocks_the_target(blocking: bool) -> None:
    """A on C0 asks for a copy of its 4 blocks to C1; B arrives on C1 right after. A
    blocking copy (the seed) runs on C1's compute first; a link copy does not delay B."""
    blocks = (1, 2, 3, 4)
    copy = WarmAction(source=0, target=1, n_blocks=4)
    script = {"a": Decision(0), "b": Decision(1), "w": Decision(0, warm=(copy,))}
    reqs = [
        Request("a", 0.0, 2048, 1, blocks, 512),
        Request("w", 10.0, 2048, 1, blocks, 512),
        Request("b", 10.0, 512, 1, (50,), 512),
    ]
    recs, _ = run(reqs, Scripted(script), warm_copy_blocks_target=blocking)
    copy_s = 0.001 + 2048 * KVB / (4 * 50e9)
    start = 10.0 + (copy_s if blocking else 0.0)
    assert recs["b"].first_token_s == pytest.approx(start + 512 * P_TOK, rel=1e-9)


# -- admission -----------------------------------------------------------------------------
@pytest.mark.parametrize(("rule", "probe_on"), [("serial", "C1"), ("all_that_fit", "C0")])
def test_all_that_fit_admission_makes_queued_prompts_visible(rule: str, probe_on: str) -> None:
    """A and B queue on C0 at t=0 (Scripted); a probe sharing B's blocks arrives during
    A's prefill. Serial admission has not admitted B yet (nothing of B is resident, so
    the probe goes to the idle C1); the seed admits both at once and B's blocks are
    visible under at_admission, so the probe follows them to C0."""

    class Route(MatchThenLoad):
        def route(self, request: Request, view: object) -> Decision:  # type: ignore[override]
            if request.request_id in ("a", "b"):
                return Decision(0)
            return super().route(request, view)  # type: ignore[arg-type]

    reqs = [
        Request("a", 0.0, 4096, 1, tuple(range(1, 9)), 512),
        Request("b", 0.0, 1024, 1, (20, 21), 512),
        Request("probe", 0.01, 1024, 1, (20, 21), 512),
    ]
    recs, _ = run(
        reqs, Route(Policy.Params()), kv_visibility="at_admission", router_view="resident",
        admission=rule,
    )  # fmt: skip
    assert recs["probe"].instance == probe_on
    # B's prefill starts when A's ends either way
    assert recs["b"].first_token_s == pytest.approx((4096 + 1024) * P_TOK, rel=1e-9)


def test_all_that_fit_needs_visibility_at_admission() -> None:
    with pytest.raises(ValueError, match="at_admission"):
        SimSettings(admission="all_that_fit")


# -- host RAM ------------------------------------------------------------------------------
def test_unbounded_host_ram() -> None:
    costs = RooflineCostModel(nodes(1), CostSettings())
    engine = Engine(costs, SimSettings(host_ram_bytes=None), Scripted({}), block_tokens=512)
    assert engine.insts[0].cache.ram_cap_blocks == sys.maxsize
    bounded = Engine(costs, SimSettings(host_ram_bytes=512 * KVB * 3), Scripted({}),
                     block_tokens=512)  # fmt: skip
    assert bounded.insts[0].cache.ram_cap_blocks == 3


# -- window_replay -------------------------------------------------------------------------
@pytest.mark.parametrize(("replay", "cached"), [("continuous", 512), ("fresh", 0)])
def test_window_replay(replay: str, cached: int) -> None:
    """Two windows with the same prompt: on one cluster the second hits the first's
    cache; on a fresh cluster per window it starts cold."""
    reqs = [
        Request("w0", 0.0, 1024, 1, (1, 2), 512, trace_id="w0"),
        Request("w1", 10.0, 1024, 1, (1, 2), 512, trace_id="w1"),
    ]
    recs: list[RequestRecord] = []
    built: list[Policy] = []

    def make() -> Policy:
        built.append(Scripted({}))
        return built[-1]

    costs = RooflineCostModel(nodes(1), CostSettings())
    _, _stats, policies = run_replay(costs, SimSettings(window_replay=replay), make, reqs,
                                    recs.append)  # fmt: skip
    by_id = {r.request_id: r for r in recs}
    assert by_id["w1"].cached_tokens == cached
    assert len(policies) == (2 if replay == "fresh" else 1) == len(built)


# -- tie_break -----------------------------------------------------------------------------
def test_cache_aware_ties_lowest_or_seeded_random() -> None:
    view = FakeView(cluster([0, 0, 0, 0]))
    lowest = build_policy("cache_aware", {})
    assert {lowest.route(request(f"r{i}", blocks=[i]), view).instance for i in range(20)} == {0}
    picks = []
    for seed in (1, 1, 2):
        policy = build_policy("cache_aware", {"tie_break": "random"}, seed=seed)
        picks.append([policy.route(request(f"r{i}", blocks=[i]), view).instance for i in range(20)])
    assert picks[0] == picks[1]  # same seed, same draws
    assert picks[0] != picks[2]
    assert set(picks[0]) == {0, 1, 2, 3}


def test_random_ties_only_among_the_tied() -> None:
    view = FakeView(cluster([3, 0, 2, 0]))
    policy = build_policy("cache_aware", {"tie_break": "random"}, seed=5)
    assert {policy.route(request(f"r{i}", blocks=[i]), view).instance for i in range(30)} == {
        1,
        3,
    }


# -- BTB recopy and route_active -----------------------------------------------------------
PREFIX = list(range(5000, 5004))


def _btb(**params: object) -> BTB:
    policy = build_policy("btb", {"prefix_blocks": 4, "replicas": 3, **params})
    assert isinstance(policy, BTB)
    return policy


def test_btb_route_active_holders_waits_for_copies_to_land() -> None:
    view = FakeView(cluster([2, 0, 0, 0]), complete={0: set(PREFIX)}, routed={0: set(PREFIX)})
    policy = _btb(route_active="holders")
    policy.route(request("r0", blocks=[*PREFIX, 1]), view)
    fired = policy.route(request("r1", blocks=[*PREFIX, 2]), view)
    assert [a.target for a in fired.warm] == [1, 2]
    assert fired.instance == 0  # the only holder: copies have not landed
    view.complete = {0: set(PREFIX), 2: set(PREFIX)}  # the copy to 2 landed
    assert policy.route(request("r2", blocks=[*PREFIX, 3]), view).instance == 2
    warm_set = _btb()
    warm_set.route(request("r0", blocks=[*PREFIX, 1]), view)
    assert warm_set.route(request("r1", blocks=[*PREFIX, 2]), view).instance in (1, 3)


def test_btb_recopy_tops_the_warm_set_up_after_an_eviction() -> None:
    view = FakeView(cluster([2, 0, 0, 1]), complete={0: set(PREFIX)}, routed={0: set(PREFIX)})
    # with recopy the least-loaded instance lacking the prefix gets it again: 1 itself
    for recopy, expect in ((False, []), (True, [1])):
        policy = _btb(recopy=recopy, route_active="holders")
        view.complete = {0: set(PREFIX)}
        policy.route(request("r0", blocks=[*PREFIX, 1]), view)
        fired = policy.route(request("r1", blocks=[*PREFIX, 2]), view)
        assert [a.target for a in fired.warm] == [1, 2]
        view.complete = {0: set(PREFIX), 1: set(PREFIX), 2: set(PREFIX)}  # both landed
        assert policy.route(request("r2", blocks=[*PREFIX, 3]), view).warm == ()
        view.complete = {0: set(PREFIX), 2: set(PREFIX)}  # 1 evicted the prefix
        again = policy.route(request("r3", blocks=[*PREFIX, 4]), view)
        assert [a.target for a in again.warm] == expect


# -- the profile ---------------------------------------------------------------------------
BASE = {
    "id": "P",
    "title": "t",
    "claim": "c",
    "date": "2026-12-01",
    "model": "seed-llama-3.3-70b",
    "cluster": {"instances": [{"role": "C", "count": 4, "gpu": "H100", "gpus": 4}]},
    "workload": {"generator": {"kind": "seed_bursty", "params": {"windows": 1}}},
    "variants": {
        "ca": {"router": {"policy": "cache_aware"}},
        "btb": {"router": {"policy": "early_rdma", "params": {"recopy": False}}},
    },
    "baseline": "ca",
    "verdict": {"metric": "ttft_mean", "direction": "decrease", "min_effect": 0.05},
}


def test_profile_sets_every_rule_and_written_settings_win() -> None:
    hyp = Hypothesis.model_validate(
        {**BASE, "sim": {"profile": "infer-sim", "decode_steps": "after_first_token"}}
    )
    sim = hyp.sim
    assert (sim.window_replay, sim.kv_visibility, sim.admission) == (
        "fresh", "at_admission", "all_that_fit",
    )  # fmt: skip
    assert (sim.prefix_cache_budget, sim.output_blocks_cached, sim.router_match_tiers) == (
        "whole", True, "hbm_ram",
    )  # fmt: skip
    assert sim.host_ram_bytes is None
    assert sim.warm_copy_blocks_target
    assert sim.decode_steps == "after_first_token"  # written out: wins
    assert (hyp.costs.gpu_memory_utilization, hyp.costs.transfer_setup_ms) == (1.0, 0.0)
    assert hyp.variants["ca"].router.params == {"tie_break": "random"}
    # the alias early_rdma gets btb's defaults; its written recopy wins
    assert hyp.variants["btb"].router.params == {
        "recopy": False, "tie_break": "random", "route_active": "holders",
    }  # fmt: skip
    assert "sim.decode_steps" not in hyp.profile_settings
    assert "costs.gpu_memory_utilization" in hyp.profile_settings


def test_causal_default_changes_nothing() -> None:
    hyp = Hypothesis.model_validate(BASE)
    assert hyp.sim == SimSettings()
    assert hyp.profile_settings == []


def test_profile_is_not_a_variant_setting() -> None:
    data = {**BASE, "variants": {**BASE["variants"], "x": {  # type: ignore[dict-item]
        "router": {"policy": "cache_aware"}, "sim": {"profile": "infer-sim"}}}}  # fmt: skip
    with pytest.raises(ValueError, match="whole hypothesis"):
        Hypothesis.model_validate(data)
