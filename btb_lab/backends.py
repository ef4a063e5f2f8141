"""The Backend interface: one implementation per world (sim, cluster).

The orchestrator (`btb_lab.runner`, which also holds the registry of backends by name)
calls `run_variant` once per variant × repeat with the requests to replay; the backend
streams RequestRecords into the sink as they finish (so an interrupt never loses finished
rows) and returns utilization samples, the events of the run (`EventRecord`) and the
settings that describe its fidelity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from btb_lab.records import EventRecord, Request, RequestRecord, UtilSample

if TYPE_CHECKING:
    from btb_lab.config.hypothesis import Hypothesis, Variant
    from btb_lab.model.costmodel import RooflineCostModel

__all__ = ["Backend", "BackendResult", "RecordSink", "RunContext"]


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
    # what happened over time (bursts, warm copies, KV transfers, queue and batch sizes)
    events: list[EventRecord] = field(default_factory=list)
    # every setting that shapes the numbers (recorded in manifest and report)
    fidelity: dict[str, Any] = field(default_factory=dict)
    telemetry_source: str = "sim"  # sim | nvml | psutil
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. per-instance /metrics


class Backend(Protocol):
    """A backend may also define `close()`; the runner calls it once after the last
    variant (or on error / Ctrl-C) so instances reused across variants are stopped. Its
    `record_format` (default "jsonl") picks the parts its records, utilization samples and
    events are written to (`results.RECORD_SINKS`; "arrow": Arrow IPC streams)."""

    name: str

    def run_variant(self, ctx: RunContext, requests: list[Request]) -> BackendResult: ...
