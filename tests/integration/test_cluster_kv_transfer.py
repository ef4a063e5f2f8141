"""KV transfers through the connectors against fake vLLM servers that speak vLLM's NIXL
exchange: offload protocol and records (prefill instance, prefill and transfer time,
transferred tokens and bytes), cold prefills, per-request attribution of concurrent
fetches, failures and timeouts recorded as failed requests, BTB warm copies, the
ExampleConnector's order of legs, and the backend's per-instance KV sources."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from btb_lab.backends import RunContext
from btb_lab.cluster.backend import ClusterBackend, make_client
from btb_lab.cluster.driver import LoadDriver, RunClock
from btb_lab.cluster.fake_server import FakeConfig, FakeVLLM, serve_in_thread
from btb_lab.cluster.launcher import Endpoint
from btb_lab.cluster.router import Router
from btb_lab.config.hypothesis import Hypothesis, KVConnector
from btb_lab.model.costmodel import build_cost_model
from btb_lab.policies.base import Decision, WarmAction
from btb_lab.records import Request
from tests.integration.test_cluster_flows import ListSink, Scripted, ZeroCosts, prompt, req

OFFLOAD = Decision(instance=1, route="HEAVY_OFFLOAD", prefill_instance=0)


@pytest.fixture
def nixl_fakes() -> Iterator[list[tuple[FakeVLLM, Endpoint]]]:
    apps = [
        FakeVLLM(FakeConfig(name=f"f{i}", engine_id=f"engine-{i}", kv_protocol="nixl"))
        for i in range(2)
    ]
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(app)) for app in apps]
        pairs = enumerate(zip(apps, urls, strict=True))
        yield [(app, Endpoint(i, f"C{i}", "C", url)) for i, (app, url) in pairs]


def run(
    endpoints: list[Endpoint], policy: Scripted, requests: list[Request], *,
    connector: KVConnector, transfer_timeout_s: float | None = None,
) -> tuple[ListSink, Router]:  # fmt: skip
    clock = RunClock()
    sink = ListSink(clock)

    async def main() -> Router:
        async with make_client(
            request_timeout_s=10.0, connect_timeout_s=5.0, max_connections=64
        ) as client:
            router = Router(
                endpoints, policy, ZeroCosts(), client=client, clock=clock, model="fake-model",
                prompt_fn=prompt, connector=connector, variant="v",
                transfer_timeout_s=transfer_timeout_s,
            )  # fmt: skip
            await LoadDriver(router.dispatch, sink, clock).run(requests)
            await router.drain()
            return router

    return sink, asyncio.run(main())


NIXL = KVConnector(type="nixl")


def test_nixl_offload_hands_the_producers_params_to_the_consumer(nixl_fakes: Any) -> None:
    (p_app, p_ep), (d_app, d_ep) = nixl_fakes
    sink, router = run([p_ep, d_ep], Scripted(OFFLOAD), [req(0)], connector=NIXL)
    (rec,) = sink.records
    assert rec.ok, (rec.error, rec.extra)
    assert (rec.instance, rec.prefill_instance, rec.route) == ("C1", "C0", "HEAVY_OFFLOAD")
    assert p_app.errors == [] and d_app.errors == []  # noqa: PT018 (one protocol check)
    (prefill,) = p_app.requests
    (decode,) = d_app.requests
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert prefill["max_tokens"] == 1
    assert prefill["stream"] is False
    assert "cache_salt" not in prefill
    # the decode carries the producer's answer unchanged (block ids, engine, address)
    handle = decode["kv_transfer_params"]
    assert handle["remote_engine_id"] == "engine-0"
    assert handle["remote_port"] == int(p_ep.base_url.rsplit(":", 1)[1])
    assert decode["stream"] is True
    assert decode["max_tokens"] == 3
    # what the record keeps: the consumer's own /metrics delta during its fetch
    assert rec.extra["kv_transferred_tokens"] == 64
    assert rec.extra["kv_bytes"] == 64 * 1024
    assert d_app.counters["external_prefix_cache_hits"] == 64
    assert rec.prefill_s > 0
    assert rec.kv_transfer_s >= 0
    # TTFT covers both legs: the request was sent when the prefill was
    assert rec.first_token_s - rec.sent_s >= rec.prefill_s  # type: ignore[operator]
    assert router.stats.offloads == 1
    assert router.state.complete_blocks(0, (1, 2)) == 2  # both now hold the prompt
    assert router.state.complete_blocks(1, (1, 2)) == 2


def test_nixl_consumer_pulls_only_what_it_lacks(nixl_fakes: Any) -> None:
    """A decode instance that holds part of the prompt reads the rest (as vLLM's NIXL
    pull does): the transferred tokens are the prompt minus its local hits."""
    (_, p_ep), (d_app, d_ep) = nixl_fakes
    d_app.cache.update(_block_keys(prompt(req(0))[:32]))  # the first 32 tokens are there
    sink, _ = run([p_ep, d_ep], Scripted(OFFLOAD), [req(0)], connector=NIXL)
    (rec,) = sink.records
    assert rec.ok
    assert rec.extra["kv_transferred_tokens"] == 32
    assert d_app.counters["local_cache_hit"] == 32


def _block_keys(tokens: list[int]) -> list[str]:
    from btb_lab.cluster.fake_server import _block_keys as keys

    return keys(tokens)


def test_cold_offload_salts_only_the_producer(nixl_fakes: Any) -> None:
    (p_app, p_ep), (d_app, d_ep) = nixl_fakes
    cold = Scripted(Decision(instance=1, route="PS", prefill_instance=0, prefill_cold=True))
    sink, _ = run([p_ep, d_ep], cold, [req(0)], connector=NIXL)
    assert sink.records[0].ok
    assert p_app.requests[0]["cache_salt"].startswith("cold-xfer-v-0-r0-")
    assert "cache_salt" not in d_app.requests[0]


def test_concurrent_fetches_into_one_instance_are_attributed_each(nixl_fakes: Any) -> None:
    (_, p_ep), (d_app, d_ep) = nixl_fakes
    requests = [req(i, 0.0, blocks=(10 * i + 1, 10 * i + 2)) for i in range(4)]
    sink, _ = run([p_ep, d_ep], Scripted(OFFLOAD), requests, connector=NIXL)
    assert all(r.ok for r in sink.records)
    assert [r.extra["kv_transferred_tokens"] for r in sink.records] == [64, 64, 64, 64]
    assert (
        sum(int(r.extra["kv_transferred_tokens"]) for r in sink.records)
        == (d_app.counters["external_prefix_cache_hits"])
    )
    plain = KVConnector(type="nixl", attribute_transfers=False)
    sink, _ = run([p_ep, d_ep], Scripted(OFFLOAD), [req(9, blocks=(91, 92))], connector=plain)
    assert sink.records[0].ok
    assert "kv_transferred_tokens" not in sink.records[0].extra


@pytest.mark.parametrize(
    ("fail", "error"), [("http", "KVTransfer:HTTP500"), ("stream", "KVTransfer:StreamError")]
)
def test_a_failed_fetch_is_a_recorded_failure_with_the_servers_message(
    nixl_fakes: Any, fail: str, error: str
) -> None:
    (_, p_ep), (d_app, d_ep) = nixl_fakes
    d_app.config.kv_fail = fail
    sink, router = run(
        [p_ep, d_ep], Scripted(OFFLOAD), [req(0), req(1, 0.05, blocks=(7, 8))], connector=NIXL
    )
    assert [(r.ok, r.error) for r in sink.records] == [(False, error), (False, error)]
    assert all(r.extra["error_detail"] == "KV load failed (injected)" for r in sink.records)
    assert all(r.first_token_s is None and r.finish_s is None for r in sink.records)
    assert router.stats.transfers_failed == 2


def test_a_failed_prefill_skips_the_fetch(nixl_fakes: Any) -> None:
    (p_app, p_ep), (d_app, d_ep) = nixl_fakes
    p_app.config.fail_status = 503
    sink, _ = run([p_ep, d_ep], Scripted(OFFLOAD), [req(0)], connector=NIXL)
    (rec,) = sink.records
    assert (rec.ok, rec.error) == (False, "Prefill:HTTP503")
    assert rec.extra["error_detail"] == "injected"
    assert d_app.requests == []


def test_a_producer_without_a_connector_is_named() -> None:
    plain = FakeVLLM(FakeConfig(kv_protocol="none"))
    consumer = FakeVLLM(FakeConfig(kv_protocol="nixl"))
    with serve_in_thread(plain) as p_url, serve_in_thread(consumer) as d_url:
        eps = [Endpoint(0, "C0", "C", p_url), Endpoint(1, "C1", "C", d_url)]
        sink, _ = run(eps, Scripted(OFFLOAD), [req(0)], connector=NIXL)
    (rec,) = sink.records
    assert (rec.ok, rec.error) == (False, "Prefill:NoKVTransferParams")
    assert "kv_producer" in str(rec.extra["error_detail"])


def test_a_stalled_fetch_times_out_as_a_failed_request() -> None:
    producer = FakeVLLM(FakeConfig(engine_id="engine-0", kv_protocol="nixl"))
    stalled = FakeVLLM(FakeConfig(kv_protocol="nixl", stall_s=3.0))
    with serve_in_thread(producer) as p_url, serve_in_thread(stalled) as d_url:
        eps = [Endpoint(0, "C0", "C", p_url), Endpoint(1, "C1", "C", d_url)]
        sink, router = run(eps, Scripted(OFFLOAD), [req(0)], connector=NIXL, transfer_timeout_s=0.3)
    (rec,) = sink.records
    assert (rec.ok, rec.error) == (False, "KVTransfer:ReadTimeout")
    assert rec.first_token_s is None
    assert router.stats.transfers_failed == 1


def test_btb_warm_copy_reads_the_prefix_into_the_target(nixl_fakes: Any) -> None:
    (_, a_ep), (b_app, b_ep) = nixl_fakes
    warm = WarmAction(source=0, target=1, n_blocks=1, mode="rdma")
    policy = Scripted(Decision(instance=0, route="WARM_HIT", warm=(warm,)))
    _, router = run([a_ep, b_ep], policy, [req(0)], connector=NIXL)
    assert router.stats.warms_ok == 1
    (entry,) = router.stats.warms
    assert entry["mode"] == "transfer"
    assert (entry["source"], entry["target"], entry["ok"]) == ("C0", "C1", True)
    assert entry["prefix_tokens"] == 32
    assert entry["kv_transferred_tokens"] == 32
    (pull,) = b_app.requests
    assert pull["kv_transfer_params"]["remote_engine_id"] == "engine-0"
    assert pull["max_tokens"] == 1
    assert pull["prompt"] == prompt(req(0))[:32]
    assert router.state.complete_blocks(1, (1, 2)) == 1


def test_a_request_waits_for_the_warm_copy_of_its_prefix_to_its_instance(
    nixl_fakes: Any,
) -> None:
    """BTB routes the request that fired the burst to a target it is warming at that very
    moment: the request waits until the copy has landed, then hits the copied prefix,
    instead of computing it beside the copy (the simulator parks it the same way)."""
    (a_app, a_ep), (b_app, b_ep) = nixl_fakes
    a_app.config.prefill_delay_per_token_s = 0.01  # the holder takes ~0.3 s to produce it
    warm = WarmAction(source=0, target=1, n_blocks=1, mode="rdma")
    policy = Scripted(Decision(instance=1, route="WARM_HIT", warm=(warm,)))
    sink, router = run([a_ep, b_ep], policy, [req(0)], connector=NIXL)
    (rec,) = sink.records
    (entry,) = router.stats.warms
    assert rec.ok
    assert entry["ok"]
    pull, plain = b_app.requests  # the copy first, then the request
    assert pull["kv_transfer_params"]["do_remote_prefill"] is True
    assert "kv_transfer_params" not in plain
    assert rec.sent_s >= entry["end_s"] - 1e-3
    assert rec.extra["parked_for_warm_s"] >= 0.2
    assert rec.cached_tokens == 32  # the copied block, found in the target's own cache
    assert router.stats.parked_for_warm == 1
    # a request elsewhere, or after the copy landed, does not wait
    sink, router = run([a_ep, b_ep], Scripted(Decision(instance=1)), [req(1)], connector=NIXL)
    assert "parked_for_warm_s" not in sink.records[0].extra
    assert router.stats.parked_for_warm == 0


def test_example_connector_sends_the_consumer_after_the_producer_answered() -> None:
    order: list[str] = []

    class Recording(FakeVLLM):
        async def _completion(self, body: dict[str, Any], send: Any) -> None:
            order.append(f"{self.config.name} start")
            await super()._completion(body, send)
            order.append(f"{self.config.name} end")

    apps = [Recording(FakeConfig(name=f"f{i}", kv_protocol="none")) for i in range(2)]
    with serve_in_thread(apps[0]) as u0, serve_in_thread(apps[1]) as u1:
        eps = [Endpoint(0, "C0", "C", u0), Endpoint(1, "C1", "C", u1)]
        sink, router = run(eps, Scripted(OFFLOAD), [req(0)], connector=KVConnector(type="example"))
    (rec,) = sink.records
    assert rec.ok
    assert order[:2] == ["f0 start", "f0 end"]
    assert order[2] == "f1 start"
    (prefill,) = apps[0].requests
    (decode,) = apps[1].requests
    assert "kv_transfer_params" not in prefill
    assert "kv_transfer_params" not in decode
    assert prefill["prompt"] == decode["prompt"]  # the files are keyed by the prompt
    assert (prefill["max_tokens"], decode["max_tokens"]) == (1, 3)
    assert rec.extra["kv_transferred_tokens"] == 0  # the fakes keep no files
    assert router.stats.offloads == 1


def test_backend_reports_kv_sources_per_instance(nixl_fakes: Any, tmp_path: Path) -> None:
    from tests.integration.test_cluster_flows import hypothesis_for

    urls = [ep.base_url for _, ep in nixl_fakes]
    data = hypothesis_for(urls).model_dump(by_alias=True)
    data["cluster"]["kv_connector"] = {"type": "nixl"}
    data["variants"] = {"off": {"router": {"policy": "offload_decode",
                                           "params": {"heavy_input_tokens": 64,
                                                      "medium_input_tokens": 0}}}}  # fmt: skip
    data["baseline"] = "off"
    hyp = Hypothesis.model_validate(data)
    sink = ListSink()
    ctx = RunContext(
        hypothesis=hyp, variant_name="off", variant=hyp.variants["off"], repeat=0, seed=1,
        run_dir=tmp_path, sink=sink, costs=build_cost_model(hyp),
    )  # fmt: skip
    # two sessions; the second arrives while the first decodes, so its home is busy
    requests = [
        Request("s0", 0.0, 64, 40, block_hashes=(1, 2), block_tokens=32, session_id="a"),
        Request("s1", 0.01, 64, 40, block_hashes=(3, 4), block_tokens=32, session_id="a"),
    ]
    for app, _ in nixl_fakes:
        app.config.token_delay_s = 0.01
    result = ClusterBackend().run_variant(ctx, requests)
    sources = result.extra["metrics"]["kv_sources"]
    assert set(sources) == {"C0", "C1"}
    moved = [r for r in sink.records if r.prefill_instance is not None]
    assert moved, [(r.route, r.instance) for r in sink.records]
    for name, kv in sources.items():
        into = sum(int(r.extra["kv_transferred_tokens"]) for r in moved if r.instance == name)
        assert kv["external_hit_tokens"] == into
        assert kv["kv_bytes"] == into * 1024
        assert (
            kv["prompt_tokens"]
            == kv["local_hit_tokens"] + kv["external_hit_tokens"] + (kv["computed_tokens"])
        )


@pytest.mark.parametrize("policy", ["ps_always", "ps_flexd", "ps_cost", "offload_decode"])
def test_offload_policies_move_kv_through_the_connector(policy: str) -> None:
    """The simulator's own policy objects decide; every offload they choose runs as a NIXL
    exchange (producer prefill, consumer fetch) and is recorded with its transfer."""
    from btb_lab.policies import build_policy

    apps = [FakeVLLM(FakeConfig(engine_id=f"e{i}", kv_protocol="nixl", token_delay_s=0.01))
            for i in range(3)]  # fmt: skip
    params: dict[str, Any] = {"heavy_input_tokens": 64, "medium_input_tokens": 0}
    if policy == "ps_cost":
        params["interference_s"] = 1.0  # the modeled costs are zero: offloading wins
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(app)) for app in apps]
        eps = [Endpoint(0, "C0", "C", urls[0]), Endpoint(1, "C1", "C", urls[1]),
               Endpoint(2, "PS0", "PS", urls[2])]  # fmt: skip
        # session a's second request arrives while its first still decodes on C0
        requests = [
            Request("a1", 0.0, 64, 30, block_hashes=(1, 2), block_tokens=32, session_id="a"),
            Request("a2", 0.05, 96, 4, block_hashes=(1, 2, 3), block_tokens=32, session_id="a"),
        ]
        sink, router = run(eps, build_policy(policy, params), requests, connector=NIXL)  # type: ignore[arg-type]
    assert all(r.ok for r in sink.records), [(r.error, r.extra) for r in sink.records]
    moved = [r for r in sink.records if r.prefill_instance is not None]
    assert moved, [(r.request_id, r.route, r.instance) for r in sink.records]
    for rec in moved:
        assert rec.extra["kv_transferred_tokens"] > 0
        assert rec.prefill_instance != rec.instance
    if policy == "offload_decode":
        assert {(r.prefill_instance, r.instance) for r in moved} == {("C0", "C1")}
    else:
        assert {r.prefill_instance for r in moved} == {"PS0"}
        assert all(a.requests[0].get("cache_salt", "").startswith("cold-") for a in apps[2:])
    assert router.stats.offloads == len(moved)
    consumers = {r.instance for r in moved}
    total = sum(apps[int(name[1])].counters["external_prefix_cache_hits"] for name in consumers)
    assert total == sum(int(r.extra["kv_transferred_tokens"]) for r in moved)
