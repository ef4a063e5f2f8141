"""The cluster path against fake vLLM servers: the driver's timeout and error accounting,
incremental records, the Mooncake prefill-offload and warm exchanges, the whole backend
in endpoints mode, and the `router serve` proxy."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from btb_lab.backends import RunContext
from btb_lab.cluster.backend import ClusterBackend, make_client
from btb_lab.cluster.driver import LoadDriver, RunClock
from btb_lab.cluster.fake_server import FakeConfig, FakeVLLM, serve_in_thread
from btb_lab.cluster.launcher import Endpoint
from btb_lab.cluster.router import Router
from btb_lab.config import StrictModel
from btb_lab.config.hypothesis import Hypothesis
from btb_lab.model.costmodel import build_cost_model
from btb_lab.policies.base import ClusterView, Decision, NoParams, Policy, WarmAction
from btb_lab.records import Request, RequestRecord
from btb_lab.workload.sessions import SessionGate, session_gate


class ListSink:
    """Remembers each write and what the clock said when it happened."""

    def __init__(self, clock: RunClock | None = None) -> None:
        self.records: list[RequestRecord] = []
        self.write_times: list[float] = []
        self.clock = clock

    def write(self, records: Iterable[RequestRecord]) -> None:
        self.records.extend(records)
        if self.clock is not None:
            self.write_times.append(self.clock.now())


class ZeroCosts:
    def prefill_s(self, instance: int, tokens: int, cached_tokens: int = 0) -> float:
        return 0.0

    def transfer_s(self, tokens: int, source: int, target: int) -> float:
        return 0.0


class Scripted(Policy):
    """Returns the decision the test sets, whatever the view says."""

    name: ClassVar[str] = "scripted"
    Params: ClassVar[type[StrictModel]] = NoParams

    def __init__(self, decision: Decision) -> None:
        super().__init__(NoParams())
        self.decision = decision
        self.views: list[list[tuple[int, int]]] = []
        self.finished: list[str] = []
        self.job_kinds: list[str | None] = []

    def route(self, request: Request, view: ClusterView) -> Decision:
        self.views.append([(i.running, i.outstanding_tokens) for i in view.instances])
        self.job_kinds.append(request.job_kind)
        return self.decision

    def on_finish(self, request: Request, instance: int, now_s: float) -> None:
        self.finished.append(request.request_id)


def req(
    i: int, arrival_s: float = 0.0, *, blocks: tuple[int, ...] = (1, 2), out: int = 3
) -> Request:
    return Request(
        request_id=f"r{i}", arrival_s=arrival_s, input_tokens=64, output_tokens=out,
        block_hashes=blocks, block_tokens=32,
    )  # fmt: skip


def prompt(r: Request) -> list[int]:
    # shared blocks → shared tokens, like the workload's prompt builder
    toks = [1000 + b for b in r.block_hashes for _ in range(r.block_tokens)]
    return (toks + [7] * r.input_tokens)[: r.input_tokens]


@pytest.fixture
def fakes() -> Iterator[list[tuple[FakeVLLM, Endpoint]]]:
    apps = [
        FakeVLLM(FakeConfig(name=f"f{i}", engine_id=f"engine-{i}", token_delay_s=0.002))
        for i in range(2)
    ]
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(app)) for app in apps]
        yield [
            (app, Endpoint(i, f"C{i}", "C", url, bootstrap_url=url))
            for i, (app, url) in enumerate(zip(apps, urls, strict=True))
        ]


def drive(
    endpoints: list[Endpoint], policy: Policy, requests: list[Request], *,
    connector: str = "none", timeout_s: float = 10.0, sessions: SessionGate | None = None,
    max_connections: int = 64,
) -> tuple[ListSink, Router, Any]:  # fmt: skip
    clock = RunClock()
    sink = ListSink(clock)

    async def main() -> Any:
        async with make_client(
            request_timeout_s=timeout_s, connect_timeout_s=5.0, max_connections=max_connections
        ) as client:
            router = Router(
                endpoints, policy, ZeroCosts(), client=client, clock=clock, model="fake-model",
                prompt_fn=prompt, connector=connector, variant="v",
            )  # fmt: skip
            stats = await LoadDriver(router.dispatch, sink, clock, sessions=sessions).run(requests)
            await router.drain()
            return router, stats

    router, stats = asyncio.run(main())
    return sink, router, stats


def test_plain_requests_stamp_times_and_cached_tokens(fakes: Any) -> None:
    eps = [ep for _, ep in fakes]
    policy = Scripted(Decision(instance=1, route="ONE"))
    sink, router, stats = drive(eps, policy, [req(0, 0.0), req(1, 0.05)])
    by_id = {r.request_id: r for r in sink.records}
    assert set(by_id) == {"r0", "r1"}
    assert stats.ok == 2
    for r in by_id.values():
        assert r.ok
        assert r.instance == "C1"
        assert r.route == "ONE"
        assert r.arrival_s <= r.sent_s < r.first_token_s <= r.finish_s  # type: ignore[operator]
        assert r.output_tokens == 3
        assert r.extra["chunks"] == 3
    # the second request's prompt shares the first's two blocks on the same instance
    assert by_id["r1"].cached_tokens == 64
    assert by_id["r0"].cached_tokens == 0
    assert fakes[0][0].requests == []
    body = fakes[1][0].requests[0]
    assert body["ignore_eos"] is True
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 3
    assert sorted(policy.finished) == ["r0", "r1"]
    # bookkeeping: after the run nothing is in flight; the blocks are complete on C1 only
    assert router.state.in_flight == [0, 0]
    assert router.state.outstanding_tokens == [0, 0]
    assert router.state.complete_blocks(1, (1, 2, 3)) == 2
    assert router.state.complete_blocks(0, (1, 2)) == 0


def test_router_view_counts_in_flight_requests(fakes: Any) -> None:
    eps = [ep for _, ep in fakes]
    policy = Scripted(Decision(instance=0))
    drive(eps, policy, [req(i, 0.0, out=20) for i in range(3)])
    # the three arrive together: the last one sees the first two in flight on C0
    assert policy.views[0] == [(0, 0), (0, 0)]
    assert policy.views[2] == [(2, 2 * (64 + 20)), (0, 0)]


def test_stalled_server_is_a_recorded_read_timeout(tmp_path: Path) -> None:
    app = FakeVLLM(FakeConfig(stall_s=3.0))
    with serve_in_thread(app) as url:
        ep = Endpoint(0, "C0", "C", url)
        sink, _, stats = drive([ep], Scripted(Decision(0)), [req(0)], timeout_s=0.3)
    (rec,) = sink.records
    assert not rec.ok
    assert rec.error == "ReadTimeout"
    assert rec.first_token_s is None
    assert rec.finish_s is None
    assert stats.failed == 1
    assert stats.errors == {"ReadTimeout": 1}


def test_a_wait_for_a_pooled_connection_is_send_lag_not_ttft() -> None:
    """With one connection three requests due together go out one after another: each is
    stamped sent when its headers go out, so TTFT is the server's and the wait shows as
    send lag (stamped before the wait, the third's TTFT held the first two's service)."""
    app = FakeVLLM(FakeConfig(stall_s=0.3))
    with serve_in_thread(app) as url:
        ep = Endpoint(0, "C0", "C", url)
        sink, _, stats = drive([ep], Scripted(Decision(0)), [req(i) for i in range(3)],
                               max_connections=1)  # fmt: skip
    recs = sorted(sink.records, key=lambda r: r.sent_s)
    assert [r.ok for r in recs] == [True] * 3
    for before, after in itertools.pairwise(recs):
        assert before.finish_s is not None
        assert after.sent_s >= before.finish_s  # on the wire only once the connection freed
    for r in recs:
        assert r.first_token_s is not None
        assert r.first_token_s - r.sent_s >= 0.3
    assert stats.lag_max_ms >= 600


def test_http_errors_and_refused_connections_are_recorded() -> None:
    from btb_lab.cluster.launcher import free_port

    app = FakeVLLM(FakeConfig(fail_status=500))
    with serve_in_thread(app) as url:
        eps = [
            Endpoint(0, "C0", "C", url),
            Endpoint(1, "C1", "C", f"http://127.0.0.1:{free_port()}"),
        ]
        sink, _, _ = drive(eps, Scripted(Decision(0)), [req(0)])
        sink2, _, _ = drive(eps, Scripted(Decision(1)), [req(1)])
    assert [(r.ok, r.error) for r in sink.records] == [(False, "HTTP500")]
    assert [(r.ok, r.error) for r in sink2.records] == [(False, "ConnectError")]


def test_records_are_written_as_each_request_finishes(fakes: Any) -> None:
    eps = [ep for _, ep in fakes]
    requests = [req(0, 0.0), req(1, 0.6)]
    sink, _, _ = drive(eps, Scripted(Decision(0)), requests)
    first_write, last_sent = sink.write_times[0], max(r.sent_s for r in sink.records)
    # the first record reached the sink before the second request was even sent
    assert first_write < last_sent
    assert len(sink.write_times) == 2


def test_mooncake_offload_follows_the_connector_protocol(fakes: Any) -> None:
    (p_app, p_ep), (d_app, d_ep) = fakes
    policy = Scripted(Decision(instance=1, route="HEAVY_OFFLOAD", prefill_instance=0))
    sink, router, _ = drive([p_ep, d_ep], policy, [req(0)], connector="mooncake")
    (rec,) = sink.records
    assert rec.ok, rec.error
    assert (rec.instance, rec.prefill_instance, rec.route) == ("C1", "C0", "HEAVY_OFFLOAD")
    assert rec.prefill_s > 0
    assert rec.kv_transfer_s >= 0
    assert p_app.errors == []
    assert d_app.errors == []
    (prefill,) = p_app.requests
    (decode,) = d_app.requests
    tid = prefill["kv_transfer_params"]["transfer_id"]
    assert prefill["max_tokens"] == 1
    assert prefill["stream"] is False
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert decode["kv_transfer_params"] == {
        "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": tid,
        "remote_bootstrap_addr": p_ep.bootstrap_url, "remote_engine_id": "engine-0",
    }  # fmt: skip
    assert p_app.transfers[tid].pulled
    assert d_app.counters["external_prefix_cache_hits"] == 64
    assert router.stats.offloads == 1
    # the router's event log: the KV moved C0 → C1 between the prefill's end and the
    # decode's first token
    (event,) = router.events.records()
    assert (event.kind, event.instance, event.peer, event.origin) == (
        "kv_transfer",
        "C1",
        "C0",
        "router",
    )
    assert event.request_id == rec.request_id
    assert event.end_s == rec.first_token_s
    assert event.time_s == pytest.approx(rec.first_token_s - rec.kv_transfer_s)


def test_cold_prefill_offload_salts_the_prefix_cache(fakes: Any) -> None:
    (p_app, p_ep), (_, d_ep) = fakes
    warm = Scripted(Decision(instance=0))
    drive([p_ep, d_ep], warm, [req(0)])  # the prompt is now cached on C0
    cold = Scripted(Decision(instance=1, route="PS", prefill_instance=0, prefill_cold=True))
    sink, _, _ = drive([p_ep, d_ep], cold, [req(1)], connector="mooncake")
    assert sink.records[0].ok
    prefill = p_app.requests[-1]
    assert prefill["cache_salt"].startswith("cold-")
    # C0 had the prefix, but the salted prefill could not use it
    assert p_app.counters["prefix_cache_hits"] == 0


def test_fake_rejects_a_decode_with_the_wrong_engine(fakes: Any) -> None:
    """The fake really checks the exchange: a wrong engine id fails the request."""
    (p_app, p_ep), (d_app, d_ep) = fakes
    p_app.config.engine_id = "engine-0"

    async def main() -> Any:
        async with httpx.AsyncClient(trust_env=False) as c:
            body = {
                "prompt": [1, 2, 3], "max_tokens": 2, "stream": False,
                "kv_transfer_params": {
                    "do_remote_prefill": True, "transfer_id": "t1",
                    "remote_bootstrap_addr": p_ep.bootstrap_url, "remote_engine_id": "engine-9",
                },
            }  # fmt: skip
            return await c.post(d_ep.base_url + "/v1/completions", json=body, timeout=30)

    p_app.config.kv_wait_s = 0.2
    resp = asyncio.run(main())
    assert resp.status_code == 400
    assert d_app.errors
    assert "KV pull" in d_app.errors[0]


def test_warm_actions_with_and_without_connector(fakes: Any) -> None:
    (_a_app, a_ep), (b_app, b_ep) = fakes
    warm = WarmAction(source=0, target=1, n_blocks=1, mode="rdma")
    policy = Scripted(Decision(instance=0, route="BTB", warm=(warm,)))
    _, router, _ = drive([a_ep, b_ep], policy, [req(0)], connector="mooncake")
    assert router.stats.warms_ok == 1
    (pull,) = b_app.requests
    assert pull["kv_transfer_params"]["do_remote_prefill"] is True
    assert len(pull["prompt"]) == 32
    assert pull["max_tokens"] == 1
    assert router.state.complete_blocks(1, (1, 2)) == 1
    (copy,) = router.events.records()
    assert (copy.kind, copy.instance, copy.peer, copy.label) == ("warm_copy", "C1", "C0", "rdma")
    assert copy.end_s is not None
    assert copy.end_s >= copy.time_s
    assert copy.value == 32

    b_app.requests.clear()
    __, router, _ = drive([a_ep, b_ep], policy, [req(1)], connector="none")
    (copy,) = router.events.records()
    assert (copy.label, copy.peer) == ("prefill", "")  # no connector: recomputed there
    (spec,) = b_app.requests
    assert "kv_transfer_params" not in spec
    assert spec["max_tokens"] == 1
    assert spec["prompt"] == prompt(req(1))[:32]
    assert router.stats.warms_ok == 1


def hypothesis_for(urls: list[str]) -> Hypothesis:
    return Hypothesis.model_validate(
        {
            "id": "fake", "title": "t", "claim": "c", "backend": "cluster",
            "model": {"name": "tiny", "params": 1e6, "layers": 2, "kv_heads": 2, "head_dim": 64},
            "cluster": {
                "instances": [{"role": "C", "count": 2}],
                "launch": {"endpoints": urls, "served_model": "fake-model", "vocab_size": 5000,
                           "telemetry_interval_s": 0.05},
            },
            "workload": {"generator": {"kind": "poisson"}},
            "variants": {"ll": {"router": {"policy": "least_load"}}},
            "baseline": "ll",
            "verdict": {"metric": "ttft_p50"},
        }
    )  # fmt: skip


def test_an_attached_runs_topology_is_said_to_be_declared_only() -> None:
    """The report showed "2×C (1×H100)" for servers someone else started."""
    from btb_lab.report.describe import topology

    hyp = hypothesis_for(["http://127.0.0.1:8001", "http://127.0.0.1:8002"])
    attached = topology(hyp, "cluster")
    assert attached.startswith("2×C (1×H100); attached to 2 endpoints")
    assert "devices and connector not checked" in attached
    assert topology(hyp, "sim") == "2×C (1×H100)"  # the simulator runs what is declared


def test_backend_attached_run_end_to_end(fakes: Any, tmp_path: Path) -> None:
    hyp = hypothesis_for([ep.base_url for _, ep in fakes])
    sink = ListSink()
    ctx = RunContext(
        hypothesis=hyp, variant_name="ll", variant=hyp.variants["ll"], repeat=0, seed=1,
        run_dir=tmp_path, sink=sink, costs=build_cost_model(hyp),
    )  # fmt: skip
    requests = [req(i, 0.02 * i, blocks=(5, 6)) for i in range(8)]
    result = ClusterBackend().run_variant(ctx, requests)
    assert len(sink.records) == 8
    assert all(r.ok for r in sink.records)
    assert {r.instance for r in sink.records} <= {"C0", "C1"}
    assert result.fidelity["launch_mode"] == "attached"
    assert result.fidelity["backend"] == "cluster"
    # servers someone else started: no device or restart is claimed for them
    assert result.fidelity["device"] == "unknown (attached endpoints)"
    assert result.fidelity["fresh_restart"] is None
    assert result.telemetry_source == "none"  # attached and no NVML: nothing to sample
    delta = result.extra["metrics"]["delta"]
    assert sum(d["prefix_cache_queries"] for d in delta.values()) == 8 * 64
    rates = result.extra["metrics"]["cache_hit_rate"]
    assert set(rates) == {"C0", "C1"}
    assert result.extra["driver"]["finished"] == 8
    # prompts are the workload's token ids below the configured vocabulary
    ids = [t for app, _ in fakes for body in app.requests for t in body["prompt"]]
    assert ids
    assert max(ids) < 5000
    assert result.events == []  # no warming, no offload, no periodic scrape


def test_periodic_metrics_become_queue_and_batch_events(fakes: Any, tmp_path: Path) -> None:
    hyp = hypothesis_for([ep.base_url for _, ep in fakes])
    hyp.cluster.launch.metrics_interval_s = 0.05
    ctx = RunContext(
        hypothesis=hyp, variant_name="ll", variant=hyp.variants["ll"], repeat=0, seed=1,
        run_dir=tmp_path, sink=ListSink(), costs=build_cost_model(hyp),
    )  # fmt: skip
    requests = [req(i, 0.05 * i, blocks=(5, 6)) for i in range(8)]
    result = ClusterBackend().run_variant(ctx, requests)
    scrapes = result.extra["metrics"]["periodic"]
    assert scrapes
    gauges = [e for e in result.events if e.origin == "vllm_metrics"]
    assert {e.kind for e in gauges} == {"waiting", "running"}
    assert {e.instance for e in gauges} == {"C0", "C1"}
    # each scrape's gauge holds until the next scrape
    c0 = sorted((e for e in gauges if e.instance == "C0" and e.kind == "running"),
                key=lambda e: e.time_s)  # fmt: skip
    assert [e.time_s for e in c0] == [t for t, _ in scrapes]
    assert all(a.end_s == b.time_s for a, b in itertools.pairwise(c0))


def test_proxy_routes_and_streams(fakes: Any) -> None:
    from btb_lab.cluster.proxy import build_proxy_app, make_router, prompt_block_hashes

    eps = [ep for _, ep in fakes]
    policy = Scripted(Decision(instance=1, route="PX"))
    router = make_router(
        eps, policy, ZeroCosts(),
        client=make_client(request_timeout_s=10, connect_timeout_s=5, max_connections=8),
        model="fake-model",
    )  # fmt: skip
    app = build_proxy_app(router, block_tokens=16)
    with serve_in_thread(app) as url:
        body = {"model": "fake-model", "prompt": list(range(40)), "max_tokens": 3, "stream": True,
                "metadata": {"job_kind": "labeling"}}  # fmt: skip
        with httpx.Client(trust_env=False) as c:
            with c.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
                text = "".join(resp.iter_text())
                assert resp.headers["x-btb-instance"] == "C1"
            state = c.get(url + "/router/state").json()
    assert text.count("data: ") == 4
    assert text.rstrip().endswith("data: [DONE]")
    assert fakes[1][0].requests[0]["prompt"] == list(range(40))
    assert policy.job_kinds == ["labeling"]  # the router reads the job kind ...
    assert "metadata" not in fakes[1][0].requests[0]  # ... and the engine never sees it
    assert state["instances"][1]["in_flight"] == 0
    assert policy.finished == ["proxy-0"]
    assert router.state.complete_blocks(1, prompt_block_hashes(list(range(40)), 16)) == 2


@pytest.mark.parametrize("replay", ["open", "closed", "closed_think"])
def test_a_closed_session_sends_its_next_turn_at_the_answer(fakes: Any, replay: str) -> None:
    """Turn 1 streams 50 tokens (~100 ms); turn 2 of the same session arrives 5 ms in.
    Open: sent at its arrival, while turn 1 still streams. Closed: held until turn 1's
    last token, then sent (its record keeps the trace's arrival); closed_think: 5 ms (the
    trace's gap) after that."""
    eps = [ep for _, ep in fakes]
    first = Request("t1", 0.0, 64, 50, (1, 2), 32, session_id="s", turn=1)
    second = Request("t2", 0.005, 64, 3, (1, 2), 32, session_id="s", turn=2)
    other = Request("u1", 0.006, 64, 3, (5, 6), 32, session_id="u", turn=1)
    gate = session_gate(replay)
    sink, _, stats = drive(eps, Scripted(Decision(instance=0)), [first, second, other],
                           sessions=gate)  # fmt: skip
    by_id = {r.request_id: r for r in sink.records}
    assert stats.ok == 3
    t1, t2, u1 = by_id["t1"], by_id["t2"], by_id["u1"]
    assert t2.arrival_s == pytest.approx(0.005)
    assert u1.sent_s < t1.finish_s  # another session never waits
    if replay == "open":
        assert t2.sent_s < t1.finish_s  # type: ignore[operator]
        assert stats.held == 0
    else:
        think_s = 0.005 if replay == "closed_think" else 0.0
        assert t2.sent_s >= t1.finish_s + think_s  # type: ignore[operator]
        assert stats.held == 1
        assert stats.as_dict()["held"] == 1
