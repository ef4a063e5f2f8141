"""`btb-lab sim bench`: simulator speed and memory on a fixed, seeded workload.

The workload is generated here (Poisson arrivals, requests drawn from a pool of shared
prefixes plus a private suffix block) so the figure depends on nothing but the engine
and the router: 4 instances of 4×H100 serving llama-3.3-70b, `at_admission` visibility,
cache-aware routing.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from btb_lab.config.costs import CostSettings
from btb_lab.config.sim import SimSettings
from btb_lab.model.costmodel import RooflineCostModel
from btb_lab.model.hardware import GPU_PRESETS, MODEL_PRESETS, InstanceSpec, make_instance
from btb_lab.policies.base import ClusterView, Decision, Policy, build_policy
from btb_lab.records import Request, RequestRecord
from btb_lab.sim.backend import run_engine

__all__ = ["BenchCacheAware", "BenchResult", "bench_instances", "bench_workload", "run_bench"]

BENCH_SEED = 20260523
TRACE_LIMIT = 200_000


def bench_workload(
    n_requests: int,
    *,
    seed: int = BENCH_SEED,
    rate_per_s: float = 24.0,
    prefixes: int = 64,
    block_tokens: int = 512,
) -> list[Request]:
    """Poisson arrivals; each request shares one of `prefixes` prefixes (1–8 blocks, Zipf-
    like popularity) and adds one private block; outputs of 16–512 tokens."""
    rng = random.Random(seed)
    prefix_len = [rng.randint(1, 8) for _ in range(prefixes)]
    weights = [1.0 / (k + 1) for k in range(prefixes)]
    cum: list[float] = []
    acc = 0.0
    for w in weights:
        acc += w
        cum.append(acc)
    out: list[Request] = []
    t = 0.0
    for i in range(n_requests):
        t += rng.expovariate(rate_per_s)
        g = _pick(cum, rng.random() * acc)
        nb = prefix_len[g]
        hashes = (*((g << 32) | j for j in range(nb)), (1 << 62) | i)
        out.append(
            Request(
                request_id=str(i),
                arrival_s=t,
                input_tokens=(nb + 1) * block_tokens,
                output_tokens=rng.randint(16, 512),
                block_hashes=hashes,
                block_tokens=block_tokens,
                group_id=str(g),
                source="bench",
            )
        )
    return out


def _pick(cum: Sequence[float], x: float) -> int:
    lo, hi = 0, len(cum) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cum[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


class BenchCacheAware(Policy):
    """The seed's cache-aware rule in a few lines: longest prefix match, ties by load then
    index; least-load when max load > 64 and > 1.5 × min load."""

    name: ClassVar[str] = "bench_cache_aware"

    def route(self, request: Request, view: ClusterView) -> Decision:
        insts = view.instances
        loads = [i.running + i.waiting for i in insts]
        hi, lo = max(loads), min(loads)
        if hi > 64 and hi > 1.5 * lo:
            return Decision(loads.index(lo), "BALANCE")
        match = view.match_blocks
        blocks = request.block_hashes
        best = 0
        best_key = (1, 0, 0)
        for k, load in enumerate(loads):
            key = (-match(k, blocks), load, k)
            if key < best_key or k == 0:
                best_key = key
                best = k
        return Decision(best, "CACHE_HIT" if best_key[0] < 0 else "COLD")


def bench_instances() -> list[InstanceSpec]:
    h100 = GPU_PRESETS["H100"]
    llama = MODEL_PRESETS["llama-3.3-70b"]
    return [make_instance(i, f"C{i}", "C", h100, 4, llama) for i in range(4)]


@dataclass
class BenchResult:
    requests: int
    policy: str
    runs_s: list[float]
    requests_per_s: float  # median of the runs (wall clock)
    requests_per_cpu_s: float  # median over process CPU time (robust on a shared machine)
    peak_rss_bytes: int  # process high-water mark (resource.getrusage)
    peak_traced_bytes: int  # Python allocations in one run (tracemalloc; 0 above TRACE_LIMIT)
    events: int
    simulated_s: float


def run_bench(n_requests: int = 200_000, *, repeats: int = 3, policy: str = "") -> BenchResult:
    """Median simulated requests/s over `repeats` runs, then one traced run for memory."""
    import resource

    requests = bench_workload(n_requests)
    costs = RooflineCostModel(bench_instances(), CostSettings())
    settings = SimSettings(kv_visibility="at_admission")
    runs: list[float] = []
    cpu_runs: list[float] = []
    events = 0
    end_s = 0.0
    name = policy or BenchCacheAware.name

    def make() -> Policy:
        return build_policy(policy) if policy else BenchCacheAware(BenchCacheAware.Params())

    for _ in range(repeats):
        kept: list[RequestRecord] = []
        gc.collect()
        t0 = time.perf_counter()
        c0 = time.process_time()
        _, stats, engine = run_engine(costs, settings, make(), requests, kept.append)
        runs.append(time.perf_counter() - t0)
        cpu_runs.append(time.process_time() - c0)
        events = int(stats["events"])
        end_s = engine.now
        if len(kept) != n_requests:
            raise AssertionError(f"bench lost requests: {len(kept)} of {n_requests}")
        del kept
    traced_peak = 0
    if n_requests <= TRACE_LIMIT:  # tracemalloc slows a run ~3×; RSS covers big ones
        tracemalloc.start()
        kept = []
        run_engine(costs, settings, make(), requests, kept.append)
        _, traced_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del kept
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return BenchResult(
        requests=n_requests,
        policy=name,
        runs_s=runs,
        requests_per_s=n_requests / statistics.median(runs),
        requests_per_cpu_s=n_requests / statistics.median(cpu_runs),
        peak_rss_bytes=int(rss_kib) * 1024,
        peak_traced_bytes=int(traced_peak),
        events=events,
        simulated_s=end_s,
    )
