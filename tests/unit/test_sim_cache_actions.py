"""Known-answer runs of cache actions (pin, unpin, evict, demote, promote) on the simulator
engine, and of the `btb_cache` policy that decides them. Every number is worked out by
hand from the roofline: P_TOK per prefill token, KV over the host link at 220 GB/s."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pydantic import ValidationError

from btb_lab.errors import ValidationFailed
from btb_lab.hypothesis.loader import load_hypothesis
from btb_lab.model.hardware import InstanceSpec
from btb_lab.policies import build_policy
from btb_lab.policies.base import CacheAction, Decision
from btb_lab.records import Request
from tests.unit.test_sim_engine import KVB, P_TOK, Scripted, nodes, req, run

PREFIX = (1, 2, 3, 4)  # 4 blocks = 2,048 tokens
HOST_TOKEN_S = KVB / 220e9  # H100 PCIe 55 GB/s × 4 GPUs
REPO = Path(__file__).resolve().parents[2]


def small(n: int, blocks: int) -> list[InstanceSpec]:
    """`n` 4×H100 instances whose KV budget is `blocks` blocks of 512 tokens."""
    return [dataclasses.replace(s, kv_budget_bytes=blocks * 512 * KVB) for s in nodes(n)]


def ttft(rec: object) -> float:
    return rec.first_token_s - rec.sent_s  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize(("ttl_s", "cached"), [(100.0, 2048), (None, 0)])
def test_a_pinned_prefix_survives_pressure_that_evicts_an_unpinned_one(
    ttl_s: float | None, cached: int
) -> None:
    """One instance of 12 blocks, no host tier. `a` leaves the prefix in HBM; at t = 5 `d`
    (6 own blocks) pins it for 100 s, or not at all; at t = 10 `e` (6 more blocks)
    reserves 3,074 tokens, so HBM keeps 5 blocks of the 10 cached: the LRU goes first,
    the prefix unless pinned. `f` at t = 20 finds it in HBM only if the pin still held:
    its TTFT is then one block's prefill, else the whole prompt's."""
    pin = () if ttl_s is None else (CacheAction("pin", 0, PREFIX, ttl_s),)
    reqs = [
        req("a", 0.0, PREFIX),
        req("d", 5.0, tuple(range(10, 16))),
        req("e", 10.0, tuple(range(20, 26))),
        req("f", 20.0, (*PREFIX, 99)),
    ]
    recs, engine = run(
        reqs, Scripted({"d": Decision(0, cache=pin)}), small(1, 12), host_ram_tier=False
    )
    assert recs["f"].cached_tokens == cached
    assert ttft(recs["f"]) == pytest.approx((2560 - cached) * P_TOK, rel=1e-9)
    assert engine.stats.get("cache_pins", 0) == (0 if ttl_s is None else 1)
    assert engine.insts[0].cache.n_pinned() == 0  # the run drains: every hold has expired


@pytest.mark.parametrize(("ttl_s", "unpin_at_s", "start_s"),
                         [(100.0, None, 105.0), (3.0, None, 8.0), (100.0, 8.0, 8.0)])  # fmt: skip
def test_a_pin_holds_its_kv_until_its_ttl_or_an_unpin(
    ttl_s: float, unpin_at_s: float | None, start_s: float
) -> None:
    """One instance of 12 blocks (6,144 tokens), no host tier. `big` (7 blocks + 513
    output tokens = 4,097) arrives at t = 5 carrying a pin of the cached 2,048-token
    prefix: pinned + its need pass the budget by one token, so it waits until the hold
    ends, at 5 + ttl or at the unpin, then prefills its 3,584 tokens."""
    script = {"big": Decision(0, cache=(CacheAction("pin", 0, PREFIX, ttl_s),))}
    reqs = [req("a", 0.0, PREFIX), req("big", 5.0, tuple(range(10, 17)), out=513)]
    if unpin_at_s is not None:
        reqs.insert(1, req("u", unpin_at_s, (50,), out=1))
        script["u"] = Decision(0, cache=(CacheAction("unpin", 0, PREFIX),))
    reqs.sort(key=lambda r: r.arrival_s)
    recs, engine = run(reqs, Scripted(script), small(1, 12), host_ram_tier=False)
    big = recs["big"]
    assert big.ok
    assert engine.stats["cache_pins"] == 1
    assert big.first_token_s == pytest.approx(start_s + 3584 * P_TOK, rel=1e-9)


@pytest.mark.parametrize("promote", [False, True])
def test_demote_frees_hbm_and_promote_brings_the_prefix_back_for_a_bandwidth_charge(
    promote: bool,
) -> None:
    """`a` leaves the prefix on C0. At t = 5 `x` (on C1) demotes it there: 2,048 tokens
    leave HBM for host RAM, charged 2,048 × KVB / 220 GB/s on C0's host link. With the
    promote `y` asks for at t = 6, the 4 blocks come back over the link (1 ms setup + the
    same bandwidth time) and `g` at t = 7 is an HBM hit; without it `g` is a RAM-tier hit
    that loads the prefix inside its own prefill."""
    move_s = 2048 * HOST_TOKEN_S
    script = {
        "x": Decision(1, cache=(CacheAction("demote", 0, PREFIX),)),
        "y": Decision(1, cache=(CacheAction("promote", 0, PREFIX),) if promote else ()),
    }
    reqs = [req("a", 0.0, PREFIX), req("x", 5.0, (60,)), req("y", 6.0, (61,)),
            req("g", 7.0, (*PREFIX, 99))]  # fmt: skip
    recs, engine = run(reqs, Scripted(script), small(2, 64))
    g = recs["g"]
    assert engine.stats["cache_demoted_tokens"] == 2048
    assert g.cached_tokens == 2048
    if promote:
        assert engine.stats["cache_promoted_tokens"] == 2048
        assert engine.stats["cache_host_link_s"] == pytest.approx(2 * move_s + 0.001)
        assert (g.cache_tier, g.kv_load_s) == ("hbm", 0.0)
        assert ttft(g) == pytest.approx(512 * P_TOK, rel=1e-9)
    else:
        assert engine.stats["cache_host_link_s"] == pytest.approx(move_s)
        assert g.cache_tier == "ram"
        assert g.kv_load_s == pytest.approx(move_s)
        assert ttft(g) == pytest.approx(move_s + 512 * P_TOK, rel=1e-9)


def test_a_demoted_prefix_is_out_of_hbm_at_once() -> None:
    script = {"x": Decision(1, cache=(CacheAction("demote", 0, PREFIX),))}
    _, engine = run([req("a", 0.0, PREFIX), req("x", 5.0, (60,))], Scripted(script), small(2, 64))
    cache = engine.insts[0].cache
    assert (cache.n_hbm(), cache.host_lead(PREFIX), cache.lead(PREFIX)) == (0, 4, 0)


@pytest.mark.parametrize("evict", [False, True])
def test_evicting_a_decoy_prefix_frees_its_blocks_everywhere(evict: bool) -> None:
    """`a` caches the prefix on C0; `x` (on C1) evicts it there: C0's HBM and host RAM
    are empty, and a later request with the prefix recomputes it."""
    script = {"x": Decision(1, cache=(CacheAction("evict", 0, PREFIX),) if evict else ())}
    reqs = [req("a", 0.0, PREFIX), req("x", 5.0, (60,)), req("g", 7.0, (*PREFIX, 99))]
    recs, engine = run(reqs, Scripted(script), small(2, 64))
    assert recs["g"].cached_tokens == (0 if evict else 2048)
    assert engine.stats.get("cache_evicted_blocks", 0) == (4 if evict else 0)
    # the carrier ran on C1; C0 holds only what `g` brought back
    assert engine.insts[0].cache.n_hbm() == 5


# ------------------------------------------------------------------ the btb_cache policy


def burst(n: int, t0: float, first_own: int, gap_s: float = 0.5) -> list[Request]:
    return [req(f"b{i}", t0 + i * gap_s, (*PREFIX, first_own + i)) for i in range(n)]


def test_btb_cache_pins_the_burst_on_its_warm_set_and_demotes_it_when_it_expires() -> None:
    """X = 2 in Z = 1 s, Y = 4 blocks, M = 2 on two instances. b0 runs cold on C0; b1
    fires the detector, C0's prefix is copied to C1; both pin it as they hold it. After
    the burst (idle expiry 2 s), `late` at t = 10 carries the demote: the prefix leaves
    HBM on both, and `back` at t = 11 on C0 is a host-RAM hit."""
    params = {"burst_count": 2, "prefix_blocks": 4, "replicas": 2, "idle_expiry_s": 2.0}
    reqs = [*burst(6, 0.0, 100), req("late", 10.0, (70,)), req("back", 11.0, (*PREFIX, 98))]
    policy = build_policy("btb_cache", params)
    recs, engine = run(reqs, policy, small(2, 256))
    assert engine.stats["warm_copies"] == 1
    assert engine.stats["cache_pins"] == 2  # one hold per warm replica, renewed after
    assert engine.stats["cache_demoted_tokens"] == 2 * 2048
    assert {recs[f"b{i}"].route for i in range(1, 6)} == {"WARM_HIT"}
    assert recs["back"].cache_tier == "ram"
    assert recs["back"].cached_tokens == 2048


def test_btb_cache_evicts_a_decoy_that_went_quiet() -> None:
    """A prefix seen once (X = 2 never reached) is evicted decoy_evict_after_s = 2 s
    after its arrival, at the first routing after that: its second request recomputes."""
    params = {"burst_count": 2, "prefix_blocks": 4, "evict_decoys": True,
              "decoy_evict_after_s": 2.0, "pin": False, "demote_on_expiry": False,
              "promote": False}  # fmt: skip
    reqs = [req("d1", 0.0, (*PREFIX, 100)), req("bg", 3.0, (70,)), req("d2", 6.0, (*PREFIX, 101))]
    recs, engine = run(reqs, build_policy("btb_cache", params), small(2, 256))
    assert engine.stats["cache_evicted_blocks"] == 4
    assert recs["d2"].cached_tokens == 0


def test_btb_cache_promotes_from_ram_when_no_hbm_copy_exists() -> None:
    """The prefix was demoted to C0's host RAM before the burst (X = 1: its first arrival
    fires): with no complete HBM copy BTB would route cache-aware; btb_cache promotes it
    on C0 and serves the burst there."""
    params = {"burst_count": 1, "prefix_blocks": 4, "replicas": 1}
    script_demote = Decision(1, cache=(CacheAction("demote", 0, PREFIX),))

    class Then(Scripted):
        def __init__(self) -> None:
            super().__init__({"x": script_demote})
            self.btb = build_policy("btb_cache", params)

        def route(self, request, view):  # type: ignore[no-untyped-def]
            if request.request_id in ("a", "x"):
                return super().route(request, view)
            return self.btb.route(request, view)

    reqs = [req("a", 0.0, PREFIX), req("x", 5.0, (60,)), *burst(1, 10.0, 100)]
    recs, engine = run(reqs, Then(), small(2, 256))
    assert engine.stats["cache_promotes"] == 1
    assert engine.stats.get("warm_copies", 0) == 0
    assert (recs["b0"].route, recs["b0"].instance) == ("WARM_HIT", "C0")


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"pin": False, "promote": False, "demote_on_expiry": False}, "at least one"),
        ({"pin": False, "pin_ttl_s": 3.0}, "pin_ttl_s needs pin"),
        ({"decoy_evict_after_s": 3.0}, "decoy_evict_after_s needs evict_decoys"),
        ({"pin_ttl_s": 0}, "greater than 0"),
        ({"pin_tll_s": 3.0}, "Extra inputs are not permitted"),
    ],
)
def test_btb_cache_params_are_validated(params: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        build_policy("btb_cache", params)


def test_the_cluster_backend_refuses_btb_cache_naming_the_field() -> None:
    with pytest.raises(ValidationFailed) as info:
        load_hypothesis(REPO / "hypotheses" / "h16.yaml", {"backend": "cluster"})
    text = "\n".join(info.value.problems)
    assert "variants.cache_actions.router.policy" in text
    assert "vLLM has no per-prefix pin" in text
    assert "variants.btb.router.policy" not in text
