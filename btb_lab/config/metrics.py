"""Metric definitions: one small typed record per metric a hypothesis may name.

The verdict engine, the loader's validation, the report and the sweep tables all read a
metric through its definition (column, statistic, unit, direction, label, level) instead of
parsing its name. The formulas follow vLLM's benchmark (ARCHITECTURE.md): TTFT = first
token − send, E2E = last token − send, TPOT = (E2E − TTFT) / (output tokens − 1) for
outputs longer than one token; latency statistics use successful requests only; OK rate is
over requests sent; GPU imbalance is max / min of per-GPU (sim: per-instance) mean
utilization, with std and max of the same means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from btb_lab.errors import UserError

__all__ = [
    "GPU_METRIC_NAMES",
    "LATENCIES",
    "LATENCY_STATS",
    "METRICS",
    "METRIC_NAMES",
    "REQUEST_METRIC_NAMES",
    "MetricDef",
    "get_metric",
]

LATENCIES: tuple[str, ...] = ("ttft", "tpot", "e2e")
LATENCY_STATS: tuple[str, ...] = ("p50", "p90", "p95", "p99", "mean")

MetricKind = Literal["latency", "ok_rate", "cache_hit_rate", "gpu"]


@dataclass(frozen=True, slots=True)
class MetricDef:
    """One metric. `column` is the request column it is computed over (latencies), `statistic`
    how (p50…p99 or mean for latencies; the GPU summary's key for GPU metrics)."""

    name: str
    label: str  # the seed log's style: TTFT90, E2Emean, OK rate
    kind: MetricKind
    level: Literal["request", "gpu"]  # request metrics can be restricted to a class
    column: str | None
    statistic: str
    unit: str  # s, fraction, x (ratio)
    higher_is_better: bool
    description: str

    @property
    def percentile(self) -> float | None:
        """The percentile of a latency percentile metric (90.0 for ttft_p90), else None."""
        if self.kind == "latency" and self.statistic.startswith("p"):
            return float(self.statistic[1:])
        return None


def _latency(lat: str, stat: str) -> MetricDef:
    label = lat.upper() + (stat[1:] if stat.startswith("p") else stat)
    what = {"ttft": "time to first token", "tpot": "time per output token",
            "e2e": "end-to-end latency"}[lat]  # fmt: skip
    how = "mean" if stat == "mean" else f"{stat[1:]}th percentile"
    return MetricDef(
        name=f"{lat}_{stat}", label=label, kind="latency", level="request",
        column=f"{lat}_s", statistic=stat, unit="s", higher_is_better=False,
        description=f"{how} of the {what} of successful requests, seconds",
    )  # fmt: skip


_ALL: tuple[MetricDef, ...] = (
    *(_latency(lat, stat) for lat in LATENCIES for stat in LATENCY_STATS),
    MetricDef("ok_rate", "OK rate", "ok_rate", "request", "ok", "mean", "fraction", True,
              "requests that completed without error or timeout / requests sent"),
    MetricDef("cache_hit_rate", "cache hit rate", "cache_hit_rate", "request", "cached_tokens",
              "ratio", "fraction", True, "cached prompt tokens / prompt tokens of the requests "
              "sent (a failed request's prompt counts as uncached)"),
    MetricDef("gpu_imbalance", "GPU imbalance", "gpu", "gpu", None, "imbalance", "x", False,
              "max / min of per-GPU (sim: per-instance) mean utilization"),
    MetricDef("gpu_std", "GPU std", "gpu", "gpu", None, "std", "fraction", False,
              "population std of per-GPU mean utilization"),
    MetricDef("gpu_max", "GPU max", "gpu", "gpu", None, "max", "fraction", False,
              "largest per-GPU mean utilization"),
)  # fmt: skip

METRICS: dict[str, MetricDef] = {m.name: m for m in _ALL}
METRIC_NAMES: tuple[str, ...] = tuple(METRICS)
REQUEST_METRIC_NAMES: tuple[str, ...] = tuple(m.name for m in _ALL if m.level == "request")
GPU_METRIC_NAMES: tuple[str, ...] = tuple(m.name for m in _ALL if m.level == "gpu")


def get_metric(name: str) -> MetricDef:
    """The definition of a metric, or a UserError listing the valid names."""
    try:
        return METRICS[name]
    except KeyError:
        raise UserError(
            f"unknown metric {name!r}; choose one of: {', '.join(METRIC_NAMES)}"
        ) from None
