"""The engine's events, by hand: queue and batch changes, warm copies (RDMA and
recompute) and offloaded KV transfers, each at the simulated time it happened."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import pytest

from btb_lab.config.sim import SimSettings
from btb_lab.events import EventLog
from btb_lab.policies.base import Decision, Policy, WarmAction
from btb_lab.records import EventRecord, Request, RequestRecord
from btb_lab.sim.backend import run_engine
from btb_lab.sim.bench import BenchCacheAware, bench_instances, bench_workload
from tests.unit.test_sim_engine import KVB, P_TOK, Scripted, nodes, req, roofline


class Recorder(EventLog):
    """Keeps every counter change as it is reported, in order."""

    def __init__(self) -> None:
        super().__init__("engine")
        self.calls: list[tuple[str, str, float, int]] = []

    def change(self, instance: str, kind: str, time_s: float, delta: int) -> None:
        self.calls.append((instance, kind, time_s, delta))
        super().change(instance, kind, time_s, delta)

    def counter(
        self, instance: str, kind: str
    ) -> tuple[Callable[[float], None], Callable[[float], None]]:
        rise, fall = super().counter(instance, kind)

        def up(time_s: float) -> None:
            self.calls.append((instance, kind, time_s, 1))
            rise(time_s)

        def down(time_s: float) -> None:
            self.calls.append((instance, kind, time_s, -1))
            fall(time_s)

        return up, down


def run(
    reqs: list[Request], policy: Policy, n_instances: int = 2, **settings: object
) -> tuple[dict[str, RequestRecord], Recorder, list[EventRecord]]:
    log = Recorder()
    recs: list[RequestRecord] = []
    sim = SimSettings(**settings)
    run_engine(roofline(nodes(n_instances)), sim, policy, reqs, recs.append, audit=True, events=log)
    return {r.request_id: r for r in recs}, log, log.events


def test_queue_and_batch_change_at_admission_and_finish() -> None:
    """max_batch 1: b arrives while a prefills, waits until a finishes, then runs."""
    a = Request("a", 0.0, 1024, 3, (1, 2), 512)
    b = Request("b", 0.01, 512, 2, (3,), 512)
    recs, log, _ = run([a, b], Scripted({}), n_instances=1, max_batch=1)
    fa, fb = recs["a"].finish_s, recs["b"].finish_s
    assert fa is not None
    assert fb is not None
    assert recs["b"].queue_s == pytest.approx(fa - 0.01)
    assert log.calls == [
        ("C0", "waiting", 0.0, 1),
        ("C0", "waiting", 0.0, -1),
        ("C0", "running", 0.0, 1),
        ("C0", "waiting", 0.01, 1),
        ("C0", "running", fa, -1),
        ("C0", "waiting", fa, -1),
        ("C0", "running", fa, 1),
        ("C0", "running", fb, -1),
    ]


def test_rdma_warm_copy_starts_when_it_moves_and_ends_when_it_lands() -> None:
    shared = (1, 2, 3, 4)
    warm = WarmAction(source=0, target=1, n_blocks=4)
    script = {"r2": Decision(1, route="WARM_HIT", warm=(warm,))}
    reqs = [req("r1", 0.0, (*shared, 100)), req("r2", 0.01, (*shared, 200))]
    copy_s = 0.001 + 2048 * KVB / 200e9
    for visibility, start_s in (("at_admission", 0.01), ("after_prefill", 2560 * P_TOK)):
        _, _, events = run(reqs, Scripted(script), kv_visibility=visibility)
        (copy,) = [e for e in events if e.kind == "warm_copy"]
        assert (copy.instance, copy.peer, copy.label, copy.request_id) == ("C1", "C0", "rdma", "r2")
        assert copy.value == 2048
        assert copy.time_s == pytest.approx(start_s)  # after its source, under after_prefill
        assert copy.end_s == pytest.approx(start_s + copy_s)


def test_warm_recompute_is_a_warm_copy_with_no_source() -> None:
    warm = WarmAction(source=None, target=1, n_blocks=4, mode="prefill")
    script = {"r1": Decision(0, warm=(warm,))}
    _, log, events = run([req("r1", 0.5, (1, 2, 3, 4, 5))], Scripted(script))
    (copy,) = [e for e in events if e.kind == "warm_copy"]
    assert (copy.instance, copy.peer, copy.label, copy.request_id) == ("C1", "", "prefill", "r1")
    assert (copy.time_s, copy.value) == (0.5, 2048)
    assert copy.end_s == pytest.approx(0.5 + 2048 * P_TOK)
    # a warm job waits in C1's queue but joins no batch
    assert [c for c in log.calls if c[0] == "C1"] == [
        ("C1", "waiting", 0.5, 1),
        ("C1", "waiting", 0.5, -1),
    ]


def test_offload_records_its_kv_transfer_and_both_batches() -> None:
    script = {"a": Decision(1, route="HEAVY_OFFLOAD", prefill_instance=0)}
    r = Request("a", 0.0, 2048, 3, (1, 2, 3, 4), 512)
    transfer_s = 0.001 + 2048 * KVB / 200e9
    recs, log, events = run([r], Scripted(script))
    (kv,) = [e for e in events if e.kind == "kv_transfer"]
    assert (kv.instance, kv.peer, kv.request_id, kv.value) == ("C1", "C0", "a", 2048)
    assert kv.time_s == pytest.approx(2048 * P_TOK)
    assert kv.end_s == pytest.approx(2048 * P_TOK + transfer_s)
    running = [(c[0], c[2], c[3]) for c in log.calls if c[1] == "running"]
    first = recs["a"].first_token_s
    assert running == [("C0", 0.0, 1), ("C0", kv.time_s, -1), ("C1", first, 1),
                       ("C1", recs["a"].finish_s, -1)]  # fmt: skip


def test_events_change_no_record_and_every_counter_returns_to_zero() -> None:
    reqs = bench_workload(2000, seed=3)
    settings = SimSettings(kv_visibility="at_admission")
    plain: list[RequestRecord] = []
    logged: list[RequestRecord] = []
    log = Recorder()
    costs = roofline(bench_instances())
    run_engine(costs, settings, BenchCacheAware(Policy.Params()), reqs, plain.append)
    run_engine(costs, settings, BenchCacheAware(Policy.Params()), reqs, logged.append, events=log)
    assert [asdict(x) for x in plain] == [asdict(x) for x in logged]
    totals: dict[tuple[str, str], int] = {}
    for inst, kind, _, delta in log.calls:
        totals[inst, kind] = totals.get((inst, kind), 0) + delta
    assert len(totals) == 8
    assert set(totals.values()) == {0}
    # one admission and one finish per request, each counted once
    assert sum(1 for c in log.calls if c[1] == "running" and c[3] == 1) == len(reqs)
