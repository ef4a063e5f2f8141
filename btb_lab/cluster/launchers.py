"""Where a hypothesis's servers run (`cluster.launch.backend`): the interface the cluster
backend drives — start, stay alive, telemetry, facts, stop — and its implementations by
name: `local` (processes of this machine, `launcher.Launcher`) and `ray` (one actor per
server on a Ray cluster, `ray_launch.RayLauncher`, imported only when asked for).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from btb_lab.cluster.launcher import Endpoint, InstanceSpec, Launcher, LaunchError
from btb_lab.cluster.telemetry import NvmlSampler, PsutilSampler, Sampler, nvml_available
from btb_lab.registry import Registry

if TYPE_CHECKING:
    from btb_lab.cluster.ray_instance import Planner
    from btb_lab.config.hypothesis import ClusterSpec

__all__ = ["LAUNCHERS", "InstanceLauncher", "LocalLauncher", "new_launcher", "until_failure"]

T = TypeVar("T")


class InstanceLauncher(Protocol):
    """What the cluster backend needs of whatever starts its servers."""

    @property
    def running(self) -> bool: ...

    def start(self, specs: Sequence[InstanceSpec], *, label: str = "") -> list[Endpoint]:
        """Start every instance and wait until all are healthy; on failure stop all."""
        ...

    def check_alive(self) -> None:
        """Raise LaunchError if an instance is gone."""
        ...

    def failure(self) -> LaunchError | None:
        """An instance lost during the run that must end it now, if any (checked often,
        must not block)."""
        ...

    def sampler(self, endpoints: Sequence[Endpoint], interval_s: float, device: str,
                now: Callable[[], float]) -> Sampler:  # fmt: skip
        """A utilization sampler over the instances, stamping times with `now`."""
        ...

    def facts(self) -> list[dict[str, object]]:
        """Launch facts per instance for the manifest."""
        ...

    def stop(self) -> None:
        """Stop every instance; idempotent."""
        ...


class LocalLauncher(Launcher):
    """Servers as processes of this machine, sampled here (NVML, else psutil)."""

    def failure(self) -> LaunchError | None:
        # A local server that dies fails its requests at once (connection refused), so
        # the run goes on and records them, as it always has.
        return None

    def sampler(self, endpoints: Sequence[Endpoint], interval_s: float, device: str,
                now: Callable[[], float]) -> Sampler:  # fmt: skip
        if device == "gpu" and nvml_available():
            owners = {g: ep.name for ep in endpoints for g in ep.gpus}
            return NvmlSampler(owners, interval_s, now)
        pids = self.pids()
        if pids:
            return PsutilSampler(pids, interval_s, now)
        return Sampler(interval_s, now)


LauncherFactory = Callable[["ClusterSpec", Path, "Planner"], InstanceLauncher]


def _local(cluster: ClusterSpec, log_dir: Path, plan: Planner) -> InstanceLauncher:
    launch = cluster.launch
    return LocalLauncher(
        log_dir, ready_timeout_s=launch.ready_timeout_s, stop_grace_s=launch.stop_grace_s
    )


def _ray(cluster: ClusterSpec, log_dir: Path, plan: Planner) -> InstanceLauncher:
    from btb_lab.cluster.ray_launch import RayLauncher

    return RayLauncher(log_dir, cluster, plan)


LAUNCHERS: Registry[LauncherFactory] = Registry("launch backend")
LAUNCHERS.add("local", _local)
LAUNCHERS.add("ray", _ray)


def new_launcher(cluster: ClusterSpec, log_dir: Path, plan: Planner) -> InstanceLauncher:
    """The launcher `cluster.launch.backend` names, writing instance logs to `log_dir`.
    `plan` plans the instances (the Ray launcher calls it on each server's node)."""
    return LAUNCHERS.get(cluster.launch.backend)(cluster, log_dir, plan)


async def until_failure(
    main: Coroutine[Any, Any, T], launcher: InstanceLauncher | None, every_s: float = 0.5
) -> T:
    """Await `main`, but if the launcher reports a lost instance first, cancel it (its
    cleanup runs) and raise that LaunchError: a dead node ends the run with a clear
    error instead of leaving requests waiting on a host that will never answer."""
    task = asyncio.ensure_future(main)
    if launcher is None:
        return await task
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
            error = launcher.failure()
            if error is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise error
    finally:
        task.cancel()  # a no-op once it finished; on an interrupt it stops the run too
