"""KV connectors at launch: each connector's --kv-transfer-config per instance role, its
environment and side-channel ports, the engine block size, the ExampleConnector's shared
folder (made before the instances, removed with them), the process group and session of
each instance; and the NIXL CPU corrections that run inside vLLM (progress-thread delay,
thread affinity)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from btb_lab.cluster.connectors import CONNECTORS, build_connector, free_ports
from btb_lab.cluster.launcher import Launcher, plan_instances
from btb_lab.config.hypothesis import ClusterSpec, KVConnector
from btb_lab.errors import UserError
from tests.unit.test_cluster_launcher import alive, dummy_spec, tree_pids


def cluster(connector: dict[str, Any], **launch: object) -> ClusterSpec:
    data = {
        "instances": [{"role": "C", "count": 2}, {"role": "PS", "count": 1}],
        "kv_connector": connector,
        "launch": {"served_model": "m", "device": "cpu", **launch},
    }
    return ClusterSpec.model_validate(data)


def kv_config(spec: Any) -> dict[str, Any]:
    cmd = list(spec.command)
    return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])  # type: ignore[no-any-return]


def test_registry_names_every_connector_type() -> None:
    assert list(CONNECTORS) == ["example", "mooncake", "nixl", "none"]
    with pytest.raises(UserError, match="choose one of"):
        CONNECTORS.get("lmcache")


def test_nixl_on_cpu_roles_buffers_and_side_channels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_TLS", raising=False)
    specs = plan_instances(
        cluster({"type": "nixl", "role": "kv_both", "roles": {"PS": "kv_producer"}}), model="m"
    )
    configs = [kv_config(s) for s in specs]
    assert [c["kv_role"] for c in configs] == ["kv_both", "kv_both", "kv_producer"]
    for c in configs:
        assert c["kv_connector"] == "BtbNixlConnector"
        assert c["kv_connector_module_path"] == "btb_lab.cluster.vllm_nixl"
        assert c["kv_connector_extra_config"] == {"progress_delay_us": 1000}
        assert c["kv_buffer_device"] == "cpu"
        assert c["kv_load_failure_policy"] == "fail"
    sides = [int(s.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) for s in specs]
    assert len(set(sides)) == 3
    assert not set(sides) & {s.port for s in specs}  # never an HTTP port
    assert [s.side_channel_port for s in specs] == sides
    assert {s.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] for s in specs} == {"127.0.0.1"}
    assert {s.env["UCX_TLS"] for s in specs} == {"tcp,self,sm"}
    assert all(s.bootstrap_port is None and s.scratch_dir is None for s in specs)


def test_nixl_keeps_the_users_ucx_transports_and_can_run_stock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")
    (spec, *_) = plan_instances(
        cluster({"type": "nixl", "nixl_progress_delay_us": None}), model="m"
    )
    assert "UCX_TLS" not in spec.env  # inherited from the parent as the user set it
    config = kv_config(spec)
    assert config["kv_connector"] == "NixlConnector"
    assert "kv_connector_module_path" not in config
    assert "kv_connector_extra_config" not in config


def test_nixl_on_gpu_stages_kv_in_device_memory_with_a_port_per_rank() -> None:
    data = {
        "instances": [{"role": "C", "count": 2, "gpus": 2}],
        "kv_connector": {"type": "nixl"},
        "launch": {"served_model": "m"},
    }
    specs = plan_instances(ClusterSpec.model_validate(data), model="m")
    assert {kv_config(s)["kv_buffer_device"] for s in specs} == {"cuda"}
    first, second = (s.side_channel_port for s in specs)
    assert first is not None
    assert second is not None
    assert abs(first - second) >= 2  # TP 2: base + rank for each, no overlap
    assert "UCX_TLS" not in specs[0].env or "UCX_TLS" in os.environ


def test_example_connector_shares_one_fresh_folder(tmp_path: Path) -> None:
    spec = cluster({"type": "example", "roles": {"PS": "kv_producer", "C": "kv_consumer"},
                    "shared_storage_path": str(tmp_path)})  # fmt: skip
    specs = plan_instances(spec, model="m")
    folders = {s.scratch_dir for s in specs}
    assert len(folders) == 1
    (folder,) = folders
    assert folder is not None
    assert Path(folder).parent == tmp_path
    assert not Path(folder).exists()  # planning creates nothing
    configs = [kv_config(s) for s in specs]
    assert [c["kv_role"] for c in configs] == ["kv_consumer", "kv_consumer", "kv_producer"]
    assert {json.dumps(c["kv_connector_extra_config"]) for c in configs} == {
        json.dumps({"shared_storage_path": folder})
    }
    assert {c["kv_connector"] for c in configs} == {"ExampleConnector"}
    again = plan_instances(spec, model="m")
    assert again[0].scratch_dir != folder  # every launch gets its own folder


def test_no_connector_means_no_kv_config() -> None:
    specs = plan_instances(cluster({"type": "none"}), model="m")
    assert all("--kv-transfer-config" not in s.command for s in specs)
    assert all(s.side_channel_port is None for s in specs)


def test_block_size_follows_the_workload_and_refuses_a_mismatch() -> None:
    (spec, *_) = plan_instances(cluster({"type": "none"}), model="m", block_tokens=64)
    cmd = list(spec.command)
    assert cmd[cmd.index("--block-size") + 1] == "64"
    same = cluster({"type": "none"}, extra_args={"C": ["--block-size", "64"], "PS": []})
    (spec, *_) = plan_instances(same, model="m", block_tokens=64)
    assert list(spec.command).count("--block-size") == 1
    other = cluster({"type": "none"}, extra_args={"C": ["--block-size=128"]})
    with pytest.raises(UserError, match=r"--block-size 128 differs from workload\.block_tokens 64"):
        plan_instances(other, model="m", block_tokens=64)
    (spec, *_) = plan_instances(cluster({"type": "none"}), model="m")
    assert "--block-size" not in spec.command  # attached or unknown workload: vLLM's own


def test_cpu_placeholder_wraps_instances_onto_the_available_cores() -> None:
    spec = cluster({"type": "none"}, env={"C": {"BIND": "{cpu}"}, "PS": {"BIND": "{cpu}"}})
    cores = len(os.sched_getaffinity(0))
    binds = [s.env["BIND"] for s in plan_instances(spec, model="m")]
    assert binds == [str(i % cores) for i in range(3)]


def test_free_ports_gives_a_free_run_outside_avoid() -> None:
    base = free_ports("127.0.0.1", 3, avoid=set())
    again = free_ports("127.0.0.1", 2, avoid=set(range(base, base + 3)))
    assert not set(range(again, again + 2)) & set(range(base, base + 3))


def test_launcher_makes_the_shared_folder_and_removes_it_on_stop(tmp_path: Path) -> None:
    folder = tmp_path / "kv-shared"
    spec = dummy_spec(tmp_path, "C0")
    spec = type(spec)(
        spec.index, spec.name, spec.role, spec.host, spec.port, (), spec.command, {},
        scratch_dir=str(folder),
    )  # fmt: skip
    launcher = Launcher(tmp_path / "logs", ready_timeout_s=30, stop_grace_s=2)
    launcher.start([spec])
    assert folder.is_dir()
    (folder / "layer.safetensors").write_bytes(b"kv")  # what the connector writes
    pids = tree_pids(tmp_path, "C0")
    launcher.stop()
    assert not folder.exists()
    assert not any(alive(p) for p in pids)


def test_launcher_removes_the_folder_when_start_fails(tmp_path: Path) -> None:
    folder = tmp_path / "kv-shared"
    bad = dummy_spec(tmp_path, "C0", mode="exit")
    bad = type(bad)(
        bad.index, bad.name, bad.role, bad.host, bad.port, (), bad.command, {},
        scratch_dir=str(folder),
    )  # fmt: skip
    with pytest.raises(UserError, match="exited with code 3"):
        Launcher(tmp_path / "logs", ready_timeout_s=30, stop_grace_s=2).start([bad])
    assert not folder.exists()


def test_instances_get_their_own_process_group_but_our_session(tmp_path: Path) -> None:
    """A process group for teardown; the same session (so the same scheduler autogroup as
    the driver and the other instances: a new session starved KV transfers)."""
    launcher = Launcher(tmp_path / "logs", ready_timeout_s=30, stop_grace_s=2)
    try:
        launcher.start([dummy_spec(tmp_path, "C0")])
        (pid,) = launcher.pids().values()
        assert os.getpgid(pid) == pid
        assert os.getpgid(pid) != os.getpgid(0)
        assert os.getsid(pid) == os.getsid(0)
    finally:
        launcher.stop()


# -- inside vLLM: BtbNixlConnector's corrections ------------------------------------------


class FakeBindings:
    """Stands in for nixl's compiled bindings: records the config of each agent."""

    def __init__(self) -> None:
        self.delays: list[int] = []

    def nixlAgent(self, name: str, config: Any) -> str:  # the binding's own name
        self.delays.append(config.pthrDelay)
        return f"agent {name}"

    def nixlAgentConfig(self) -> SimpleNamespace:  # the binding's own name
        return SimpleNamespace(pthrDelay=0)


def test_progress_delay_reaches_every_new_agent() -> None:
    from btb_lab.cluster.nixl_cpu import set_progress_delay

    bindings = FakeBindings()
    api = SimpleNamespace(nixlBind=bindings)
    assert set_progress_delay(1000, api)
    config = api.nixlBind.nixlAgentConfig()
    config.pthrDelay = 0  # what nixl's Python API does before creating the agent
    assert api.nixlBind.nixlAgent("a", config) == "agent a"
    assert set_progress_delay(250, api)  # a second call adjusts, never wraps twice
    api.nixlBind.nixlAgent("b", SimpleNamespace(pthrDelay=0))
    assert bindings.delays == [1000, 250]


def test_progress_delay_leaves_an_unknown_nixl_alone() -> None:
    from btb_lab.cluster.nixl_cpu import set_progress_delay

    api = SimpleNamespace()
    assert not set_progress_delay(1000, api)
    assert not hasattr(api, "nixlBind")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to narrow to one")
def test_kept_affinity_undoes_a_pin_inside_the_block() -> None:
    from btb_lab.cluster.nixl_cpu import kept_affinity

    before = os.sched_getaffinity(0)
    with kept_affinity():
        os.sched_setaffinity(0, {max(before)})  # what vLLM's NIXL CPU worker does
        assert os.sched_getaffinity(0) == {max(before)}
    assert os.sched_getaffinity(0) == before
    with kept_affinity(enabled=False):
        os.sched_setaffinity(0, {max(before)})
    assert os.sched_getaffinity(0) == {max(before)}
    os.sched_setaffinity(0, before)


def test_connector_objects_follow_the_spec() -> None:
    nixl = build_connector(KVConnector(type="nixl", roles={"PS": "kv_producer"}))
    assert nixl.moves_kv
    assert nixl.kv_role("PS") == "kv_producer"
    assert nixl.kv_role("C") == "kv_both"
    assert not build_connector(KVConnector()).moves_kv


# -- what the engines report: vLLM's by-source and NIXL metrics ----------------------------

METRICS = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_metrics_nixl_consumer.txt"


def test_parse_a_real_nixl_consumers_metrics() -> None:
    """A /metrics capture of a vLLM 0.32 CPU decode instance after 13 NIXL reads."""
    from btb_lab.cluster.telemetry import kv_sources, parse_vllm_metrics

    m = parse_vllm_metrics(METRICS.read_text())
    assert m["prompt_tokens_local_compute"] == 5903
    assert m["prompt_tokens_local_cache_hit"] == 13760
    assert m["prompt_tokens_external_kv_transfer"] == 7185
    assert m["prompt_tokens_cached_p2p"] == 7185
    assert m["prompt_tokens_cached_device"] == 13760
    assert m["external_prefix_cache_hits"] == 7185
    assert m["nixl_xfers"] == 13
    assert m["nixl_bytes"] == 7798784
    assert m["nixl_xfer_s"] == pytest.approx(0.093968)
    assert m["nixl_failed_transfers"] == 0
    (kv,) = kv_sources({"C0": m}).values()
    assert kv["prompt_tokens"] == 26848
    assert kv["local_hit_tokens"] + kv["external_hit_tokens"] + kv["computed_tokens"] == 26848
    assert (kv["external_hit_tokens"], kv["kv_transfers"]) == (7185, 13)


def test_kv_sources_fall_back_to_the_prefix_cache_counters() -> None:
    from btb_lab.cluster.telemetry import kv_sources

    delta = {"prompt_tokens": 100.0, "prefix_cache_hits": 30.0, "external_prefix_cache_hits": 50.0}
    (kv,) = kv_sources({"E0": delta}).values()
    assert kv["local_hit_tokens"] == 30
    assert kv["external_hit_tokens"] == 50
    assert kv["computed_tokens"] == 20


def test_report_table_shows_each_instances_kv_by_source() -> None:
    from btb_lab.report.render import kv_source_rows, render_template
    from btb_lab.results import RunEntry

    kv = {"prompt_tokens": 100.0, "local_hit_tokens": 30.0, "external_hit_tokens": 50.0,
          "computed_tokens": 20.0, "kv_bytes": 2.0 * 2**20, "kv_transfer_s": 0.25,
          "kv_transfers": 3.0, "kv_failed_transfers": 0.0}  # fmt: skip
    none = dict.fromkeys(kv, 0.0)

    def entry(variant: str, extra: dict[str, Any]) -> RunEntry:
        return RunEntry(variant=variant, repeat=0, seed=0, workload_seed=0, requests=1,
                        status="ok", started="now", extra=extra)  # fmt: skip

    runs = [
        entry("ps", {"metrics": {"kv_sources": {"C1": kv, "PS0": none}}}),
        entry("sim-like", {}),
    ]
    rows = kv_source_rows(runs)
    assert [(r["run"], r["instance"]) for r in rows] == [
        ("ps r1", "C1"), ("ps r1", "PS0"), ("ps r1", "total"),
    ]  # fmt: skip
    text = render_template("_kv_sources.md.j2", {"kv_source_rows": rows})
    assert "| ps r1 | C1 | 100 | 30 | 50 | 20 | 2.00 | 0.250 | 3 |" in text
    assert "| ps r1 | total |  |  |  |  | 2.00 | 0.250 | 3 |" in text
    assert render_template("_kv_sources.md.j2", {"kv_source_rows": []}) == ""
