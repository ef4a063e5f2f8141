"""The body of one Ray instance actor: on its node it plans its server (ports free there,
bound to the node's address), starts it as an argument list in its own process group
with a reaper beside it, keeps the server's log in a node-local file the driver reads
in pieces, samples utilization (NVML on GPU nodes, else psutil of the server's tree),
and stops the whole tree on request. Plain Python, no Ray import: `ray_launch` wraps it
in an actor, and tests drive it directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from btb_lab.cluster.launcher import Endpoint, InstanceSpec, ProcessTree
from btb_lab.cluster.reaper import reaper_command
from btb_lab.cluster.telemetry import NvmlSampler, PsutilSampler, Sampler, nvml_available

if TYPE_CHECKING:
    from btb_lab.config.hypothesis import ClusterSpec
    from btb_lab.records import UtilSample

__all__ = ["LOG_CHUNK_BYTES", "InstanceHost", "Planner", "StartedInstance"]

# Plans every instance of a cluster block (ports, command, env): `plan_instances` with
# the run's model bound. Picklable (a module-level function or a partial of one).
Planner = Callable[["ClusterSpec"], Sequence[InstanceSpec]]

LOG_CHUNK_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class StartedInstance:
    """What the actor reports once its server process runs."""

    endpoint: Endpoint
    spec: InstanceSpec
    pid: int
    node_id: str | None
    node_ip: str
    node_log: str  # the server's log file on the node


class InstanceHost:
    """One server on this node. Methods may be called from several threads at once (the
    actor is threaded so that log reads and samples proceed while `wait_exit` blocks)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._dir = Path(tempfile.mkdtemp(prefix=f"btb-{name}-"))
        self.log_path = self._dir / "server.log"
        self._tree: ProcessTree | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        self._sampler: Sampler | None = None
        self._lock = threading.Lock()
        self._gpu_ids: list[int] = []

    def start(
        self,
        cluster: ClusterSpec,
        plan: Planner,
        index: int,
        *,
        host: str,
        label: str,
        gpu_ids: Sequence[int] = (),
        node_id: str | None = None,
        node_ip: str | None = None,
        grace_s: float = 15.0,
    ) -> StartedInstance:
        """Plan instance `index` of `cluster` here, bound to `host`, and start it. With
        `gpu_ids` (those Ray assigned to this actor) the server sees exactly them; the
        reaper started beside it stops its tree if this process dies without stopping
        it (after TERM, `grace_s` before KILL)."""
        launch = cluster.launch.model_copy(update={"host": host})
        local = cluster.model_copy(update={"launch": launch})
        spec = plan(local)[index]
        env = dict(spec.env)
        env.pop("CUDA_VISIBLE_DEVICES", None)  # Ray's assignment, not first_gpu's
        if gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
        spec = dataclasses.replace(spec, gpus=tuple(int(g) for g in gpu_ids), env=env)
        self._gpu_ids = list(spec.gpus)
        with self.log_path.open("ab") as log:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
            log.write(f"\n===== {stamp} start {spec.name} {label}\n".encode())
            log.write(("$ " + " ".join(spec.command) + "\n").encode())
            log.flush()
            popen = subprocess.Popen(  # argument list, never a shell string
                list(spec.command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **spec.env},
                process_group=0,  # its own group: one killpg reaches the whole tree
                cwd=self._dir,
            )
        self._tree = ProcessTree(popen, spec.name)
        self._reaper = subprocess.Popen(
            reaper_command(os.getpid(), popen.pid, grace_s),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return StartedInstance(
            spec.endpoint(), spec, popen.pid, node_id, node_ip or host, str(self.log_path)
        )

    def read_log(self, offset: int, limit: int = LOG_CHUNK_BYTES) -> bytes:
        """Bytes of the server's log from `offset` (at most `limit`)."""
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(offset)
                return fh.read(limit)
        except OSError:
            return b""

    def exit_code(self) -> int | None:
        """The server's exit code, or None while it runs."""
        return None if self._tree is None else self._tree.popen.poll()

    def wait_exit(self) -> int:
        """Block until the server exits; its exit code (-N: killed by signal N)."""
        if self._tree is None:
            return 0
        while True:
            try:
                return self._tree.popen.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                continue

    def remember_descendants(self) -> None:
        """Record the server's tree now (after readiness its workers have started)."""
        if self._tree is not None:
            self._tree.remember_descendants()

    def clock(self) -> float:
        """This node's monotonic clock; sample times are on it."""
        return time.perf_counter()

    def start_sampling(self, interval_s: float, device: str) -> str:
        """Sample this instance's GPUs through NVML (device gpu, NVML present) or its
        process tree through psutil, every `interval_s`; returns the source."""
        with self._lock:
            if self._sampler is not None:
                self._sampler.stop()
            sampler: Sampler
            if device == "gpu" and self._gpu_ids and nvml_available():
                owners = dict.fromkeys(self._gpu_ids, self.name)
                sampler = NvmlSampler(owners, interval_s, time.perf_counter)
            elif self._tree is not None:
                sampler = PsutilSampler({self.name: self._tree.pid}, interval_s, time.perf_counter)
            else:
                sampler = Sampler(interval_s, time.perf_counter)
            self._sampler = sampler
            sampler.start()
            return sampler.source

    def take_samples(self) -> tuple[list[UtilSample], float]:
        """Samples taken since the last call, and this node's clock now."""
        sampler = self._sampler
        if sampler is None:
            return [], time.perf_counter()
        taken = len(sampler.samples)
        out = sampler.samples[:taken]
        del sampler.samples[:taken]
        return out, time.perf_counter()

    def stop_sampling(self) -> tuple[list[UtilSample], float]:
        """Stop sampling; the samples not taken yet and this node's clock."""
        with self._lock:
            sampler, self._sampler = self._sampler, None
        if sampler is None:
            return [], time.perf_counter()
        return list(sampler.stop()), time.perf_counter()

    def stop(self, grace_s: float) -> int | None:
        """TERM the server's group and every known descendant, KILL after `grace_s`;
        returns its exit code. Safe to call twice."""
        with contextlib.suppress(Exception):
            self.stop_sampling()
        tree = self._tree
        if tree is None:
            return None
        tree.stop(grace_s)
        if self._reaper is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(timeout=5.0)  # it exits once the tree is gone
        return tree.popen.poll()

    def cleanup(self) -> None:
        """Remove the node-local log folder (after the driver has read the log)."""
        shutil.rmtree(self._dir, ignore_errors=True)
