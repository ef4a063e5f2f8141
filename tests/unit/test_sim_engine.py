"""Known-answer and behaviour tests of the simulator engine, with tiny test policies."""

from __future__ import annotations

from dataclasses import asdict
from typing import ClassVar

import pytest

from btb_lab.config.costs import CostSettings
from btb_lab.config.sim import SimSettings
from btb_lab.model.costmodel import RooflineCostModel
from btb_lab.model.hardware import GPU_PRESETS, MODEL_PRESETS, InstanceSpec, make_instance
from btb_lab.policies.base import ClusterView, Decision, Policy, WarmAction
from btb_lab.records import Request, RequestRecord
from btb_lab.sim.backend import run_engine
from btb_lab.sim.bench import BenchCacheAware, bench_instances, bench_workload
from btb_lab.sim.engine import Engine
from btb_lab.sim.jobs import ReqJob

LLAMA = MODEL_PRESETS["llama-3.3-70b"]
H100 = GPU_PRESETS["H100"]
P_TOK = 2 * 70.6e9 / (4 * 989e12 * 0.5)  # seconds per prefill token on 4×H100
KVB = 320 * 1024
STEP_BW = 13.4e12 * 0.8  # HBM bandwidth × MBU


def decode_step_s(context_tokens: int, weights: float = 70.6e9 * 2) -> float:
    return (weights + context_tokens * KVB) / STEP_BW


class Scripted(Policy):
    """Returns the decision scripted for each request id (default: instance 0)."""

    name: ClassVar[str] = "scripted"

    def __init__(self, script: dict[str, Decision]) -> None:
        super().__init__(Policy.Params())
        self.script = script
        self.finished: list[tuple[str, int]] = []

    def route(self, request: Request, view: ClusterView) -> Decision:
        return self.script.get(request.request_id, Decision(0))

    def on_finish(self, request: Request, instance: int, now_s: float) -> None:
        self.finished.append((request.request_id, instance))


class MatchThenLoad(Policy):
    """Longest match as the view reports it, then lowest load, then lowest index."""

    name: ClassVar[str] = "match_then_load"

    def route(self, request: Request, view: ClusterView) -> Decision:
        best = min(
            view.instances,
            key=lambda i: (-view.match_blocks(i.index, request.block_hashes), i.load, i.index),
        )
        return Decision(best.index)


def nodes(n: int = 2, *, connector: bool = True) -> list[InstanceSpec]:
    """`n` instances of llama-3.3-70b on 4×H100, with a KV connector (without one no KV
    moves between instances, as on a real cluster)."""
    return [make_instance(i, f"C{i}", "C", H100, 4, LLAMA, kv_connector=connector)
            for i in range(n)]  # fmt: skip


def req(rid: str, t: float, blocks: tuple[int, ...], out: int = 2) -> Request:
    return Request(rid, t, len(blocks) * 512, out, blocks, 512)


def roofline(insts: list[InstanceSpec], **costs: object) -> RooflineCostModel:
    return RooflineCostModel(insts, CostSettings(**costs))


def run(
    reqs: list[Request], policy: Policy, insts: list[InstanceSpec] | None = None, **settings: object
) -> tuple[dict[str, RequestRecord], Engine]:
    recs: list[RequestRecord] = []
    cost_keys = set(CostSettings.model_fields)
    costs = roofline(insts or nodes(), **{k: v for k, v in settings.items() if k in cost_keys})
    sim = SimSettings(**{k: v for k, v in settings.items() if k not in cost_keys})
    _, _, engine = run_engine(costs, sim, policy, reqs, recs.append, audit=True)
    return {r.request_id: r for r in recs}, engine


def test_single_request_ttft_and_e2e_by_hand() -> None:
    r = Request("a", 1.0, 1024, 11, tuple(range(2)), 512)
    recs, _ = run([r], Scripted({}))
    rec = recs["a"]
    prefill = 1024 * P_TOK
    decode = sum(decode_step_s(1025 + i) for i in range(10))  # 10 steps after token 1
    assert rec.first_token_s == pytest.approx(1.0 + prefill, rel=1e-9)
    assert rec.finish_s == pytest.approx(1.0 + prefill + decode, rel=1e-9)
    assert rec.prefill_s == pytest.approx(prefill)
    assert rec.decode_s == pytest.approx(decode)
    assert (rec.queue_s, rec.cached_tokens, rec.cache_tier, rec.instance) == (0.0, 0, None, "C0")
    assert rec.sent_s == rec.arrival_s == 1.0


@pytest.mark.parametrize(
    ("visibility", "instance", "cached", "ttft"),
    [
        # seed behaviour: the prefix is "resident" at admission, so the router piles R2
        # onto C0, where it waits for R1's prefill and then reuses 4 blocks
        ("at_admission", "C0", 2048, 3072 * P_TOK - 0.01),
        # causal: nothing is resident until R1's prefill completes; R2 goes cold to C1
        ("after_prefill", "C1", 0, 2560 * P_TOK),
    ],
)
def test_two_requests_sharing_a_prefix(
    visibility: str, instance: str, cached: int, ttft: float
) -> None:
    shared = (1, 2, 3, 4)
    reqs = [req("r1", 0.0, (*shared, 100)), req("r2", 0.01, (*shared, 200))]
    recs, _ = run(
        reqs, MatchThenLoad(Policy.Params()), kv_visibility=visibility, router_view="resident"
    )
    r2 = recs["r2"]
    assert (r2.instance, r2.cached_tokens) == (instance, cached)
    assert r2.first_token_s is not None
    assert r2.first_token_s - r2.arrival_s == pytest.approx(ttft, rel=1e-9)
    assert recs["r1"].first_token_s == pytest.approx(2560 * P_TOK)


def test_routed_view_sees_what_was_routed_before_it_is_resident() -> None:
    shared = (1, 2, 3, 4)
    reqs = [req("r1", 0.0, (*shared, 100)), req("r2", 0.01, (*shared, 200))]
    recs, _ = run(reqs, MatchThenLoad(Policy.Params()), router_view="routed")
    assert recs["r2"].instance == "C0"
    assert recs["r2"].cached_tokens == 2048  # complete by the time it is admitted


def test_warm_copy_waits_for_its_source_under_after_prefill() -> None:
    shared = (1, 2, 3, 4)
    warm = WarmAction(source=0, target=1, n_blocks=4)
    script = {"r2": Decision(1, route="WARM_HIT", warm=(warm,))}
    reqs = [req("r1", 0.0, (*shared, 100)), req("r2", 0.01, (*shared, 200))]
    copy_s = 0.001 + 2048 * KVB / 200e9

    recs, eng = run(reqs, Scripted(script), kv_visibility="after_prefill")
    (entry,) = eng.warm_log
    assert entry.start_s == pytest.approx(2560 * P_TOK)  # source complete, not 0.01
    assert entry.start_s >= entry.source_complete_s
    # waiting for the late copy loses to recomputing: R2 prefills cold on C1
    assert (recs["r2"].cached_tokens, recs["r2"].kv_transfer_s) == (0, 0.0)

    recs, eng = run(reqs, Scripted(script), kv_visibility="at_admission")
    (entry,) = eng.warm_log
    assert entry.start_s == pytest.approx(0.01)  # the seed copies KV not yet computed
    r2 = recs["r2"]
    assert (r2.cached_tokens, r2.cache_tier, r2.route) == (2048, "remote", "WARM_HIT")
    assert r2.kv_transfer_s == pytest.approx(copy_s)
    assert r2.first_token_s == pytest.approx(0.01 + copy_s + 512 * P_TOK)


def test_prefill_offload_ships_kv_to_the_decode_instance() -> None:
    script = {"a": Decision(1, route="HEAVY_OFFLOAD", prefill_instance=0)}
    r = Request("a", 0.0, 2048, 3, (1, 2, 3, 4), 512)
    transfer = 0.001 + 2048 * KVB / 200e9
    recs, _ = run([r], Scripted(script))
    rec = recs["a"]
    assert (rec.instance, rec.prefill_instance, rec.route) == ("C1", "C0", "HEAVY_OFFLOAD")
    assert rec.kv_transfer_s == pytest.approx(transfer)
    assert rec.first_token_s == pytest.approx(2048 * P_TOK + transfer)
    assert rec.decode_s == pytest.approx(decode_step_s(2049) + decode_step_s(2050))

    recs, _ = run([r], Scripted(script), layerwise=True)
    # layerwise: the copy overlaps the prefill; only the last layer's share is left
    assert recs["a"].first_token_s == pytest.approx(2048 * P_TOK + transfer / 80)


def test_without_a_connector_no_kv_moves_as_on_a_real_cluster() -> None:
    """`kv_connector: none` ran offloads and RDMA warm copies in the simulator all the
    same, while the cluster backend prefills an offload on its decode instance and warms
    by a speculative prefill: one file, two experiments. Now both worlds do the latter."""
    offload = {"a": Decision(1, route="HEAVY_OFFLOAD", prefill_instance=0)}
    r = Request("a", 0.0, 2048, 3, (1, 2, 3, 4), 512)
    recs, eng = run([r], Scripted(offload), insts=nodes(connector=False))
    rec = recs["a"]
    assert (rec.instance, rec.prefill_instance, rec.route) == ("C1", None, "HEAVY_OFFLOAD")
    assert rec.kv_transfer_s == 0.0
    assert rec.first_token_s == pytest.approx(2048 * P_TOK)
    assert eng.stats["offloads_without_connector"] == 1

    shared = (1, 2, 3, 4)
    warm = {"r2": Decision(1, route="WARM_HIT", warm=(WarmAction(source=0, target=1, n_blocks=4),))}
    reqs = [req("r1", 0.0, (*shared, 100)), req("r2", 0.01, (*shared, 200))]
    _, eng = run(reqs, Scripted(warm), insts=nodes(connector=False))
    assert (eng.stats["warm_copies"], eng.stats["warm_prefills"]) == (0, 1)
    assert eng.stats["warm_copies_as_prefills"] == 1
    _, eng = run(reqs, Scripted(warm))
    assert (eng.stats["warm_copies"], eng.stats["warm_prefills"]) == (1, 0)
    assert "warm_copies_as_prefills" not in eng.stats


def test_transferred_kv_reuse_for_later_turns() -> None:
    script = {"t1": Decision(1, prefill_instance=0)}
    turns = [req("t1", 0.0, (1, 2, 3)), req("t2", 5.0, (1, 2, 3, 4))]
    scripted = {**script, "t2": Decision(1)}
    recs, _ = run(turns, Scripted(scripted), transferred_kv_reusable=True)
    assert recs["t2"].cached_tokens == 3 * 512
    recs, _ = run(turns, Scripted(scripted), transferred_kv_reusable=False)
    assert recs["t2"].cached_tokens == 0


def test_admission_pauses_decode_at_the_next_step_boundary() -> None:
    long = Request("long", 0.0, 512, 400, (1,), 512)
    late = Request("late", 1.0, 512, 2, (2,), 512)
    recs, _ = run([long, late], Scripted({}))
    solo, _ = run([long], Scripted({}))
    step = decode_step_s(512 + 400)
    assert 0 <= recs["late"].queue_s < step  # waits at most one decode step
    assert recs["late"].prefill_s == pytest.approx(512 * P_TOK)
    # the long request lost at least the late one's prefill time
    delay = recs["long"].finish_s - solo["long"].finish_s  # type: ignore[operator]
    assert delay >= 512 * P_TOK


def test_connector_decode_slowdown_applies_to_connector_instances_only() -> None:
    r = Request("a", 0.0, 512, 50, (1,), 512)
    plain, _ = run([r], Scripted({}), insts=nodes(connector=False), connector_decode_slowdown=0.25)
    with_conn = [make_instance(0, "C0", "C", H100, 4, LLAMA, kv_connector=True)]
    slowed, _ = run([r], Scripted({}), insts=with_conn, connector_decode_slowdown=0.25)
    assert slowed["a"].decode_s == pytest.approx(plain["a"].decode_s * 1.25)
    assert slowed["a"].prefill_s == pytest.approx(plain["a"].prefill_s)


def test_request_larger_than_the_kv_budget_fails_cleanly() -> None:
    cap = nodes(1)[0].kv_budget_tokens
    big = Request("big", 0.0, cap + 1, 1, (), 512)
    ok = Request("ok", 0.5, 512, 2, (1,), 512)
    policy = Scripted({})
    recs, _ = run([big, ok], policy, insts=nodes(1))
    assert (recs["big"].ok, recs["ok"].ok) == (False, True)
    assert "KV tokens" in (recs["big"].error or "")
    assert sorted(policy.finished) == [("big", 0), ("ok", 0)]


@pytest.mark.parametrize("sharing", [True, False])
@pytest.mark.parametrize("offload", [False, True])
def test_output_fills_the_last_prompt_blocks_slack(sharing: bool, offload: bool) -> None:
    """With sharing a prompt holds whole blocks; its first output tokens go into the last
    block's slack, as in a paged cache, so a request of `input + output` tokens that fit
    the budget runs, prefilled where it decodes or received from a prefill instance (the
    slack was counted twice: `ceil(input/block)·block + output`)."""
    cap = nodes(1)[0].kv_budget_tokens
    n_blocks = cap // 512
    slack = 511
    out = cap - n_blocks * 512 + 1  # past the budget only when the slack is counted twice
    assert out <= slack
    fits = Request("fits", 0.0, n_blocks * 512 - slack, out, tuple(range(n_blocks)), 512)
    too_big = Request("too_big", 0.5, n_blocks * 512 - slack, slack + out, (), 512)
    offloaded = Decision(1, "PS", prefill_instance=0)
    policy = Scripted({"fits": offloaded, "too_big": offloaded} if offload else {})
    recs, _ = run([fits, too_big], policy, insts=nodes(2), kv_prefix_sharing=sharing)
    assert recs["fits"].ok, recs["fits"].error
    assert recs["fits"].prefill_instance == ("C0" if offload else None)
    assert recs["fits"].output_tokens == out
    assert not recs["too_big"].ok
    assert "KV tokens" in (recs["too_big"].error or "")


@pytest.mark.parametrize("step_model", ["serial", "mixed"])
@pytest.mark.parametrize("visibility", ["at_admission", "after_prefill"])
def test_requests_sharing_a_partial_last_block_do_not_share_its_slack(
    visibility: str, step_model: str
) -> None:
    """Identical prompts pin one partial last block; only one request's output fits in its
    slack, the others reserve their own (a paged cache never shares a partial block). With
    the slack credited to every sharer, all eight decoded at once in the KV of one."""
    cap = nodes(1)[0].kv_budget_tokens
    n_blocks = (cap - 3 * 511) // 512  # the shared prompt, and room for 3 more outputs
    blocks = tuple(range(n_blocks))
    same = [Request(f"r{i}", 0.0, (n_blocks - 1) * 512 + 1, 511, blocks, 512) for i in range(8)]
    recs, engine = run(
        same, Scripted({}), insts=nodes(1), kv_visibility=visibility, step_model=step_model
    )
    assert all(r.ok for r in recs.values())
    first_done = min(r.finish_s or 0.0 for r in recs.values())
    running_together = sum((r.first_token_s or 0.0) < first_done for r in recs.values())
    assert running_together == 4  # one output in the slack, three in reserved KV
    assert engine.insts[0].cache.reserved == 0


def test_pin_prompt_credits_the_slack_to_one_holder_of_the_last_block() -> None:
    from btb_lab.sim.cache import implementation
    from btb_lab.sim.jobs import admission_cost, kv_need, pin_prompt

    _, cache_cls, _ = implementation()
    cache = cache_cls("C0", 100_000, 512)
    request = Request("a", 0.0, 513, 300, (1, 2), 512)  # 511 tokens of slack
    first = ReqJob(request, None, *kv_need(1024, request))  # type: ignore[arg-type]
    second = ReqJob(request, None, *kv_need(1024, request))  # type: ignore[arg-type]
    assert (first.need, first.slack) == (1024, 300)
    first.need -= pin_prompt(cache, first)
    assert first.need == 0  # its output is in the last block's slack
    assert admission_cost(cache, second, 512, True) == 300  # the prompt is there, not the slack
    second.need -= pin_prompt(cache, second)
    assert (second.need, second.slack) == (300, 0)


def test_failed_offload_notifies_the_policy_with_its_decode_instance() -> None:
    """A prefill offload too big for its prefill instance fails there; the policy hears of
    it as of a finished request, for the instance it routed the request to (the decode
    instance), and the load it added on both instances is released."""
    cap = nodes(1)[0].kv_budget_tokens
    big = Request("big", 0.0, cap + 1, 1, (), 512)
    policy = Scripted({"big": Decision(1, "PS", prefill_instance=0)})
    recs, eng = run([big], policy)
    assert recs["big"].ok is False
    assert recs["big"].prefill_instance == "C0"
    assert policy.finished == [("big", 1)]
    assert [i.load.outstanding_tokens for i in eng.insts] == [0, 0]
    assert eng.stats["failed"] == 1


def test_policy_without_on_finish_is_not_called() -> None:
    """`on_finish` is skipped, for finished and failed requests alike, when the policy
    keeps the base class's (a no-op)."""

    class NoState(Policy):
        name: ClassVar[str] = "no_state"

        def route(self, request: Request, view: ClusterView) -> Decision:
            return Decision(0)

    eng = Engine(roofline(nodes(1)), SimSettings(), NoState(Policy.Params()), block_tokens=512)
    assert eng.notify_finish is False
    assert (
        Engine(roofline(nodes(1)), SimSettings(), Scripted({}), block_tokens=512).notify_finish
        is True
    )


def test_utilization_is_busy_fraction_per_sample_interval() -> None:
    r = Request("a", 0.25, 1024, 11, (1, 2), 512)
    util, _, _ = run_engine(roofline(nodes()), SimSettings(), Scripted({}), [r], lambda rec: None)
    busy = 1024 * P_TOK + sum(decode_step_s(1025 + i) for i in range(10))
    c0 = [u for u in util if u.instance == "C0"]
    c1 = [u for u in util if u.instance == "C1"]
    # one sample, covering [0, end of run): the last interval is normalized by its length
    assert len(c0) == 1
    assert c0[0].time_s == pytest.approx(0.25 + busy)
    assert c0[0].utilization == pytest.approx(busy / (0.25 + busy))
    assert all(u.utilization == 0.0 for u in c1)
    assert {(u.device, u.source) for u in util} == {("sim", "sim")}


def test_identical_inputs_give_identical_records() -> None:
    reqs = bench_workload(3000, seed=7)
    a: list[RequestRecord] = []
    b: list[RequestRecord] = []
    settings = SimSettings(kv_visibility="at_admission")
    run_engine(
        roofline(bench_instances()), settings, BenchCacheAware(Policy.Params()), reqs, a.append
    )
    run_engine(
        roofline(bench_instances()), settings, BenchCacheAware(Policy.Params()), reqs, b.append
    )
    assert [asdict(x) for x in a] == [asdict(x) for x in b]
    assert len({r.instance for r in a}) == 4  # the workload actually spreads
    assert sum(r.cached_tokens for r in a) > 0


def test_kv_visibility_changes_the_result_on_a_burst() -> None:
    reqs = [req(f"r{i}", 0.001 * i, (7, 8, 9, 10, 11, 12, 1000 + i)) for i in range(40)]
    out = {}
    for vis in ("at_admission", "after_prefill"):
        recs, _ = run(
            reqs,
            MatchThenLoad(Policy.Params()),
            insts=nodes(4),
            kv_visibility=vis,
            router_view="resident",
        )
        out[vis] = sum(r.cached_tokens for r in recs.values())
    assert out["at_admission"] != out["after_prefill"]


# ---------------------------------------------------------------- KV prefix sharing


@pytest.mark.parametrize("visibility", ["after_prefill", "at_admission"])
def test_shared_prefix_lets_a_burst_run_concurrently_only_with_sharing(visibility: str) -> None:
    inst = nodes(1)
    cap = inst[0].kv_budget_tokens
    prefix = tuple(range(int(0.6 * cap) // 512))  # 60% of the KV budget
    p_tokens = len(prefix) * 512
    reqs = [req(f"r{i}", 0.001 * i, (*prefix, 10_000 + i), out=50) for i in range(4)]

    on, eng = run(reqs, Scripted({}), insts=inst, kv_visibility=visibility)
    # r0 prefills everything; then r1..r3 start one after another, each reusing the
    # prefix and prefilling only its own block: none waits for a request to finish
    t0 = (p_tokens + 512) * P_TOK
    assert on["r0"].first_token_s == pytest.approx(t0, rel=1e-9)
    for i in range(1, 4):
        rec = on[f"r{i}"]
        assert rec.cached_tokens == p_tokens
        assert rec.first_token_s == pytest.approx(t0 + i * 512 * P_TOK, rel=1e-9)
        assert rec.queue_s == pytest.approx(t0 + (i - 1) * 512 * P_TOK - 0.001 * i, rel=1e-9)
        assert rec.first_token_s < on["r0"].finish_s  # type: ignore[operator]
    assert eng.insts[0].cache.n_pinned() == 0
    assert eng.insts[0].cache.reserved == 0

    off, _ = run(reqs, Scripted({}), insts=inst, kv_visibility=visibility, kv_prefix_sharing=False)
    # each reserves its whole 60%-of-budget prompt: they run one at a time
    for i in range(1, 4):
        prev, rec = off[f"r{i - 1}"], off[f"r{i}"]
        assert prev.finish_s is not None
        assert rec.first_token_s is not None
        assert rec.first_token_s - rec.prefill_s - rec.kv_load_s == pytest.approx(prev.finish_s)
        assert rec.queue_s >= prev.finish_s - rec.arrival_s - 1e-9


class WatchPrefix(Policy):
    """Instance 0 always; records how many blocks of `watch` are resident in HBM."""

    name: ClassVar[str] = "watch_prefix"

    def __init__(self, watch: tuple[int, ...]) -> None:
        super().__init__(Policy.Params())
        self.watch = watch
        self.seen: list[tuple[float, int]] = []

    def route(self, request: Request, view: ClusterView) -> Decision:
        self.seen.append((view.now_s, view.complete_blocks(0, self.watch)))
        return Decision(0)


@pytest.mark.parametrize("visibility", ["after_prefill", "at_admission"])
def test_pinned_prefix_blocks_are_never_evicted(visibility: str) -> None:
    inst = nodes(1)
    n_blocks = inst[0].kv_budget_tokens // 512
    shared = tuple(range(1, 101))  # 100 blocks, pinned by the long-running request
    long = req("long", 0.0, (*shared, 5000), out=10_000)
    # later requests churn through twice the cache in private blocks
    churn = [
        req(f"c{i}", 5.0 + 0.2 * i, tuple(100_000 + 4 * i + j for j in range(4)), out=2)
        for i in range(n_blocks // 2)
    ]
    reqs = [long, *churn]
    for sharing in (True, False):
        policy = WatchPrefix(shared)
        recs, _ = run(reqs, policy, insts=inst, kv_visibility=visibility, kv_prefix_sharing=sharing)
        end = recs["long"].finish_s
        assert end is not None
        assert end > churn[-1].arrival_s
        during = [n for t, n in policy.seen if 5.0 <= t < end]
        if sharing:
            assert during
            assert all(n == len(shared) for n in during)
        else:  # a plain LRU cache lets the churn evict the running request's prefix
            assert min(during) < len(shared)


def test_offload_decode_side_shares_the_received_prefix() -> None:
    cap = nodes(1)[0].kv_budget_tokens
    prefix = tuple(range(int(0.6 * cap) // 512))
    reqs = [req(f"r{i}", 0.001 * i, (*prefix, 10_000 + i), out=400) for i in range(2)]
    script = {r.request_id: Decision(1, prefill_instance=0) for r in reqs}
    recs, eng = run(reqs, Scripted(script), kv_visibility="after_prefill")
    r0, r1 = recs["r0"], recs["r1"]
    # r1 reuses the prefix on the prefill side, and on C1 joins the batch while r0 decodes
    assert r1.cached_tokens == len(prefix) * 512
    assert r1.first_token_s < r0.finish_s  # type: ignore[operator]
    for i in eng.insts:
        assert (i.cache.n_pinned(), i.cache.reserved) == (0, 0)
    recs, _ = run(reqs, Scripted(script), kv_visibility="after_prefill", kv_prefix_sharing=False)
    assert recs["r1"].first_token_s >= recs["r0"].finish_s  # type: ignore[operator]


@pytest.mark.parametrize("visibility", ["after_prefill", "at_admission"])
@pytest.mark.parametrize(("sharing", "shared_attn"), [(True, False), (False, False), (True, True)])
def test_sharing_runs_are_deterministic(visibility: str, sharing: bool, shared_attn: bool) -> None:
    reqs = bench_workload(2000, seed=11)
    settings = SimSettings(
        kv_visibility=visibility,
        kv_prefix_sharing=sharing,
        shared_prefix_attention=shared_attn,
    )
    out = []
    for _ in range(2):
        recs: list[RequestRecord] = []
        run_engine(
            roofline(bench_instances()),
            settings,
            BenchCacheAware(Policy.Params()),
            reqs,
            recs.append,
        )
        out.append([asdict(x) for x in recs])
    assert out[0] == out[1]


@pytest.mark.parametrize("visibility", ["after_prefill", "at_admission"])
@pytest.mark.parametrize("shared_attn", [True, False])
def test_shared_prefix_attention_reads_a_shared_prefix_once_by_hand(
    visibility: str, shared_attn: bool
) -> None:
    """r1 and r2 share a 4-block prefix on C0. r2 queues behind r1's prefill, reuses the
    prefix, then both decode together for r2's 10 steps; r1 finishes its last 10 alone.
    Cascade attention reads the 4 shared blocks once per joint step, not twice."""
    shared = (1, 2, 3, 4)
    n_shared_tokens = len(shared) * 512
    reqs = [req("r1", 0.0, (*shared, 100), out=21), req("r2", 0.01, (*shared, 200), out=11)]
    recs, eng = run(
        reqs, Scripted({}), kv_visibility=visibility, shared_prefix_attention=shared_attn
    )
    r1, r2 = recs["r1"], recs["r2"]
    t1 = 2560 * P_TOK  # r1's first token
    t2 = t1 + 512 * P_TOK  # r2's first token: 2048 of its 2560 prompt tokens cached
    assert r2.cached_tokens == n_shared_tokens
    assert r1.first_token_s == pytest.approx(t1, rel=1e-12)
    assert r2.first_token_s == pytest.approx(t2, rel=1e-12)
    dup = n_shared_tokens if shared_attn else 0
    # both contexts are 2561 + i tokens at joint step i
    joint = sum(decode_step_s(2 * (2561 + i) - dup) for i in range(10))
    alone = sum(decode_step_s(2561 + i) for i in range(10, 20))
    assert r2.finish_s == pytest.approx(t2 + joint, rel=1e-12)
    assert r1.finish_s == pytest.approx(t2 + joint + alone, rel=1e-12)
    # the per-step figure itself: (W + (ctx1 + ctx2 - N·bt) · kv_bytes) / (bw · mbu)
    spec = nodes()[0]
    step0 = (spec.model.active_weight_bytes + (2561 + 2561 - dup) * spec.kv_bytes_per_token) / (
        spec.hbm_bw * 0.8
    )
    assert step0 == pytest.approx(decode_step_s(2 * 2561 - dup), rel=1e-12)
    for inst in eng.insts:
        assert (inst.shared.refs, inst.shared.dup_tokens, inst.ctx_base) == ({}, 0, 0)


def test_shared_prefix_attention_counts_each_block_once_for_three_sequences() -> None:
    """Three sequences with the same 4-block prefix decode together: 2 × 4 blocks
    are duplicates; a fourth with a different prefix adds none."""
    shared = (1, 2, 3, 4)
    spec = nodes(1)
    eng = Engine(
        roofline(spec), SimSettings(shared_prefix_attention=True), Scripted({}), block_tokens=512
    )
    inst = eng.insts[0]
    jobs = []
    for i, blocks in enumerate([(*shared, 10), (*shared, 11), (*shared, 12), (7, 8, 9)]):
        r = req(f"r{i}", 0.0, blocks, out=5)
        rec = RequestRecord(
            "v", 0, r.request_id, "", "", None, "C0", "COLO", 0.0, 0.0, 0.0, None, 0, 5
        )
        job = ReqJob(r, rec, 0)
        job.n_pin = len(blocks)
        inst.cache.insert_pinned(blocks, 0)
        eng._begin_decode(inst, job)
        jobs.append(job)
    contexts = 3 * (2560 + 1) + (1536 + 1)
    assert inst.shared.dup_tokens == 2 * 4 * 512
    assert inst.ctx_base == contexts - 2 * 4 * 512
    eng._leave_shared(inst, jobs[0])
    assert inst.shared.dup_tokens == 4 * 512
    for job in jobs[1:]:
        eng._leave_shared(inst, job)
    assert (inst.shared.refs, inst.shared.dup_tokens) == ({}, 0)


def test_shared_prefix_attention_needs_prefix_sharing() -> None:
    with pytest.raises(ValueError, match=r"needs sim\.kv_prefix_sharing"):
        SimSettings(shared_prefix_attention=True, kv_prefix_sharing=False)
    assert SimSettings().shared_prefix_attention is False


@pytest.mark.parametrize(
    ("input_tokens", "hit", "cached"),
    [
        (1024, "full_blocks", 512),  # a whole-block prompt: its last block holds the last token
        (600, "full_blocks", 512),  # a partly filled last block is never a hit
        (513, "full_blocks", 512),
        (512, "full_blocks", 0),  # one block: nothing to spare but the recomputed token
        (1024, "whole_prompt", 1024),  # the seed simulator: a first token for free
        (600, "whole_prompt", 600),
    ],
)
@pytest.mark.parametrize("step_model", ["serial", "mixed"])
def test_a_repeated_prompt_computes_its_last_token(
    input_tokens: int, hit: str, cached: int, step_model: str
) -> None:
    """The same prompt twice on one instance: vLLM's hit is whole blocks short of the last
    prompt token, so the second prefill still runs (`prompt_cache_hit: full_blocks`); the
    seed simulator's rule spares all of it."""
    blocks = tuple(range(-(-input_tokens // 512)))
    reqs = [Request(rid, t, input_tokens, 2, blocks, 512) for rid, t in (("a", 0.0), ("b", 5.0))]
    recs, _ = run(reqs, Scripted({}), prompt_cache_hit=hit, step_model=step_model)
    second = recs["b"]
    assert second.cached_tokens == cached
    assert second.prefill_s == pytest.approx((input_tokens - cached) * P_TOK)
    assert second.first_token_s - second.arrival_s == pytest.approx((input_tokens - cached) * P_TOK)
    assert recs["a"].cached_tokens == 0


@pytest.mark.parametrize("shared", [True, False])
def test_a_copy_fanned_out_shares_the_sources_outgoing_link(shared: bool) -> None:
    """One source warms three targets at once: with its outgoing link shared the copies go
    one after another (the last lands after three copy times); without, all land together."""
    blocks = (1, 2, 3, 4)
    warm = tuple(WarmAction(source=0, target=t, n_blocks=4) for t in (1, 2, 3))
    script = {"r1": Decision(0), "w": Decision(0, warm=warm)}
    reqs = [req("r1", 0.0, (*blocks, 100)), req("w", 10.0, (*blocks, 200))]
    copy_s = 0.001 + 2048 * KVB / 200e9
    _, eng = run(reqs, Scripted(script), nodes(4), rdma_egress_shared=shared)
    done = sorted(entry.done_s for entry in eng.warm_log)
    if shared:
        assert done == pytest.approx([10.0 + k * copy_s for k in (1, 2, 3)])
    else:
        assert done == pytest.approx([10.0 + copy_s] * 3)
