"""Launcher: server command lines, GPU and port assignment, readiness failures, and
teardown of whole process trees on success, error, SIGINT and SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from btb_lab.cluster.launcher import (
    InstanceSpec,
    Launcher,
    LaunchError,
    plan_endpoints,
    plan_instances,
)
from btb_lab.config.hypothesis import ClusterSpec

# A stand-in server: serves /health (optionally never, or exits at once) and keeps a
# grandchild alive, so teardown must reach a whole tree, not one pid.
DUMMY_SERVER = textwrap.dedent(
    """
    import http.server, os, subprocess, sys, time
    mode, port, pidfile = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    child = subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(1)"])
    with open(pidfile + ".tmp", "w") as fh:
        fh.write(f"{os.getpid()} {child.pid}")
    os.replace(pidfile + ".tmp", pidfile)  # readers never see half a file
    print("dummy server starting", flush=True)
    if mode == "exit":
        # exit only once the sibling named in argv[4] (if any) has started its tree, so
        # the test knows every pid teardown must reach
        deadline = time.monotonic() + 60
        while len(sys.argv) > 4 and not os.path.exists(sys.argv[4]):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        print("fatal: cannot load model", flush=True)
        sys.exit(3)
    if mode == "never":
        while True:
            time.sleep(1)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def dummy_spec(
    tmp_path: Path, name: str, mode: str = "serve", index: int = 0, after: str | None = None
) -> InstanceSpec:
    """A dummy server; in "exit" mode with `after`, it exits once instance `after` has
    written its pid file."""
    from btb_lab.cluster.launcher import free_port

    script = tmp_path / "dummy_server.py"
    script.write_text(DUMMY_SERVER)
    port = free_port()
    pidfile = tmp_path / f"{name}.pids"
    cmd: tuple[str, ...] = (sys.executable, str(script), mode, str(port), str(pidfile))
    if after is not None:
        cmd += (str(tmp_path / f"{after}.pids"),)
    return InstanceSpec(index, name, "C", "127.0.0.1", port, (), cmd, {})


def tree_pids(tmp_path: Path, name: str) -> list[int]:
    return [int(p) for p in (tmp_path / f"{name}.pids").read_text().split()]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def cluster(**launch: object) -> ClusterSpec:
    data = {
        "instances": [{"role": "C", "count": 2, "gpus": 2}, {"role": "PS", "count": 1}],
        "launch": {"served_model": "m", **launch},
    }
    return ClusterSpec.model_validate(data)


def test_plan_assigns_gpus_ports_and_module_entry_point() -> None:
    specs = plan_instances(cluster(), model="/models/x", python="/py")
    assert [s.name for s in specs] == ["C0", "C1", "PS0"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3", "4"]
    assert len({s.port for s in specs}) == 3
    cmd = list(specs[0].command)
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--model") + 1] == "/models/x"
    assert cmd[cmd.index("--port") + 1] == str(specs[0].port)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert "--enable-prefix-caching" in cmd
    assert "--kv-transfer-config" not in cmd


def test_gpu_pool_wraps_so_instances_share_gpus() -> None:
    specs = plan_instances(cluster(gpu_pool=[3]), model="m")
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["3,3", "3,3", "3"]
    specs = plan_instances(cluster(gpu_pool=[0, 1, 2]), model="m")
    assert [s.gpus for s in specs] == [(0, 1), (2, 0), (1,)]


def test_plan_mooncake_config_and_distinct_bootstrap_ports() -> None:
    spec = cluster()
    spec.kv_connector = spec.kv_connector.model_validate({"type": "mooncake", "protocol": "tcp"})
    specs = plan_instances(spec, model="m")
    cmd = list(specs[0].command)
    config = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert config == {
        "kv_connector": "MooncakeConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
    }
    boots = [s.env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] for s in specs]
    assert len(set(boots)) == 3
    assert specs[1].endpoint().bootstrap_url == f"http://127.0.0.1:{boots[1]}"


def test_plan_cpu_role_args_env_and_placeholders() -> None:
    spec = cluster(
        device="cpu",
        extra_args={"C": ["--dtype", "bfloat16"], "PS": ["--max-num-seqs", "{index}"]},
        env={"C": {"VLLM_CPU_OMP_THREADS_BIND": "{index}", "NAME": "{name}"}},
    )
    specs = plan_instances(spec, model="m")
    assert "CUDA_VISIBLE_DEVICES" not in specs[0].env
    assert specs[1].env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert specs[1].env["NAME"] == "C1"
    assert list(specs[2].command)[-2:] == ["--max-num-seqs", "2"]
    assert "--dtype" in specs[0].command
    assert "--dtype" not in specs[2].command
    assert list(specs[0].command)[list(specs[0].command).index("--tensor-parallel-size") + 1] == "1"


def test_endpoints_mode_names_roles_and_bootstrap() -> None:
    spec = ClusterSpec.model_validate(
        {
            "instances": [{"role": "C", "count": 1}, {"role": "PS", "count": 1}],
            "kv_connector": {"type": "mooncake"},
            "launch": {
                "endpoints": ["http://h1:8000/", "http://[::1]:8001"],
                "bootstrap_ports": [9, 10],
            },
        }
    )
    eps = plan_endpoints(spec)
    assert [(e.name, e.role, e.base_url, e.bootstrap_url) for e in eps] == [
        ("C0", "C", "http://h1:8000", "http://h1:9"),
        ("PS0", "PS", "http://[::1]:8001", "http://[::1]:10"),  # an IPv6 host keeps brackets
    ]


def test_success_path_stops_every_process_of_every_tree(tmp_path: Path) -> None:
    specs = [dummy_spec(tmp_path, "C0", index=0), dummy_spec(tmp_path, "C1", index=1)]
    with Launcher(tmp_path / "logs", ready_timeout_s=60, stop_grace_s=5) as launcher:
        endpoints = launcher.start(specs)
        assert [e.name for e in endpoints] == ["C0", "C1"]
        pids = tree_pids(tmp_path, "C0") + tree_pids(tmp_path, "C1")
        assert all(alive(p) for p in pids)
        assert all(f["ready_s"] is not None for f in launcher.facts())
    assert not any(alive(p) for p in pids)
    assert "dummy server starting" in (tmp_path / "logs" / "C0.log").read_text()


def test_error_inside_run_still_tears_down(tmp_path: Path) -> None:
    spec = dummy_spec(tmp_path, "C0")
    seen: list[int] = []

    def run() -> None:
        with Launcher(tmp_path / "logs") as launcher:
            launcher.start([spec])
            seen.extend(tree_pids(tmp_path, "C0"))
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run()
    assert seen
    assert not any(alive(p) for p in seen)


def test_instance_that_exits_fails_at_once_with_log_tail(tmp_path: Path) -> None:
    good = dummy_spec(tmp_path, "C0", index=0)
    bad = dummy_spec(tmp_path, "C1", "exit", 1, after="C0")
    launcher = Launcher(tmp_path / "logs", ready_timeout_s=120)
    with pytest.raises(LaunchError) as err:
        launcher.start([good, bad])
    assert "C1 exited with code 3" in str(err.value)
    assert "fatal: cannot load model" in str(err.value)
    assert not launcher.running
    assert not any(alive(p) for p in tree_pids(tmp_path, "C0"))


def test_instance_never_ready_times_out_and_is_stopped(tmp_path: Path) -> None:
    spec = dummy_spec(tmp_path, "C0", "never")
    with pytest.raises(LaunchError, match="not ready after 5 s") as err:
        Launcher(tmp_path / "logs", ready_timeout_s=5, stop_grace_s=2).start([spec])
    assert "dummy server starting" in str(err.value)
    assert not any(alive(p) for p in tree_pids(tmp_path, "C0"))


def test_term_ignoring_process_is_killed_after_grace(tmp_path: Path) -> None:
    script = tmp_path / "stubborn.py"
    script.write_text(
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('up', flush=True)\nwhile True: time.sleep(1)\n"
    )
    from btb_lab.cluster.launcher import ProcessTree

    proc = subprocess.Popen(
        [sys.executable, str(script)], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "up"  # SIGTERM is ignored from here on
    tree = ProcessTree(proc, "stubborn")
    tree.stop(grace_s=1.0)
    assert not alive(proc.pid)


DRIVER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from tests.unit.test_cluster_launcher import dummy_spec
    from btb_lab.cluster.launcher import Launcher, sigterm_raises
    tmp = Path({tmp!r})
    with sigterm_raises(), Launcher(tmp / "logs", stop_grace_s=5) as launcher:
        launcher.start([dummy_spec(tmp, "C0")])
        print("READY", flush=True)
        while True:
            time.sleep(0.1)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_owner_tears_down_the_tree(tmp_path: Path, sig: signal.Signals) -> None:
    root = str(Path(__file__).resolve().parents[2])
    script = tmp_path / "owner.py"
    script.write_text(DRIVER_SCRIPT.format(tests=root, tmp=str(tmp_path)))
    owner = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=root
    )
    assert owner.stdout is not None
    assert owner.stdout.readline().strip() == "READY"
    pids = tree_pids(tmp_path, "C0")
    assert all(alive(p) for p in pids)
    os.kill(owner.pid, sig)
    owner.wait()
    assert owner.returncode != 0
    assert not any(alive(p) for p in pids)


def test_sigterm_during_a_cluster_run_is_a_terminate_not_a_ctrl_c(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cluster backend, `router serve` and calibration stop on SIGTERM through
    `sigterm_raises`: the interrupt carries the signal, so the command exits 143."""
    from btb_lab import interrupts
    from btb_lab.cluster.launcher import sigterm_raises

    monkeypatch.setattr(interrupts, "_received", [])
    before = signal.getsignal(signal.SIGTERM)

    def terminate_self() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs at the next bytecode boundary
            time.sleep(0.01)

    with sigterm_raises(), pytest.raises(interrupts.Terminated) as info:
        terminate_self()
    assert info.value.signum == signal.SIGTERM
    assert interrupts.exit_code(info.value) == 143
    assert interrupts.terminated()
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back
