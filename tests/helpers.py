"""Shared by the reliability tests: the CLI's `main()` run in-process (its real exit code,
stdout and stderr, as a user sees them; typer's CliRunner skips `main()`'s error
handling), and a small hypothesis that the simulator runs in about a second.

These helpers use only the CLI and the package's public entry points, so the tests built
on them can also be pointed at an older checkout to show that they fail there.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = [
    "SMALL",
    "CliResult",
    "CountingGenerators",
    "cli",
    "cli_subprocess",
    "python_env",
    "raw_server",
    "read_http_request",
    "write_small",
]


@contextlib.contextmanager
def raw_server(handle: Callable[[socket.socket], None]) -> Iterator[str]:
    """A TCP server on 127.0.0.1 that runs `handle` on each accepted connection (in its
    own thread, the connection closed after): misbehaving HTTP servers, byte for byte.
    Yields its root URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    handlers: list[threading.Thread] = []

    def serve(conn: socket.socket) -> None:
        with conn:
            handle(conn)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=serve, args=(conn,), daemon=True)
            handlers.append(thread)
            thread.start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        # no thread outlives the server: a live thread makes later tests' processes
        # unsafe to fork (they skip, or draw in another way)
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
        listener.close()
        for thread in [acceptor, *handlers]:
            thread.join(timeout=5.0)


# Two instances, 60 Poisson requests, two variants: a full simulator run is about a second.
SMALL = """\
id: HS
title: Small hypothesis
claim: round robin is no worse than least load
backend: sim
model: llama-3.3-70b
cluster:
  instances:
    - {role: C, count: 2, gpu: H100, gpus: 4}
workload:
  generator:
    kind: poisson
    params: {requests: 60, rate_per_s: 4.0}
classes:
  - name: LONG
    when:
      - {field: input_tokens, op: ">=", value: 4000}
  - name: SHORT
variants:
  base:
    router: {policy: least_load}
  fast:
    router: {policy: round_robin}
baseline: base
repeats: 1
seed: 3
verdict:
  metric: ttft_p90
  direction: decrease
  min_effect: 0.05
  guards:
    - {metric: ok_rate, max_worse: 0.01}
  bootstrap_samples: 200
  min_ok_requests: 20
"""


def write_small(folder: Path, name: str = "hs.yaml", text: str = SMALL, **replace: str) -> Path:
    """The small hypothesis (with `old=new` replacements) written to `folder/name`."""
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


@dataclass
class CliResult:
    code: int | None  # None: main() raised instead of exiting (a traceback)
    out: str
    err: str

    @property
    def output(self) -> str:
        return self.out + self.err

    @property
    def traceback(self) -> bool:
        return self.code is None or "Traceback (most recent call last)" in self.output


def cli(*args: str | Path) -> CliResult:
    """`btb-lab ARGS` through `btb_lab.cli.main` in this process."""
    from btb_lab.cli import main

    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["btb-lab", *map(str, args)]
    code: int | None = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Exception:
                code = None
                err.write(traceback.format_exc())
    finally:
        sys.argv = argv
    return CliResult(code, out.getvalue(), err.getvalue())


def python_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python that imports the same btb_lab as this one."""
    import btb_lab

    env = dict(os.environ)
    package_root = str(Path(btb_lab.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


MAIN = "import sys; from btb_lab.cli import main; sys.argv = ['btb-lab', *sys.argv[1:]]; main()"


def cli_subprocess(
    *args: str | Path, cwd: Path | None = None, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """`btb-lab ARGS` in a child process (for signals and hang guards)."""
    return subprocess.run(
        [sys.executable, "-c", MAIN, *map(str, args)],
        capture_output=True, text=True, check=False, cwd=cwd, timeout=timeout_s,
        env=python_env(),
    )  # fmt: skip


class CountingGenerators:
    """A stand-in for `workload.loader.GENERATORS` that notes the seed of every workload
    a generator makes."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.seeds: list[int] = []

    def __contains__(self, kind: str) -> bool:
        return kind in self.real

    def names(self) -> list[str]:
        return list(self.real.names())

    def get(self, kind: str) -> Any:
        entry = self.real.get(kind)

        def generate(params: Any, ctx: Any) -> Any:
            self.seeds.append(ctx.seed)
            return entry.generate(params, ctx)

        return replace(entry, generate=generate)


def read_http_request(conn: socket.socket) -> bool:
    """Read one HTTP request (headers and Content-Length body); False at end of stream."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return False
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += conn.recv(65536)
    return True
