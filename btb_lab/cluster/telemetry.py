"""Telemetry of a real run: per-GPU utilization and memory from NVML at 10 Hz, or, with no
NVML (no driver, CPU instances), each instance's process-tree CPU utilization from psutil
into the same UtilSample table; plus vLLM's Prometheus `/metrics`, scraped and parsed.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from btb_lab.records import UtilSample

if TYPE_CHECKING:
    from btb_lab.cluster.driver import ClientPool
    from btb_lab.cluster.launcher import Endpoint

__all__ = [
    "VLLM_METRICS",
    "NvmlSampler",
    "PsutilSampler",
    "Sampler",
    "cache_hit_rates",
    "kv_sources",
    "metrics_delta",
    "nvml_available",
    "parse_vllm_metrics",
    "scrape_all",
    "scrape_one",
]

# Our key → vLLM's metric family name (prometheus_client strips `_total` from counters).
VLLM_METRICS: dict[str, str] = {
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "external_prefix_cache_queries": "vllm:external_prefix_cache_queries",
    "external_prefix_cache_hits": "vllm:external_prefix_cache_hits",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
}
TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"
# Counters split by a `source` label: our key prefix per family. Prompt tokens by where
# their KV came from (local_compute, local_cache_hit, external_kv_transfer) and cached
# prompt tokens by tier (device, host, p2p, disk, external_unspecified).
BY_SOURCE: dict[str, str] = {
    "vllm:prompt_tokens_by_source": "prompt_tokens",
    "vllm:prompt_tokens_cached_by_source": "prompt_tokens_cached",
}
# NIXL connector histograms (key for the sum, key for the count) and counters.
NIXL_HISTOGRAMS: dict[str, tuple[str, str | None]] = {
    "vllm:nixl_xfer_time_seconds": ("nixl_xfer_s", "nixl_xfers"),
    "vllm:nixl_post_time_seconds": ("nixl_post_s", None),
    "vllm:nixl_bytes_transferred": ("nixl_bytes", None),
}
NIXL_COUNTERS: dict[str, str] = {
    "vllm:nixl_num_failed_transfers": "nixl_failed_transfers",
    "vllm:nixl_num_failed_notifications": "nixl_failed_notifications",
}


def parse_vllm_metrics(text: str) -> dict[str, Any]:
    """The vLLM metrics we use, summed over label sets (engines, models). The TTFT
    histogram comes back as `ttft_count`, `ttft_sum` and cumulative `ttft_buckets`;
    by-source counters as `prompt_tokens_<source>` / `prompt_tokens_cached_<source>`;
    NIXL's transfer histograms as sums (`nixl_xfer_s`, `nixl_bytes`, …) and counts."""
    from prometheus_client.parser import text_string_to_metric_families

    # vLLM's multiprocess exposition declares counters as `<name>_total`, the plain
    # exposition as `<name>`: accept both spellings of every family.
    wanted = {family: key for key, family in VLLM_METRICS.items()}
    wanted.update(NIXL_COUNTERS)
    wanted.update({f"{family}_total": key for family, key in list(wanted.items())})
    by_source = {**BY_SOURCE, **{f"{f}_total": k for f, k in BY_SOURCE.items()}}
    out: dict[str, Any] = {}
    buckets: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in wanted:
            key = wanted[family.name]
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                out[key] = out.get(key, 0.0) + float(sample.value)
        elif family.name in by_source:
            prefix = by_source[family.name]
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                key = f"{prefix}_{sample.labels.get('source', 'unknown')}"
                out[key] = out.get(key, 0.0) + float(sample.value)
        elif family.name in NIXL_HISTOGRAMS:
            sum_key, count_key = NIXL_HISTOGRAMS[family.name]
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    out[sum_key] = out.get(sum_key, 0.0) + float(sample.value)
                elif count_key is not None and sample.name.endswith("_count"):
                    out[count_key] = out.get(count_key, 0.0) + float(sample.value)
        elif family.name == TTFT_HISTOGRAM:
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    out["ttft_count"] = out.get("ttft_count", 0.0) + sample.value
                elif sample.name.endswith("_sum"):
                    out["ttft_sum"] = out.get("ttft_sum", 0.0) + sample.value
                elif sample.name.endswith("_bucket"):
                    le = sample.labels.get("le", "+Inf")
                    buckets[le] = buckets.get(le, 0.0) + sample.value
    if buckets:
        out["ttft_buckets"] = dict(sorted(buckets.items(), key=lambda kv: float(kv[0])))
    return out


def metrics_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """Counter growth between two scrapes; gauges keep their end value."""
    gauges = {"running", "waiting", "kv_cache_usage"}
    out: dict[str, Any] = {}
    for key, value in after.items():
        if isinstance(value, dict):
            continue
        out[key] = value if key in gauges else value - float(before.get(key, 0.0))
    return out


def cache_hit_rates(delta: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """Per-instance prefix-cache hit rate over the run (hits / queries, in tokens)."""
    out: dict[str, float | None] = {}
    for name, d in delta.items():
        queries = float(d.get("prefix_cache_queries", 0.0))
        out[name] = float(d.get("prefix_cache_hits", 0.0)) / queries if queries > 0 else None
    return out


def kv_sources(delta: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Per instance over the run: prompt tokens served from its local prefix cache, from
    KV that arrived through the connector, and computed there (vLLM's by-source counters;
    engines without them fall back to the prefix-cache counters), plus what the NIXL
    connector moved into it (bytes, transfer time, transfers, failures)."""
    out: dict[str, dict[str, float]] = {}
    for name, d in sorted(delta.items()):
        prompt = float(d.get("prompt_tokens", 0.0))
        if "prompt_tokens_local_compute" in d:
            local = float(d.get("prompt_tokens_local_cache_hit", 0.0))
            external = float(d.get("prompt_tokens_external_kv_transfer", 0.0))
            computed = float(d.get("prompt_tokens_local_compute", 0.0))
        else:
            local = float(d.get("prefix_cache_hits", 0.0))
            external = float(d.get("external_prefix_cache_hits", 0.0))
            computed = max(0.0, prompt - local - external)
        out[name] = {
            "prompt_tokens": prompt,
            "local_hit_tokens": local,
            "external_hit_tokens": external,
            "computed_tokens": computed,
            "kv_bytes": float(d.get("nixl_bytes", 0.0)),
            "kv_transfer_s": float(d.get("nixl_xfer_s", 0.0)),
            "kv_transfers": float(d.get("nixl_xfers", 0.0)),
            "kv_failed_transfers": float(d.get("nixl_failed_transfers", 0.0)),
        }
    return out


async def scrape_one(client: ClientPool, endpoint: Endpoint) -> dict[str, Any]:
    """One instance's parsed /metrics, or {"error": <name>} (telemetry never fails a run)."""
    try:
        resp = await client.get(endpoint.base_url + "/metrics")
        resp.raise_for_status()
        return parse_vllm_metrics(resp.text)
    except Exception as exc:
        return {"error": type(exc).__name__}


async def scrape_all(
    client: ClientPool, endpoints: Sequence[Endpoint]
) -> dict[str, dict[str, Any]]:
    """Scrape and parse every instance's /metrics; an unreachable one maps to {"error"}."""
    import asyncio

    async def one(ep: Endpoint) -> tuple[str, dict[str, Any]]:
        return ep.name, await scrape_one(client, ep)

    return dict(await asyncio.gather(*(one(ep) for ep in endpoints)))


def nvml_available() -> bool:
    """True when the NVML library loads and sees at least one GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount()) > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return False


class Sampler:
    """A background thread sampling every `interval_s` into a list of UtilSamples."""

    source = "none"

    def __init__(self, interval_s: float, now: Callable[[], float]) -> None:
        self.interval_s = interval_s
        self.now = now
        self.samples: list[UtilSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> list[UtilSample]:
        raise NotImplementedError

    def _loop(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a vanished process must not stop sampling
                self.samples.extend(self.sample())
            next_t += self.interval_s
            self._stop.wait(max(0.0, next_t - time.monotonic()))

    def start(self) -> None:
        self._setup()
        self._thread = threading.Thread(target=self._loop, name="btb-telemetry", daemon=True)
        self._thread.start()

    def _setup(self) -> None:
        return None

    def stop(self) -> list[UtilSample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._teardown()
        return self.samples

    def _teardown(self) -> None:
        return None


class NvmlSampler(Sampler):
    """Per-GPU utilization (0–1) and used memory; `gpu_owner` maps GPU index → instance."""

    source = "nvml"

    def __init__(
        self, gpu_owner: Mapping[int, str], interval_s: float, now: Callable[[], float]
    ) -> None:
        super().__init__(interval_s, now)
        self.gpu_owner = dict(gpu_owner)
        self._handles: dict[int, Any] = {}

    def _setup(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        count = int(pynvml.nvmlDeviceGetCount())
        gpus = sorted(self.gpu_owner) or list(range(count))
        self._handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in gpus if i < count}

    def sample(self) -> list[UtilSample]:
        import pynvml

        t = self.now()
        out = []
        for idx, handle in self._handles.items():
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(
                UtilSample(
                    time_s=t,
                    instance=self.gpu_owner.get(idx, f"gpu{idx}"),
                    device=f"gpu{idx}",
                    utilization=float(util.gpu) / 100.0,
                    memory_bytes=float(mem.used),
                    source="nvml",
                )
            )
        return out

    def _teardown(self) -> None:
        import pynvml

        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


class PsutilSampler(Sampler):
    """CPU utilization of each instance's whole process tree, as a share of all logical
    CPUs (0–1), and its resident memory."""

    source = "psutil"

    def __init__(
        self, root_pids: Mapping[str, int], interval_s: float, now: Callable[[], float]
    ) -> None:
        super().__init__(interval_s, now)
        self.root_pids = dict(root_pids)
        self._procs: dict[str, dict[int, Any]] = {name: {} for name in self.root_pids}
        self._cpus = os.cpu_count() or 1

    def _tree(self, name: str) -> list[Any]:
        import psutil

        known = self._procs[name]
        try:
            root = psutil.Process(self.root_pids[name])
            current = [root, *root.children(recursive=True)]
        except psutil.Error:
            return []
        for proc in current:
            if proc.pid not in known:
                with contextlib.suppress(psutil.Error):
                    proc.cpu_percent(None)  # prime: the first reading is always 0
                known[proc.pid] = proc
        alive = {p.pid for p in current}
        for pid in list(known):
            if pid not in alive:
                del known[pid]
        return list(known.values())

    def _setup(self) -> None:
        for name in self.root_pids:
            self._tree(name)

    def sample(self) -> list[UtilSample]:
        import psutil

        t = self.now()
        out = []
        for name in self.root_pids:
            cpu = 0.0
            rss = 0.0
            for proc in self._tree(name):
                with contextlib.suppress(psutil.Error):
                    cpu += proc.cpu_percent(None)
                    rss += proc.memory_info().rss
            out.append(
                UtilSample(
                    time_s=t,
                    instance=name,
                    device="proc",
                    utilization=min(1.0, cpu / 100.0 / self._cpus),
                    memory_bytes=rss,
                    source="psutil",
                )
            )
        return out
