"""Instances on a Ray cluster (`cluster.launch.backend: ray`): each server is owned by
one Ray actor that reserves the instance's GPUs (or CPUs) as Ray resources, so Ray's
placement picks the node and `CUDA_VISIBLE_DEVICES`; optionally all of them at once in a
placement group (PACK, SPREAD, …), with extra resources or node labels per role.

The driver keeps what it keeps for local servers: readiness over HTTP, the log of every
server in `instances/NAME.log` (pulled from the actor as it grows), utilization in the
same table (sampled by each actor on its node, times moved onto the run's clock), and
guaranteed teardown — every actor stops its server's process group, then is killed; an
actor that dies (its node lost) is a failed instance with a clear error.

Ray is an optional extra, imported only here and only when this backend is used.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from btb_lab.cluster.launcher import Endpoint, InstanceSpec, LaunchError, tail_lines
from btb_lab.cluster.ray_instance import (
    LOG_CHUNK_BYTES,
    InstanceHost,
    Planner,
    StartedInstance,
)
from btb_lab.cluster.telemetry import Sampler
from btb_lab.errors import UserError

if TYPE_CHECKING:
    from btb_lab.config.hypothesis import ClusterSpec
    from btb_lab.config.launch import RaySettings
    from btb_lab.records import UtilSample

__all__ = ["RayInstance", "RayLauncher", "RaySampler", "connect", "import_ray"]

ACTOR_CONCURRENCY = 8  # wait_exit blocks one thread for the actor's life; logs, samples, stop
V = TypeVar("V")
CALL_TIMEOUT_S = 10.0  # one driver → actor call; a node that stops answering is lost


def import_ray() -> ModuleType:
    """The `ray` module, or a UserError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UserError(
            "cluster.launch.backend: ray needs Ray, an optional extra: pip install 'btb-lab[ray]'"
        ) from None
    return ray


def connect(settings: RaySettings) -> ModuleType:
    """Connect this process to the cluster at `ray.address`, else `$RAY_ADDRESS`, else
    start a Ray instance on this machine; once per process. The SIGINT and SIGTERM
    handlers in force before are put back (Ray's driver sets its own SIGTERM handler), so
    both still reach the run as an interrupt and teardown runs."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    address = settings.address or os.environ.get("RAY_ADDRESS") or None
    main = threading.current_thread() is threading.main_thread()
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in signals} if main else {}
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = address or "a local Ray instance"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cluster.launch.ray.address: cannot connect to {where}: {first}") from None
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # re-installed, so the C-level handler is Python's again
                signal.signal(signum, handler)
    atexit.register(_stop_live)  # after Ray's own exit hook, so it runs before it
    return ray


class RayInstance(InstanceHost):
    """The actor class: an InstanceHost that learns its node, address and GPUs from Ray."""

    def start_on_node(
        self, cluster: ClusterSpec, plan: Planner, index: int, *, host: str | None,
        label: str, grace_s: float,
    ) -> StartedInstance:  # fmt: skip
        import ray

        node_ip = ray.util.get_node_ip_address()
        gpu_ids = [int(g) for g in ray.get_gpu_ids()]
        return self.start(
            cluster, plan, index, host=host or node_ip, label=label, gpu_ids=gpu_ids,
            node_id=ray.get_runtime_context().get_node_id(), node_ip=node_ip, grace_s=grace_s,
        )  # fmt: skip


@dataclasses.dataclass
class _Actor:
    spec: InstanceSpec  # as planned in the driver: index, name, role, GPU count
    handle: Any
    request: dict[str, Any]  # the resources it asked Ray for (for messages)
    log_path: Path
    started: StartedInstance | None = None
    exit_ref: Any = None
    offset: int = 0  # bytes of the node's log already copied
    started_s: float = 0.0
    ready_s: float | None = None
    error: str | None = None


_LIVE: set[RayLauncher] = set()
_LIVE_LOCK = threading.Lock()


def _stop_live() -> None:
    with _LIVE_LOCK:
        launchers = list(_LIVE)
    for launcher in launchers:
        launcher.stop()


class RayLauncher:
    """Starts one actor per instance, waits for health, streams logs, stops them all.
    Implements `launchers.InstanceLauncher`; `stop()` is idempotent."""

    def __init__(
        self,
        log_dir: Path,
        cluster: ClusterSpec,
        plan: Planner,
        *,
        health_path: str = "/health",
        poll_interval_s: float = 0.5,
    ) -> None:
        self.log_dir = log_dir
        self.cluster = cluster
        self.plan = plan
        self.launch = cluster.launch
        self.settings = cluster.launch.ray
        self.health_path = health_path
        self.poll_interval_s = poll_interval_s
        self._actors: list[_Actor] = []
        self._pg: Any = None
        self._ray: ModuleType | None = None
        self._lock = threading.RLock()  # log copies and exit checks: pump thread and callers
        self._pump_stop = threading.Event()
        self._pump: threading.Thread | None = None
        self._failure: LaunchError | None = None

    @property
    def running(self) -> bool:
        return bool(self._actors)

    # ---- start ---------------------------------------------------------------------
    def start(self, specs: Sequence[InstanceSpec], *, label: str = "") -> list[Endpoint]:
        """Place an actor per planned instance, have each start its server on its node,
        wait until all are healthy. On any failure everything is stopped first."""
        self._ray = connect(self.settings)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.launch.ready_timeout_s
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._place(specs, deadline)
            self._start_servers(label, deadline)
            self._pump_stop.clear()
            self._pump = threading.Thread(target=self._pump_loop, name="btb-ray-logs",
                                          daemon=True)  # fmt: skip
            self._pump.start()
            self._wait_ready(deadline)
        except BaseException:
            self.stop()
            raise
        return [a.started.endpoint for a in self._actors if a.started is not None]

    def _bundle(self, spec: InstanceSpec) -> dict[str, float]:
        gpus = len(spec.gpus) if self.launch.device == "gpu" else 0
        bundle: dict[str, float] = {"CPU": self.settings.num_cpus}
        if gpus:
            bundle["GPU"] = float(gpus)
        bundle.update(_for_role(self.settings.resources, spec.role))
        return bundle

    def _place(self, specs: Sequence[InstanceSpec], deadline: float) -> None:
        ray = self._ray
        assert ray is not None
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles = [self._bundle(s) for s in specs]
        if self.settings.placement is not None:
            selectors = [_for_role(self.settings.label_selector, s.role) for s in specs]
            pg_args: dict[str, Any] = {"strategy": self.settings.placement}
            if any(selectors):
                pg_args["bundle_label_selector"] = selectors
            self._pg = ray.util.placement_group(bundles, **pg_args)
            if not self._pg.wait(max(1, int(deadline - time.monotonic()))):
                raise LaunchError(
                    f"cluster.launch.ray.placement: Ray could not place {len(bundles)} "
                    f"instance(s) {bundles} with strategy {self.settings.placement} within "
                    f"cluster.launch.ready_timeout_s ({self.launch.ready_timeout_s:g} s); "
                    f"{self._resources_text()}"
                )
        actor_class = ray.remote(RayInstance)
        for i, (spec, bundle) in enumerate(zip(specs, bundles, strict=True)):
            options: dict[str, Any] = {
                "num_cpus": bundle["CPU"],
                "num_gpus": bundle.get("GPU", 0),
                "max_restarts": 0,
                "max_concurrency": ACTOR_CONCURRENCY,
            }
            extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
            if extra:
                options["resources"] = extra
            if self._pg is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=i
                )
            elif _for_role(self.settings.label_selector, spec.role):
                options["label_selector"] = _for_role(self.settings.label_selector, spec.role)
            handle = actor_class.options(**options).remote(spec.name)
            path = self.log_dir / f"{spec.name}.log"
            self._actors.append(_Actor(spec, handle, bundle, path))

    def _start_servers(self, label: str, deadline: float) -> None:
        ray = self._ray
        assert ray is not None
        host = self.settings.host
        grace = self.launch.stop_grace_s
        refs = {
            a.handle.start_on_node.remote(self.cluster, self.plan, a.spec.index, host=host,
                                          label=label, grace_s=grace): a
            for a in self._actors
        }  # fmt: skip
        pending = list(refs)
        while pending:
            timeout = max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=timeout)
            for ref in ready:
                actor = refs[ref]
                try:
                    actor.started = ray.get(ref)
                except Exception as exc:
                    raise LaunchError(
                        f"instance {actor.spec.name}: its Ray actor could not start the "
                        f"server: {_first_line(exc)}"
                    ) from None
                actor.started_s = time.monotonic()
                actor.exit_ref = actor.handle.wait_exit.remote()
            if pending and time.monotonic() >= deadline:
                late = ", ".join(f"{refs[r].spec.name} {refs[r].request}" for r in pending)
                raise LaunchError(
                    f"Ray did not place instance(s) {late} within "
                    f"cluster.launch.ready_timeout_s ({self.launch.ready_timeout_s:g} s); "
                    f"{self._resources_text()}"
                )

    def _resources_text(self) -> str:
        ray = self._ray
        assert ray is not None
        try:
            total = ray.cluster_resources()
            free = ray.available_resources()
        except Exception:
            return "the cluster's resources are unknown"
        shown = {k: v for k, v in sorted(total.items()) if not k.startswith("node:")}
        free_shown = {k: free.get(k, 0.0) for k in shown if not k.endswith("memory")}
        return f"the cluster has {shown}, free {free_shown}"

    def _wait_ready(self, deadline: float) -> None:
        import httpx

        with httpx.Client(timeout=httpx.Timeout(2.0), trust_env=False) as client:
            while True:
                self._check_exits()
                pending = [a for a in self._actors if a.ready_s is None]
                for actor in pending:
                    if actor.error is not None:
                        raise LaunchError(self._error_text(actor, "before it was ready"))
                if not pending:
                    return
                for actor in pending:
                    assert actor.started is not None
                    try:
                        resp = client.get(actor.started.endpoint.base_url + self.health_path)
                    except httpx.HTTPError:
                        continue
                    if resp.status_code == 200:
                        actor.ready_s = time.monotonic() - actor.started_s
                        with contextlib.suppress(Exception):
                            actor.handle.remember_descendants.remote()
                if time.monotonic() > deadline:
                    late = [a for a in self._actors if a.ready_s is None]
                    self._copy_logs()
                    raise LaunchError(
                        f"instance(s) {', '.join(a.spec.name for a in late)} not ready after "
                        f"{self.launch.ready_timeout_s:g} s (cluster.launch.ready_timeout_s); "
                        f"last lines of {late[0].log_path}:\n{tail_lines(late[0].log_path)}"
                    )
                time.sleep(min(self.poll_interval_s, 0.5))

    # ---- while running ------------------------------------------------------------------
    def _pump_loop(self) -> None:
        while not self._pump_stop.wait(self.poll_interval_s):
            with contextlib.suppress(Exception):  # a lost node must not stop the others' logs
                self._copy_logs()
                self._check_exits()

    def _copy_logs(
        self, actors: Sequence[_Actor] | None = None, timeout_s: float = CALL_TIMEOUT_S
    ) -> None:
        """Append what each actor's server log has grown by to `instances/NAME.log`
        (by default every actor not lost)."""
        ray = self._ray
        assert ray is not None
        with self._lock:
            if actors is None:
                actors = [a for a in self._actors if a.error is None]
            live = [a for a in actors if a.started is not None]
            while live:
                refs = {a.handle.read_log.remote(a.offset): a for a in live}
                ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
                more = []
                for ref in ready:
                    actor = refs[ref]
                    try:
                        data: bytes = ray.get(ref)
                    except Exception:
                        continue  # a lost actor: its exit check says why
                    if data:
                        with actor.log_path.open("ab") as fh:
                            fh.write(data)
                        actor.offset += len(data)
                    if len(data) >= LOG_CHUNK_BYTES:
                        more.append(actor)
                live = more

    def _check_exits(self) -> None:
        """Turn servers that exited and actors that died into instance errors."""
        ray = self._ray
        assert ray is not None
        with self._lock:
            watching = {a.exit_ref: a for a in self._actors if a.exit_ref is not None
                        and a.error is None}  # fmt: skip
            if not watching:
                return
            done, _ = ray.wait(list(watching), num_returns=len(watching), timeout=0)
            for ref in done:
                actor = watching[ref]
                try:
                    code = ray.get(ref, timeout=CALL_TIMEOUT_S)
                except Exception as exc:
                    actor.error = self._death_cause(actor, exc)
                else:
                    actor.error = f"exited with code {code}"
                    with contextlib.suppress(Exception):
                        self._copy_logs([actor])
                if self._failure is None:
                    self._failure = LaunchError(self._error_text(actor, "during the run"))

    def _death_cause(self, actor: _Actor, exc: BaseException) -> str:
        ray = self._ray
        assert ray is not None
        assert actor.started is not None
        node = actor.started.node_id or "?"
        where = f"node {node[:12]} ({actor.started.node_ip})"
        with contextlib.suppress(Exception):
            alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
            if alive.get(node) is False:
                where += ", which Ray reports dead"
        return f"lost its Ray actor on {where}: {_first_line(exc)}"

    def _error_text(self, actor: _Actor, when: str) -> str:
        return (
            f"instance {actor.spec.name} {actor.error} {when}; last lines of "
            f"{actor.log_path}:\n{tail_lines(actor.log_path)}"
        )

    def failure(self) -> LaunchError | None:
        return self._failure

    def check_alive(self) -> None:
        self._check_exits()
        if self._failure is not None:
            raise self._failure

    def sampler(self, endpoints: Sequence[Endpoint], interval_s: float, device: str,
                now: Callable[[], float]) -> Sampler:  # fmt: skip
        assert self._ray is not None
        handles = [a.handle for a in self._actors if a.started is not None and a.error is None]
        return RaySampler(self._ray, handles, interval_s, device, now,
                          pull_every_s=max(interval_s, self.poll_interval_s))  # fmt: skip

    def facts(self) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for a in self._actors:
            started = a.started
            out.append({
                "name": a.spec.name,
                "role": a.spec.role,
                "url": None if started is None else started.endpoint.base_url,
                "gpus": [] if started is None else list(started.spec.gpus),
                "ready_s": None if a.ready_s is None else round(a.ready_s, 3),
                "pid": None if started is None else started.pid,
                "command": [] if started is None else list(started.spec.command),
                "log": str(a.log_path),
                "launcher": "ray",
                "node_id": None if started is None else started.node_id,
                "node_ip": None if started is None else started.node_ip,
                "ray_resources": dict(a.request),
                "bootstrap_url": None if started is None else started.endpoint.bootstrap_url,
            })  # fmt: skip
        return out

    # ---- stop ----------------------------------------------------------------------
    def stop(self) -> None:
        """Every actor stops its server's tree (TERM, grace, KILL); the rest of each log
        is copied; then the actors are killed and the placement group removed."""
        self._pump_stop.set()
        if self._pump is not None:
            self._pump.join(timeout=CALL_TIMEOUT_S + 5)
            self._pump = None
        with self._lock:
            actors, self._actors = self._actors, []
        ray = self._ray
        if ray is not None and actors:
            grace = self.launch.stop_grace_s
            live = [a for a in actors if a.error is None or a.error.startswith("exited")]
            refs = [a.handle.stop.remote(grace) for a in live if a.started is not None]
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=grace + CALL_TIMEOUT_S)
            with contextlib.suppress(Exception):
                self._copy_logs(live, timeout_s=5.0)  # the last lines, up to the exit
            cleanups = [a.handle.cleanup.remote() for a in live if a.started is not None]
            with contextlib.suppress(Exception):
                ray.wait(cleanups, num_returns=len(cleanups), timeout=5.0)
            for a in actors:
                with contextlib.suppress(Exception):
                    ray.kill(a.handle, no_restart=True)
        if ray is not None and self._pg is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self._pg)
        self._pg = None
        with _LIVE_LOCK:
            _LIVE.discard(self)


class RaySampler(Sampler):
    """Each actor samples its instance on its node (NVML or psutil) every `interval_s`;
    this pulls the samples every `pull_every_s` and moves their times from the node's
    clock onto the run's (the offset measured at each pull, half its round trip off)."""

    def __init__(
        self, ray: ModuleType, handles: Sequence[Any], interval_s: float, device: str,
        now: Callable[[], float], *, pull_every_s: float,
    ) -> None:  # fmt: skip
        super().__init__(pull_every_s, now)
        self.ray = ray
        self.handles = list(handles)
        self.sample_interval_s = interval_s
        self.device = device
        self.source = "none"

    def _setup(self) -> None:
        refs = [h.start_sampling.remote(self.sample_interval_s, self.device)
                for h in self.handles]  # fmt: skip
        sources = sorted(set(self.ray.get(refs, timeout=CALL_TIMEOUT_S))) if refs else []
        self.source = ",".join(sources) if sources else "none"

    def _pull(self, method: str) -> list[UtilSample]:
        sent = self.now()
        refs = [getattr(h, method).remote() for h in self.handles]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=CALL_TIMEOUT_S)
        received = self.now()
        mid = (sent + received) / 2.0
        out: list[UtilSample] = []
        for ref in ready:
            try:
                samples, node_now = self.ray.get(ref)
            except Exception:
                continue  # a lost actor: the launcher reports it
            out.extend(dataclasses.replace(s, time_s=mid - (node_now - s.time_s)) for s in samples)
        return out

    def sample(self) -> list[UtilSample]:
        return self._pull("take_samples")

    def _teardown(self) -> None:
        self.samples.extend(self._pull("stop_sampling"))
        self.samples.sort(key=lambda s: (s.time_s, s.instance))


def _for_role(per_role: Mapping[Any, Mapping[str, V]], role: str) -> dict[str, V]:
    """The settings of one role from a per-role mapping (empty when it has none)."""
    return dict(per_role.get(role, {}))


def _first_line(exc: BaseException) -> str:
    """A Ray error's cause in one line (Ray's messages run over many lines): the error
    raised inside the actor, or the sentence that says why an actor died."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    why = [ln for ln in lines if "because" in ln or ln.startswith(type(exc).__name__)]
    text = (why or lines or [""])[-1]
    return f"{type(exc).__name__}: {text}"[:400]
