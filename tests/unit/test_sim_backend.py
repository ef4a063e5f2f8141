"""The "sim" backend and `simulate`: overrides, real policies, sink batches, fidelity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from btb_lab.backends import RunContext
from btb_lab.config.hypothesis import Hypothesis
from btb_lab.errors import UserError
from btb_lab.model.costmodel import build_cost_model
from btb_lab.records import RequestRecord
from btb_lab.runner import get_backend
from btb_lab.sim.backend import simulate
from btb_lab.sim.bench import bench_workload


def hypo(variants: dict[str, Any], **extra: Any) -> Hypothesis:
    data = {
        "id": "T",
        "title": "t",
        "claim": "c",
        "cluster": {"instances": [{"role": "C", "count": 3, "gpu": "H100", "gpus": 4}]},
        "workload": {"generator": {"kind": "poisson"}},
        "variants": variants,
        "baseline": next(iter(variants)),
        "verdict": {"metric": "ttft_p90"},
        **extra,
    }
    return Hypothesis.model_validate(data)


@pytest.mark.parametrize("policy", ["round_robin", "least_load", "cache_aware", "btb"])
def test_real_policies_run_every_request_once(policy: str) -> None:
    reqs = bench_workload(400, seed=3)
    records, util, fidelity = simulate(
        hypo({"v": {"router": {"policy": policy}}}), "v", reqs, seed=1
    )
    assert sorted(r.request_id for r in records) == sorted(r.request_id for r in reqs)
    assert {r.instance for r in records} <= {"C0", "C1", "C2"}
    assert all(r.ok and r.variant == "v" for r in records)
    assert fidelity["policy"] == policy
    assert fidelity["sim.kv_visibility"] == "after_prefill"
    assert fidelity["sim.shared_prefix_attention"] is False
    assert [t["name"] for t in fidelity["topology"]] == ["C0", "C1", "C2"]
    assert {u.instance for u in util} == {"C0", "C1", "C2"}


def test_round_robin_spreads_evenly() -> None:
    reqs = bench_workload(300, seed=3)
    records, _, _ = simulate(hypo({"v": {"router": {"policy": "round_robin"}}}), "v", reqs)
    counts = {name: sum(r.instance == name for r in records) for name in ("C0", "C1", "C2")}
    assert counts == {"C0": 100, "C1": 100, "C2": 100}


def test_variant_sim_and_cluster_overrides_apply() -> None:
    h = hypo(
        {
            "base": {"router": {"policy": "least_load"}},
            "slow": {
                "router": {"policy": "least_load"},
                "sim": {"connector_decode_slowdown": 0.5, "kv_visibility": "at_admission"},
                "cluster": {"kv_connector": {"type": "mooncake"}},
            },
        }
    )
    reqs = bench_workload(200, seed=5)
    base, _, fb = simulate(h, "base", reqs)
    slow, _, fs = simulate(h, "slow", reqs)
    assert (fb["kv_connector"], fs["kv_connector"]) == ("none", "mooncake")
    assert fs["sim.kv_visibility"] == "at_admission"
    cascade = hypo({"v": {"router": {"policy": "btb"}, "sim": {"shared_prefix_attention": True}}})
    _, _, fc = simulate(cascade, "v", reqs)
    assert fc["sim.shared_prefix_attention"] is True
    no_pins = {"shared_prefix_attention": True, "kv_prefix_sharing": False}
    with pytest.raises(UserError, match=r"needs sim\.kv_prefix_sharing"):
        simulate(hypo({"v": {"router": {"policy": "btb"}, "sim": no_pins}}), "v", reqs)
    assert sum(r.decode_s for r in slow) > 1.3 * sum(r.decode_s for r in base)
    bad = hypo({"v": {"router": {"policy": "least_load"}, "sim": {"kv_visibilty": "x"}}})
    with pytest.raises(UserError, match="sim overrides"):
        simulate(bad, "v", reqs)


class ListSink:
    def __init__(self) -> None:
        self.batches: list[list[RequestRecord]] = []

    def write(self, records: Any) -> None:
        self.batches.append(list(records))


def test_backend_streams_records_and_reports_fidelity(tmp_path: Path) -> None:
    h = hypo({"v": {"router": {"policy": "cache_aware"}}})
    sink = ListSink()
    progress: list[tuple[int, int]] = []
    ctx = RunContext(
        hypothesis=h,
        variant_name="v",
        variant=h.variants["v"],
        repeat=2,
        seed=0,
        run_dir=tmp_path,
        sink=sink,
        costs=build_cost_model(h),
        progress=lambda done, total: progress.append((done, total)),
    )
    reqs = bench_workload(5000, seed=9)
    backend = get_backend("sim")
    result = backend.run_variant(ctx, reqs)
    rows = [r for batch in sink.batches for r in batch]
    assert len(rows) == 5000
    assert len(sink.batches) == 2
    assert all(r.repeat == 2 for r in rows)
    assert progress[0] == (0, 5000)
    assert progress[-1] == (5000, 5000)
    assert len(progress) < 10  # now and then, not per event
    assert result.telemetry_source == "sim"
    assert result.fidelity["sim.router_view"] == "routed"
    assert result.fidelity["model"] == "llama-3.3-70b"
    assert result.utilization
    assert all(0 <= u.utilization <= 1 for u in result.utilization)


def test_shipped_btb_hypothesis_depends_on_kv_visibility() -> None:
    from btb_lab.hypothesis.loader import load_hypothesis
    from btb_lab.workload.loader import load_requests

    path = Path(__file__).resolve().parents[2] / "hypotheses" / "btb.yaml"
    h = load_hypothesis(path).hypothesis
    reqs = load_requests(h.workload, base_dir=path.parent, seed=h.seed)
    ttfts = {}
    for vis in ("after_prefill", "at_admission"):
        hv = h.model_copy(update={"sim": h.sim.model_copy(update={"kv_visibility": vis})})
        records, _, fidelity = simulate(hv, "btb", reqs)
        assert fidelity["sim.kv_visibility"] == vis
        ttfts[vis] = sorted(r.first_token_s - r.arrival_s for r in records)  # type: ignore[operator]
    assert ttfts["after_prefill"] != ttfts["at_admission"]


def test_kv_prefix_sharing_is_recorded_and_shortens_a_shared_prefix_burst() -> None:
    from btb_lab.records import Request

    h = hypo(
        {
            "share": {"router": {"policy": "cache_aware"}},
            "whole": {"router": {"policy": "cache_aware"}, "sim": {"kv_prefix_sharing": False}},
        }
    )
    prefix = tuple(range(400))  # 204,800 tokens: under half of one instance's KV budget
    reqs = [
        Request(f"r{i}", 0.01 * i, 401 * 512, 64, (*prefix, 10_000 + i), 512) for i in range(30)
    ]
    out = {}
    for name in ("share", "whole"):
        records, util, fidelity = simulate(h, name, reqs)
        assert all(r.ok for r in records)
        ttft_max = max(r.first_token_s - r.arrival_s for r in records)  # type: ignore[operator]
        out[name] = (ttft_max, fidelity, max(u.memory_bytes for u in util))
    (t_share, f_share, m_share), (t_whole, f_whole, m_whole) = out["share"], out["whole"]
    assert (f_share["sim.kv_prefix_sharing"], f_whole["sim.kv_prefix_sharing"]) == (True, False)
    assert "pinned (ref-counted)" in f_share["kv_reservation"]
    assert f_whole["kv_reservation"] == "input+output tokens per admitted request (no preemption)"
    # whole-prompt reservations fit two of these per instance, so the last waits for
    # earlier ones to finish; shared, each prefills its own block right after the first
    assert t_share < 0.5 * t_whole
    assert m_share < m_whole  # the prefix is held once, not once per running request


@pytest.mark.parametrize("connector", ["none", "nixl"])
def test_offloads_without_a_connector_run_where_they_decode_and_the_report_says_so(
    tmp_path: Path, connector: str
) -> None:
    """As on a real cluster (README, "Real clusters"), only a connector moves KV: under
    `none` the prefill pool's offloads prefill on their decode instance."""
    import pandas as pd

    from tests.helpers import cli, write_small

    path = write_small(tmp_path, **{
        "    - {role: C, count: 2, gpu: H100, gpus: 4}": (
            "    - {role: C, count: 2, gpu: H100, gpus: 4}\n"
            "    - {role: PS, count: 1, gpu: H100, gpus: 4}\n"
            f"  kv_connector: {{type: {connector}}}"),
        "policy: round_robin": "policy: pd_split",
    })  # fmt: skip
    result = cli("run", path, "--out", tmp_path / "run", "--no-progress")
    assert result.code == 0, result.output
    records = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    offloaded = records[(records["variant"] == "fast") & records["prefill_instance"].notna()]
    report = (tmp_path / "run" / "report.md").read_text(encoding="utf-8")
    if connector == "none":
        assert offloaded.empty
        assert "**Without a KV connector**" in report
        assert "- fast r1: 60 prefill offloads ran on their decode instance" in report
    else:
        assert (offloaded["prefill_instance"] == "PS0").all()
        assert len(offloaded) > 0
        assert "Without a KV connector" not in report
