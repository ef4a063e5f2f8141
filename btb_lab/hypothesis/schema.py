"""The hypothesis file: a research claim as a typed, strict, falsifiable experiment.

Every field carries a description (shown by `btb-lab validate --explain` and in the
README's tour). Cross-field rules live in model validators.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import Field, model_validator

from btb_lab.cluster.settings import LaunchSettings
from btb_lab.config import StrictModel
from btb_lab.sim.settings import SimSettings
from btb_lab.workload.spec import WorkloadSpec

__all__ = [
    "ClassRule",
    "ClusterSpec",
    "Condition",
    "Guard",
    "Hypothesis",
    "InstanceGroup",
    "KVConnector",
    "ModelShape",
    "RouterSpec",
    "SeedVerdict",
    "Variant",
    "VerdictRule",
]


class ModelShape(StrictModel):
    """An explicit model shape, for models without a preset."""

    name: str = Field("custom", description="Display name.")
    params: float = Field(gt=0, description="Total parameters.")
    active_params: float | None = Field(
        None, gt=0, description="Parameters active per token (MoE); defaults to params."
    )
    dtype_bytes: float = Field(2, gt=0, description="Bytes per weight and KV element.")
    layers: int = Field(ge=1, description="Transformer layers.")
    kv_heads: int = Field(ge=1, description="KV heads (GQA groups).")
    head_dim: int = Field(ge=1, description="Dimension of one head.")


class InstanceGroup(StrictModel):
    role: Literal["C", "PS"] = Field(
        "C", description="C: co-located prefill+decode; PS: prefill service."
    )
    count: int = Field(1, ge=1, description="Instances of this role.")
    gpu: str = Field("H100", description="GPU preset (A100, H100, H200, B200, B300, MI300X).")
    gpus: int = Field(1, ge=1, description="GPUs per instance (tensor-parallel size).")


KVRole = Literal["kv_both", "kv_producer", "kv_consumer"]


class KVConnector(StrictModel):
    type: Literal["none", "nixl", "example", "mooncake"] = Field(
        "none",
        description="KV transfer connector: nixl (vLLM's NixlConnector, CPU or CUDA buffers), "
        "example (vLLM's ExampleConnector: KV handed over through a shared folder), mooncake.",
    )
    role: KVRole = Field("kv_both", description="vLLM kv_role of every instance.")
    roles: dict[Literal["C", "PS"], KVRole] = Field(
        default_factory=dict,
        description="kv_role per instance role, overriding `role` (e.g. PS: kv_producer).",
    )
    protocol: str = Field("rdma", description="Mooncake transport protocol (rdma, tcp).")
    kv_buffer_device: Literal["cpu", "cuda"] | None = Field(
        None,
        description="nixl: where KV is staged for transfer; defaults to cpu when "
        "cluster.launch.device is cpu, else cuda.",
    )
    nixl_progress_delay_us: int | None = Field(
        1000,
        ge=1,
        description="nixl: poll timeout of NIXL's UCX progress thread, which nixl's Python API "
        "sets to 0 (a busy loop costing a core per instance); null runs vLLM's stock "
        "NixlConnector unchanged.",
    )
    shared_storage_path: str | None = Field(
        None,
        description="example: folder the KV files go to (a fresh subfolder per launch, "
        "removed at teardown); defaults to the system temp folder.",
    )
    transfer_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Read timeout of each leg of a KV transfer (producer prefill, consumer "
        "fetch); a transfer that exceeds it is a failed request. Defaults to "
        "cluster.launch.request_timeout_s.",
    )
    attribute_transfers: bool = Field(
        True,
        description="Serialize the KV fetches into each instance (from the consumer request "
        "to its first token) so /metrics deltas give each request its own transferred tokens, "
        "bytes and transfer time; false lets fetches overlap and counts them per instance only.",
    )


class ClusterSpec(StrictModel):
    instances: list[InstanceGroup] = Field(
        default_factory=lambda: [InstanceGroup()], description="Instance groups by role."
    )
    kv_connector: KVConnector = Field(
        default_factory=KVConnector, description="KV connector on every instance."
    )
    launch: LaunchSettings = Field(
        default_factory=LaunchSettings, description="Real-cluster launch settings."
    )


class RouterSpec(StrictModel):
    policy: str = Field(description="Registered policy name (see `btb-lab list --policies`).")
    params: dict[str, Any] = Field(
        default_factory=dict, description="Policy parameters, validated by the policy."
    )


class Variant(StrictModel):
    router: RouterSpec = Field(description="Routing policy for this variant.")
    description: str | None = Field(None, description="What this variant is.")
    sim: dict[str, Any] = Field(
        default_factory=dict, description="Overrides of the `sim:` settings for this variant."
    )
    cluster: dict[str, Any] = Field(
        default_factory=dict, description="Overrides of the `cluster:` block for this variant."
    )


Operator = Literal["<", "<=", ">", ">=", "==", "!="]


class Condition(StrictModel):
    field: Literal[
        "input_tokens", "output_tokens", "cached_tokens", "cached_fraction", "uncached_tokens",
        "turn", "route", "source",
    ] = Field(description="Request field the rule tests.")  # fmt: skip
    op: Operator = Field(description="Comparison operator.")
    value: float | str = Field(description="Value compared against.")


class ClassRule(StrictModel):
    """First matching rule labels the request; a rule with no conditions matches all."""

    name: str = Field(description="Class label, e.g. WARM, MEDIUM, HEAVY.")
    when: list[Condition] = Field(
        default_factory=list, description="All conditions must hold (AND)."
    )


class Guard(StrictModel):
    metric: str = Field(description="Metric name, e.g. ok_rate, ttft_p90, gpu_imbalance.")
    klass: str | None = Field(None, alias="class", description="Restrict to one class.")
    max_worse: float = Field(
        description="Largest allowed worsening vs baseline: absolute for ok_rate "
        "(0.01 = one point), relative otherwise (0.05 = 5%)."
    )


class VerdictRule(StrictModel):
    metric: str = Field(description="Primary metric, e.g. ttft_p90, tpot_p90, e2e_p50.")
    klass: str | None = Field(
        None, alias="class", description="Restrict the primary metric to one class."
    )
    direction: Literal["decrease", "increase"] = Field(
        "decrease", description="Claimed direction of change vs baseline."
    )
    min_effect: float = Field(
        0.05, ge=0, description="Smallest relative change that counts (0.05 = 5%)."
    )
    guards: list[Guard] = Field(default_factory=list, description="Must hold for VALIDATED.")
    per_class: list[str] = Field(
        default_factory=list,
        description="Classes checked separately: a claim that holds for some and reverses "
        "for others is PARTIALLY VALIDATED.",
    )
    confidence: float = Field(0.95, gt=0, lt=1, description="Bootstrap interval level.")
    bootstrap_samples: int = Field(1000, ge=100, description="Bootstrap resamples.")
    min_ok_requests: int = Field(
        20, ge=1, description="Fewer successful requests per variant → INCONCLUSIVE."
    )


class SeedVerdict(StrictModel):
    """A verdict the claim already received elsewhere (e.g. on a real cluster), printed
    next to the tool's verdict in the log so the two can be compared."""

    verdict: Literal["VALIDATED", "PARTIALLY VALIDATED", "REJECTED", "INCONCLUSIVE"] = Field(
        description="The earlier verdict."
    )
    source: str = Field(description="Where it comes from (document, experiment).")
    summary: str | None = Field(None, description="One line on what that experiment found.")


class Hypothesis(StrictModel):
    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Short id, e.g. H4.")
    title: str = Field(description="One-line title.")
    claim: str = Field(description="The claim under test.")
    prior_evidence: str | None = Field(None, description="What motivated the claim.")
    date: dt.date | None = Field(None, description="When the hypothesis was written.")
    tags: list[str] = Field(default_factory=list, description="Free-form tags.")
    notes: str | None = Field(None, description="Anything else worth keeping with the claim.")
    seed_verdict: SeedVerdict | None = Field(
        None, description="Verdict from an earlier experiment, shown beside the tool's."
    )
    backend: Literal["sim", "cluster"] = Field("sim", description="Where to run.")
    model: str | ModelShape = Field(
        "llama-3.3-70b", description="Model preset name or explicit shape."
    )
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Topology.")
    sim: SimSettings = Field(default_factory=SimSettings, description="Simulator fidelity.")
    workload: WorkloadSpec = Field(description="Requests to replay.")
    classes: list[ClassRule] = Field(default_factory=list, description="Ordered class rules.")
    variants: dict[str, Variant] = Field(min_length=1, description="Name → variant.")
    baseline: str = Field(description="Name of the baseline variant.")
    repeats: int = Field(1, ge=1, description="Repeats of every variant.")
    seed: int = Field(0, ge=0, description="Master seed.")
    verdict: VerdictRule = Field(description="Decision rule.")

    @model_validator(mode="after")
    def _baseline_exists(self) -> Hypothesis:
        if self.baseline not in self.variants:
            raise ValueError(
                f"baseline {self.baseline!r} is not a variant; variants: "
                + ", ".join(self.variants)
            )
        return self
