"""Backend instance lifecycle with stand-in servers: fresh restart per variant, reuse
across variants with `fresh_restart: false`, `close()`, and teardown when a run fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from btb_lab.backends import RunContext
from btb_lab.cluster import backend as backend_mod
from btb_lab.cluster.backend import ClusterBackend
from btb_lab.config.hypothesis import Hypothesis
from btb_lab.model.costmodel import build_cost_model
from btb_lab.records import Request
from tests.integration.test_cluster_flows import ListSink
from tests.unit.test_cluster_launcher import alive, dummy_spec, tree_pids


def hypothesis(fresh_restart: bool) -> Hypothesis:
    return Hypothesis.model_validate(
        {
            "id": "life", "title": "t", "claim": "c", "backend": "cluster",
            "model": {"name": "tiny", "params": 1e6, "layers": 2, "kv_heads": 2, "head_dim": 64},
            "cluster": {
                "instances": [{"role": "C", "count": 1}],
                "launch": {"served_model": "stand-in", "device": "cpu", "vocab_size": 5000,
                           "fresh_restart": fresh_restart, "request_timeout_s": 5},
            },
            "workload": {"generator": {"kind": "poisson"}},
            "variants": {"a": {"router": {"policy": "least_load"}},
                         "b": {"router": {"policy": "round_robin"}}},
            "baseline": "a", "verdict": {"metric": "ttft_p50"},
        }
    )  # fmt: skip


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[int]:
    """Every launch starts a stand-in server (GET answers 200, POST 501) instead of vLLM."""
    launches: list[int] = []

    def plan(cluster: Any, *, model: str, block_tokens: int | None = None) -> list[Any]:
        name = f"C0-{len(launches)}"
        launches.append(len(launches))
        spec = dummy_spec(tmp_path, name)
        return [type(spec)(0, "C0", "C", spec.host, spec.port, (), spec.command, {})]

    monkeypatch.setattr(backend_mod, "plan_instances", plan)
    return launches


def run(backend: ClusterBackend, hyp: Hypothesis, variant: str, tmp_path: Path) -> Any:
    sink = ListSink()
    ctx = RunContext(
        hypothesis=hyp, variant_name=variant, variant=hyp.variants[variant], repeat=0, seed=0,
        run_dir=tmp_path, sink=sink, costs=build_cost_model(hyp),
    )  # fmt: skip
    reqs = [Request("r0", 0.0, 40, 2, block_hashes=(1,), block_tokens=16)]
    return backend.run_variant(ctx, reqs), sink


def test_reuse_across_variants_then_close(stand_in: list[int], tmp_path: Path) -> None:
    hyp = hypothesis(fresh_restart=False)
    backend = ClusterBackend()
    first, sink = run(backend, hyp, "a", tmp_path)
    second, _ = run(backend, hyp, "b", tmp_path)
    assert first.fidelity["launch_mode"] == "launched"
    assert second.fidelity["launch_mode"] == "reused"
    assert first.fidelity["instances"][0]["pid"] == second.fidelity["instances"][0]["pid"]
    assert len(stand_in) == 1
    # the stand-in refuses completions: a recorded failure, not a crash
    assert [(r.ok, r.error) for r in sink.records] == [(False, "HTTP501")]
    assert first.telemetry_source == "psutil"
    assert {s.instance for s in first.utilization} == {"C0"}
    pids = tree_pids(tmp_path, "C0-0")
    assert all(alive(p) for p in pids)
    backend.close()
    assert not any(alive(p) for p in pids)


def test_fresh_restart_stops_instances_after_each_variant(
    stand_in: list[int], tmp_path: Path
) -> None:
    hyp = hypothesis(fresh_restart=True)
    backend = ClusterBackend()
    run(backend, hyp, "a", tmp_path)
    first = tree_pids(tmp_path, "C0-0")
    assert not any(alive(p) for p in first)
    result, _ = run(backend, hyp, "b", tmp_path)
    assert result.fidelity["launch_mode"] == "launched"
    assert len(stand_in) == 2
    assert not any(alive(p) for p in tree_pids(tmp_path, "C0-1"))


def test_failure_during_a_run_stops_reused_instances(
    stand_in: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hyp = hypothesis(fresh_restart=False)
    backend = ClusterBackend()
    run(backend, hyp, "a", tmp_path)
    pids = tree_pids(tmp_path, "C0-0")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("policy exploded")

    monkeypatch.setattr("btb_lab.policies.build_policy", broken)
    with pytest.raises(RuntimeError, match="policy exploded"):
        run(backend, hyp, "b", tmp_path)
    assert not any(alive(p) for p in pids)
