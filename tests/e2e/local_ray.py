"""A real multi-node Ray cluster on this machine for the Ray tier (make test-ray): a head
and worker nodes started with `ray start`, each its own raylet, all under one private
temp folder; stopped by signalling exactly the processes of that folder (never `ray
stop`, which would stop every Ray on the machine).

    python tests/e2e/local_ray.py stop TEMP_DIR   # what scripts/test_ray.sh runs on exit
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

__all__ = ["LocalRayCluster", "ray_env"]

RAY = Path(sys.executable).parent / "ray"


def ray_env() -> dict[str, str]:
    """Environment for everything that talks to the test cluster: no token files, no
    usage reports (nothing leaves the machine)."""
    env = dict(os.environ)
    env.update({"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"})
    env.pop("RAY_ADDRESS", None)
    return env


class LocalRayCluster:
    """Head plus workers, each `ray start`ed with a few CPUs and custom resources."""

    def __init__(self, temp_dir: Path) -> None:
        self.temp_dir = temp_dir
        self.address: str | None = None
        self.worker_raylets: list[int] = []  # pid of each worker node's raylet
        # every process ever seen in the cluster: an agent orphaned by a killed raylet
        # names no folder any more, but is still ours to stop (is_running checks its
        # create time, so a reused pid is never signalled)
        self._seen: dict[int, psutil.Process] = {}

    def _start(self, args: list[str]) -> None:
        out = subprocess.run(
            [str(RAY), "start", "--temp-dir", str(self.temp_dir), "--disable-usage-stats",
             *args],
            env=ray_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"ray start {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")

    def start_head(self, *, num_cpus: int, resources: dict[str, float]) -> str:
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self._start([
            "--head", "--port=0", f"--num-cpus={num_cpus}", "--num-gpus=0",
            "--include-dashboard=false", f"--resources={json.dumps(resources)}",
        ])  # fmt: skip
        self.address = (self.temp_dir / "ray_current_cluster").read_text().split()[0]
        self.processes()
        return self.address

    def add_worker(self, *, num_cpus: int, resources: dict[str, float]) -> int:
        """Start a worker node; returns its raylet's pid (to kill the node)."""
        assert self.address is not None
        before = set(self.raylet_pids())
        self._start([f"--address={self.address}", f"--num-cpus={num_cpus}", "--num-gpus=0",
                     f"--resources={json.dumps(resources)}"])  # fmt: skip
        new = sorted(set(self.raylet_pids()) - before)
        assert len(new) == 1, new
        self.worker_raylets.append(new[0])
        return new[0]

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster: Ray's programs naming its folder, and their
        children (this process and its parents, whatever their arguments, never)."""
        me = psutil.Process()
        spared = {me.pid, *(p.pid for p in me.parents())}
        mine: dict[int, psutil.Process] = {}
        folder = str(self.temp_dir)
        ray_code = f"{os.sep}ray{os.sep}"
        for proc in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                cmd = proc.info["cmdline"] or []
                if proc.pid in spared or not any(ray_code in part for part in cmd):
                    continue
                if any(folder in part for part in cmd):
                    mine[proc.pid] = proc
                    for child in proc.children(recursive=True):
                        mine.setdefault(child.pid, child)
        for pid, proc in mine.items():
            self._seen.setdefault(pid, proc)
        live = {pid: p for pid, p in self._seen.items() if _running(p)}
        return [p for pid, p in live.items() if pid not in spared]

    def raylet_pids(self) -> list[int]:
        out = []
        for proc in self.processes():
            with contextlib.suppress(psutil.Error):
                if proc.name() == "raylet":
                    out.append(proc.pid)
        return out

    def kill_node(self, raylet_pid: int) -> None:
        """Lose a node at once: SIGKILL its raylet, as when its host goes away."""
        self.processes()  # remember its agents and workers first
        psutil.Process(raylet_pid).kill()

    def stop(self, grace_s: float = 10.0) -> None:
        """TERM every process of the cluster, KILL what is left after `grace_s`."""
        for _ in range(3):  # workers spawned while stopping are caught by the next pass
            procs = self.processes()
            if not procs:
                return
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    proc.terminate()
            _, alive = psutil.wait_procs(procs, timeout=grace_s)
            for proc in alive:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            psutil.wait_procs(alive, timeout=5.0)
            time.sleep(0.5)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "stop":
        sys.exit("usage: local_ray.py stop TEMP_DIR")
    LocalRayCluster(Path(sys.argv[2])).stop()
