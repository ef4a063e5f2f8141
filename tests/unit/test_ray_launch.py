"""Launching through Ray, the parts that need no Ray cluster: the `cluster.launch.backend`
and `ray` settings and their errors, the clear exit-2 error without Ray installed, and
the actor body (`InstanceHost`) run directly — its server planned for the node, started
with Ray's GPUs, its log read in pieces, sampled, stopped, and stopped by its reaper when
the process owning it is killed as `ray.kill` would. The real cluster is
tests/e2e/test_ray_cluster.py (make test-ray)."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil
import pytest
from typer.testing import CliRunner

from btb_lab.cluster.launcher import InstanceSpec, LaunchError
from btb_lab.cluster.launchers import LAUNCHERS, LocalLauncher, new_launcher, until_failure
from btb_lab.cluster.ray_instance import InstanceHost
from btb_lab.config.hypothesis import ClusterSpec
from btb_lab.errors import ValidationFailed
from btb_lab.hypothesis import load_hypothesis
from tests.unit.test_cluster_launcher import alive, dummy_spec, tree_pids
from tests.unit.test_runner_fake import HYPOTHESIS

CLUSTER_HYPOTHESIS = HYPOTHESIS.replace("backend: sim", "backend: cluster").replace(
    "    - {role: C, count: 2, gpu: H100, gpus: 4}\n",
    "    - {role: C, count: 2, gpu: H100, gpus: 4}\n"
    "  launch:\n"
    "    served_model: stand-in\n"
    "    backend: ray\n"
    "    ray:\n"
    "      placement: SPREAD\n"
    "      resources: {C: {big_node: 1}}\n",
)


def load(tmp_path: Path, text: str) -> ClusterSpec:
    path = tmp_path / "h.yaml"
    path.write_text(text)
    return load_hypothesis(path).hypothesis.cluster


def problems(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "h.yaml"
    path.write_text(text)
    with pytest.raises(ValidationFailed) as info:
        load_hypothesis(path)
    return info.value.problems


# ---- settings -------------------------------------------------------------------------
def test_backend_defaults_to_local_and_ray_settings_load(tmp_path: Path) -> None:
    assert ClusterSpec().launch.backend == "local"
    cluster = load(tmp_path, CLUSTER_HYPOTHESIS)
    assert cluster.launch.backend == "ray"
    assert cluster.launch.ray.placement == "SPREAD"
    assert cluster.launch.ray.resources == {"C": {"big_node": 1.0}}
    assert cluster.launch.ray.address is None  # $RAY_ADDRESS, else a local Ray
    assert cluster.launch.ray.host is None  # the node's address


def test_unknown_placement_names_line_field_and_choices(tmp_path: Path) -> None:
    text = CLUSTER_HYPOTHESIS.replace("placement: SPREAD", "placement: SCATTER")
    [problem] = problems(tmp_path, text)
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "SCATTER" in ln)
    assert problem.startswith(f"{tmp_path / 'h.yaml'}:{line}: cluster.launch.ray.placement")
    assert "'PACK'" in problem
    assert "'SPREAD'" in problem


def test_misspelled_ray_key_and_unknown_role_are_errors(tmp_path: Path) -> None:
    [typo] = problems(tmp_path, CLUSTER_HYPOTHESIS.replace("placement:", "placment:"))
    assert "cluster.launch.ray.placment" in typo
    [role] = problems(tmp_path, CLUSTER_HYPOTHESIS.replace("{C: {big_node", "{D: {big_node"))
    assert "cluster.launch.ray.resources.D" in role


def test_ray_with_endpoints_is_refused(tmp_path: Path) -> None:
    text = CLUSTER_HYPOTHESIS.replace(
        "    backend: ray\n", "    backend: ray\n    endpoints: [http://10.0.0.1:8000]\n"
    )
    [problem] = problems(tmp_path, text)
    assert "cluster.launch" in problem
    assert "backend ray launches servers and endpoints attaches" in problem


def test_launch_backends_are_registered_by_name() -> None:
    assert LAUNCHERS.names() == ["local", "ray"]
    local = new_launcher(ClusterSpec(), Path("unused"), lambda cluster: [])
    assert isinstance(local, LocalLauncher)
    assert local.failure() is None


def test_ray_backend_without_ray_installed_exits_2_with_the_extra_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from btb_lab.cli import app

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    path = tmp_path / "h.yaml"
    path.write_text(CLUSTER_HYPOTHESIS)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", str(path), "--no-progress", "--out", "out"])
    assert result.exit_code == 2, result.output
    assert "cluster.launch.backend: ray needs Ray" in result.output
    assert "pip install 'btb-lab[ray]'" in result.output
    assert "Traceback" not in result.output


# ---- the actor body, run here ------------------------------------------------------------
def planner_for(spec: InstanceSpec):
    """A planner that, like plan_instances, puts the server on the cluster's host."""

    def plan(cluster: ClusterSpec) -> Sequence[InstanceSpec]:
        host = cluster.launch.host
        command = tuple(host if part == "127.0.0.1" else part for part in spec.command)
        env = {"CUDA_VISIBLE_DEVICES": "0", "FROM_PLAN": "1"}  # as first_gpu would assign
        return [dataclasses.replace(spec, host=host, command=command, env=env)]

    return plan


def test_host_starts_its_server_on_ray_gpus_and_reads_back_its_log(tmp_path: Path) -> None:
    spec = dummy_spec(tmp_path, "C0")
    host = InstanceHost("C0")
    try:
        started = host.start(ClusterSpec(), planner_for(spec), 0, host="127.0.0.1",
                             label="v r0", gpu_ids=[3, 5], node_id="n1")  # fmt: skip
        assert started.endpoint.base_url == f"http://127.0.0.1:{spec.port}"
        assert started.spec.gpus == (3, 5)
        env = psutil.Process(started.pid).environ()
        assert env["CUDA_VISIBLE_DEVICES"] == "3,5"  # Ray's GPUs, not the planner's
        assert env["FROM_PLAN"] == "1"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(started.endpoint.base_url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert host.exit_code() is None
        first = host.read_log(0, limit=20)
        rest = host.read_log(len(first))
        log = (first + rest).decode()
        assert len(first) == 20
        assert "start C0 v r0" in log
        assert "dummy server starting" in log
        assert host.read_log(len(first) + len(rest)) == b""

        assert host.start_sampling(0.05, "cpu") == "psutil"
        time.sleep(0.4)
        samples, node_now = host.take_samples()
        assert samples
        assert {s.instance for s in samples} == {"C0"}
        assert all(s.time_s <= node_now and s.memory_bytes > 0 for s in samples)
        time.sleep(0.2)
        later, _ = host.stop_sampling()
        assert later
        assert all(s.time_s > samples[-1].time_s for s in later)
    finally:
        host.stop(2.0)
        host.cleanup()
    pids = tree_pids(tmp_path, "C0")
    assert not any(alive(p) for p in pids)
    assert host.exit_code() is not None
    assert not host.log_path.exists()


def test_without_ray_gpus_the_server_gets_no_gpu_assignment(tmp_path: Path) -> None:
    spec = dummy_spec(tmp_path, "C0")
    host = InstanceHost("C0")
    try:
        started = host.start(ClusterSpec(), planner_for(spec), 0, host="127.0.0.1", label="")
        assert "CUDA_VISIBLE_DEVICES" not in started.spec.env
        assert started.spec.gpus == ()
    finally:
        host.stop(2.0)
        host.cleanup()


OWNER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from btb_lab.config.hypothesis import ClusterSpec
    from btb_lab.cluster.ray_instance import InstanceHost
    from tests.unit.test_cluster_launcher import dummy_spec
    from tests.unit.test_ray_launch import planner_for
    from pathlib import Path
    spec = dummy_spec(Path(sys.argv[1]), "C0")
    host = InstanceHost("C0")
    host.start(ClusterSpec(), planner_for(spec), 0, host="127.0.0.1", label="", grace_s=2.0)
    print("started", flush=True)
    time.sleep(3600)
    """
)


def test_reaper_stops_the_server_when_its_owner_is_killed(tmp_path: Path) -> None:
    """SIGKILL of the process owning the server — what `ray.kill`, an owner's death or a
    lost raylet do to an actor — leaves no part of the server's tree behind."""
    root = Path(__file__).resolve().parents[2]
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path), str(root)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 30
        while not (tmp_path / "C0.pids").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = tree_pids(tmp_path, "C0")
        assert all(alive(p) for p in pids)
        reapers = [c for c in psutil.Process(owner.pid).children()
                   if "btb_lab.cluster.reaper" in " ".join(c.cmdline())]  # fmt: skip
        assert len(reapers) == 1
        owner.kill()
        owner.wait()
        psutil.wait_procs([psutil.Process(p) for p in pids], timeout=30)
        assert not any(alive(p) for p in pids)
        reapers[0].wait(timeout=10)  # and the reaper is gone with them
    finally:
        if owner.poll() is None:
            owner.kill()
        for pid in tree_pids(tmp_path, "C0") if (tmp_path / "C0.pids").exists() else []:
            if alive(pid):
                psutil.Process(pid).kill()


# ---- a lost instance ends the run --------------------------------------------------------
class _Losing:
    """A launcher whose instance is lost on the third look."""

    def __init__(self) -> None:
        self.looks = 0

    def failure(self) -> LaunchError | None:
        self.looks += 1
        return LaunchError("instance C1 lost its Ray actor") if self.looks >= 3 else None


def test_until_failure_cancels_the_run_and_raises_the_instance_error() -> None:
    cleaned: list[bool] = []

    async def run() -> str:
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append(True)
        return "never"

    with pytest.raises(LaunchError, match="instance C1 lost its Ray actor"):
        asyncio.run(until_failure(run(), _Losing(), every_s=0.01))  # type: ignore[arg-type]
    assert cleaned == [True]


def test_until_failure_returns_the_result_when_nothing_is_lost() -> None:
    async def run() -> str:
        await asyncio.sleep(0.05)
        return "done"

    losing = _Losing()
    losing.looks = -1000
    assert asyncio.run(until_failure(run(), losing, every_s=0.01)) == "done"  # type: ignore[arg-type]
    assert asyncio.run(until_failure(run(), None)) == "done"
