"""The Backend interface: one implementation per world (sim, cluster), chosen by name.

The orchestrator (`btb_lab.runner`) calls `run_variant` once per variant × repeat with
the requests to replay; the backend streams RequestRecords into the sink as they
finish (so an interrupt never loses finished rows) and returns utilization samples
plus the settings that describe its fidelity.

Backends are imported on first use (the cluster backend pulls in httpx and the launcher),
through the explicit factories of `BACKENDS`, so every import stays visible to mypy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from btb_lab.records import Request, RequestRecord, UtilSample
from btb_lab.registry import Registry

if TYPE_CHECKING:
    from btb_lab.config.hypothesis import Hypothesis, Variant
    from btb_lab.model.costmodel import RooflineCostModel

__all__ = ["BACKENDS", "Backend", "BackendResult", "RecordSink", "RunContext", "get_backend"]


class RecordSink(Protocol):
    """Where finished records go; writes are durable once `write` returns."""

    def write(self, records: Iterable[RequestRecord]) -> None: ...


@dataclass
class RunContext:
    """Everything one variant × repeat needs besides its requests. `hypothesis` is already
    resolved for the variant (`config.resolve_variant`): backends read its top-level
    `sim`, `costs` and `cluster` blocks only. `costs` is the variant's cost model, built
    once by the runner and shared by the engine and the policies."""

    hypothesis: Hypothesis
    variant_name: str
    variant: Variant
    repeat: int
    seed: int
    run_dir: Path
    sink: RecordSink
    costs: RooflineCostModel
    # progress(done_requests, total_requests); called from the backend's own loop
    progress: Callable[[int, int], None] = lambda done, total: None


@dataclass
class BackendResult:
    utilization: list[UtilSample] = field(default_factory=list)
    # every setting that shapes the numbers (recorded in manifest and report)
    fidelity: dict[str, Any] = field(default_factory=dict)
    telemetry_source: str = "sim"  # sim | nvml | psutil
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. per-instance /metrics


class Backend(Protocol):
    """A backend may also define `close()`; the runner calls it once after the last
    variant (or on error / Ctrl-C) so instances reused across variants are stopped."""

    name: str

    def run_variant(self, ctx: RunContext, requests: list[Request]) -> BackendResult: ...


def _sim() -> Backend:
    from btb_lab.sim.backend import SimBackend

    return SimBackend()


def _cluster() -> Backend:
    from btb_lab.cluster.backend import ClusterBackend

    return ClusterBackend()


BACKENDS: Registry[Callable[[], Backend]] = Registry("backend")
BACKENDS.add("sim", _sim)
BACKENDS.add("cluster", _cluster)


def get_backend(name: str) -> Backend:
    """A new backend by name (an unknown name is a UserError listing the known ones)."""
    return BACKENDS.get(name)()
