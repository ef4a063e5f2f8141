"""Workloads: trace formats, seeded generators, time scaling, prompts and the burst audit.

Other stages call `load_requests(spec, base_dir=..., seed=...)` for the requests to
replay and `validate_workload_spec(spec, base_dir)` at validate time; `FORMATS` and
`GENERATORS` list what a hypothesis may name.
"""

from __future__ import annotations

from btb_lab.workload import seed_windows
from btb_lab.workload.formats import FORMATS, LoadedTrace, load_trace
from btb_lab.workload.generators import GENERATORS, GenContext, generate, parse_params
from btb_lab.workload.loader import (
    RequestList,
    apply_time_scale,
    load_requests,
    validate_workload_spec,
)

__all__ = [
    "FORMATS",
    "GENERATORS",
    "GenContext",
    "LoadedTrace",
    "RequestList",
    "apply_time_scale",
    "generate",
    "load_requests",
    "load_trace",
    "parse_params",
    "seed_windows",
    "validate_workload_spec",
]
