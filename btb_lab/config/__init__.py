"""Strict configuration models: the hypothesis schema and the blocks it is made of (workload,
simulator fidelity, cost model, real-cluster launch), metric definitions, and variant
resolution. This package imports nothing of the pipeline but pydantic (and the base
modules `errors`), so every stage can depend on it and it depends on none of them.

Import direction of the whole package (checked by tests/unit/test_architecture.py):
config ← workload, model, policies ← hypothesis (loader), sim, cluster ← runner ← sweep ← cli;
records ← results ← analysis ← report.
"""

from btb_lab.config.base import StrictModel
from btb_lab.config.costs import CostSettings
from btb_lab.config.hypothesis import (
    NUMERIC_FIELDS,
    ClassRule,
    ClusterSpec,
    Condition,
    Guard,
    Hypothesis,
    InstanceGroup,
    KVConnector,
    ModelShape,
    RouterSpec,
    SeedVerdict,
    Variant,
    VerdictRule,
)
from btb_lab.config.launch import LaunchSettings, RaySettings
from btb_lab.config.metrics import METRICS, MetricDef, get_metric
from btb_lab.config.sim import SimSettings
from btb_lab.config.variants import deep_merge, resolve_variant
from btb_lab.config.workload import GeneratorSpec, TraceSpec, WorkloadSpec

__all__ = [
    "METRICS",
    "NUMERIC_FIELDS",
    "ClassRule",
    "ClusterSpec",
    "Condition",
    "CostSettings",
    "GeneratorSpec",
    "Guard",
    "Hypothesis",
    "InstanceGroup",
    "KVConnector",
    "LaunchSettings",
    "MetricDef",
    "ModelShape",
    "RaySettings",
    "RouterSpec",
    "SeedVerdict",
    "SimSettings",
    "StrictModel",
    "TraceSpec",
    "Variant",
    "VerdictRule",
    "WorkloadSpec",
    "deep_merge",
    "get_metric",
    "resolve_variant",
]
