"""Load-driver benchmark: drive a local fast fake OpenAI server (its own process, so it
gets its own core) with short requests at a fixed rate through the real router + driver
path, and report the sustained request rate and the driver's send lag.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from btb_lab.cluster.driver import LoadDriver, RunClock, event_loop_name, run_async
from btb_lab.cluster.launcher import Endpoint, ProcessTree, free_port
from btb_lab.cluster.router import Router
from btb_lab.config.base import StrictModel
from btb_lab.policies.base import ClusterView, Decision, NoParams, Policy
from btb_lab.records import Request, RequestRecord

__all__ = ["BenchResult", "CountingSink", "bench_requests", "run_bench"]


class CountingSink:
    """Keeps records in memory (the benchmark measures the driver, not storage)."""

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def write(self, records: Iterable[RequestRecord]) -> None:
        self.records.extend(records)


class _OnlyInstance(Policy):
    """Always instance 0: the benchmark has one endpoint."""

    name: ClassVar[str] = "bench_only"
    Params: ClassVar[type[StrictModel]] = NoParams

    def route(self, request: Request, view: ClusterView) -> Decision:
        return Decision(instance=0, route="BENCH")


class _ZeroCosts:
    def prefill_s(self, instance: int, tokens: int, cached_tokens: int = 0) -> float:
        return 0.0

    def transfer_s(self, tokens: int, source: int, target: int) -> float:
        return 0.0


def bench_requests(
    n: int, rate_rps: float, *, input_tokens: int = 32, output_tokens: int = 4
) -> list[Request]:
    """Evenly spaced short requests (deterministic: no randomness needed)."""
    gap_s = 1.0 / rate_rps
    return [
        Request(
            request_id=f"b{i}",
            arrival_s=i * gap_s,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            block_tokens=16,
        )
        for i in range(n)
    ]


@dataclass
class BenchResult:
    requests: int
    target_rate_rps: float
    sustained_rps: float
    ok: int
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    duration_s: float
    loop: str

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


async def _drive(url: str, requests: Sequence[Request]) -> tuple[Any, CountingSink]:
    from btb_lab.cluster.backend import make_client

    clock = RunClock()
    sink = CountingSink()
    async with make_client(
        request_timeout_s=30.0, connect_timeout_s=10.0, max_connections=1024
    ) as client:
        router = Router(
            [Endpoint(0, "fake0", "C", url)],
            _OnlyInstance(NoParams()),
            _ZeroCosts(),
            client=client,
            clock=clock,
            model="fake-model",
            prompt_fn=lambda r: list(range(100, 100 + r.input_tokens)),
            variant="bench",
        )
        await client.warm([url])
        stats = await LoadDriver(router.dispatch, sink, clock).run(requests)
    return stats, sink


def run_bench(
    *, requests: int = 3000, rate_rps: float = 600.0, output_tokens: int = 4
) -> BenchResult:
    """Start the fake server, drive it, stop it; returns what the driver measured."""
    import httpx

    port = free_port()
    proc = subprocess.Popen(  # argument list, never a shell string
        [sys.executable, "-m", "btb_lab.cluster.fake_server", "--port", str(port)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    tree = ProcessTree(proc, "fake")
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError("the fake server exited at start")
            try:
                if httpx.get(url + "/health", timeout=1.0, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        reqs = bench_requests(requests, rate_rps, output_tokens=output_tokens)
        stats, sink = run_async(_drive(url, reqs))
    finally:
        tree.stop(5.0)
    return BenchResult(
        requests=requests,
        target_rate_rps=rate_rps,
        sustained_rps=round(stats.rate_rps, 1),
        ok=sum(1 for r in sink.records if r.ok),
        lag_p50_ms=round(stats.lag_p50_ms, 3),
        lag_p99_ms=round(stats.lag_p99_ms, 3),
        lag_max_ms=round(stats.lag_max_ms, 3),
        duration_s=round(stats.duration_s, 3),
        loop=event_loop_name(),
    )
