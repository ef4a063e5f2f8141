"""The hypothesis file: a research claim as a typed, strict, falsifiable experiment.

Every field carries a description (shown by `btb-lab validate --explain` and in the
README's tour). Cross-field rules live in model validators; checks that need a registry
(policy names and parameters, model and GPU presets, workload generators) live in the
loader (`btb_lab.hypothesis.loader`), which imports those registries.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from btb_lab.config.base import StrictModel
from btb_lab.config.costs import CostSettings, move_sim_aliases
from btb_lab.config.launch import LaunchSettings
from btb_lab.config.limits import (
    MAX_BOOTSTRAP_SAMPLES,
    MAX_GPUS_PER_INSTANCE,
    MAX_INSTANCES,
    MAX_REPEATS,
)
from btb_lab.config.metrics import METRICS
from btb_lab.config.profiles import apply_profile
from btb_lab.config.sim import SimSettings
from btb_lab.config.workload import WorkloadSpec

__all__ = [
    "NUMERIC_FIELDS",
    "AutoRepeats",
    "ClassRule",
    "ClusterSpec",
    "Condition",
    "Exclude",
    "Guard",
    "Hypothesis",
    "InstanceGroup",
    "KVConnector",
    "KVRole",
    "ModelShape",
    "RouterSpec",
    "SeedVerdict",
    "Variant",
    "VariantName",
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
    attention_heads: int | None = Field(
        None,
        ge=1,
        description="Query heads (config.json num_attention_heads), each head_dim wide: "
        "the width of the roofline's prefill attention term (costs.prefill_attention).",
    )


class InstanceGroup(StrictModel):
    role: Literal["C", "PS"] = Field(
        "C", description="C: co-located prefill+decode; PS: prefill service."
    )
    count: int = Field(
        1,
        ge=1,
        le=MAX_INSTANCES,
        description=f"Instances of this role (at most {MAX_INSTANCES:,}: the simulator keeps "
        "caches and utilization bins per instance).",
    )
    gpu: str = Field("H100", description="GPU preset (A100, H100, H200, B200, B300, MI300X).")
    gpus: int = Field(
        1,
        ge=1,
        le=MAX_GPUS_PER_INSTANCE,
        description=f"GPUs per instance (tensor-parallel size; at most {MAX_GPUS_PER_INSTANCE:,}"
        ", an NVL72 rack is 72).",
    )


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
        default_factory=lambda: [InstanceGroup()],
        min_length=1,
        description="Instance groups by role.",
    )
    kv_connector: KVConnector = Field(
        default_factory=KVConnector, description="KV connector on every instance."
    )
    launch: LaunchSettings = Field(
        default_factory=LaunchSettings, description="Real-cluster launch settings."
    )

    @model_validator(mode="after")
    def _an_endpoint_an_instance(self) -> ClusterSpec:
        """Attached servers are the instances, in order: with another count their roles
        were dropped (every one a C) while reports and the cost model kept the groups."""
        urls = self.launch.endpoints
        count = sum(group.count for group in self.instances)
        if urls and self.launch.backend != "ray" and len(urls) != count:
            raise ValueError(
                f"launch.endpoints lists {len(urls)} servers for the {count} instances of "
                "cluster.instances: one URL an instance, in the groups' order"
            )
        return self


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
    costs: dict[str, Any] = Field(
        default_factory=dict, description="Overrides of the `costs:` block for this variant."
    )
    cluster: dict[str, Any] = Field(
        default_factory=dict, description="Overrides of the `cluster:` block for this variant."
    )

    @model_validator(mode="before")
    @classmethod
    def _cost_aliases(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("sim"), dict):
            if "profile" in data["sim"]:
                raise ValueError(
                    "sim.profile is set for the whole hypothesis, not per variant: write "
                    "the settings this variant changes instead"
                )
            data = dict(data)
            move_sim_aliases(data)
        return data


def _selectable_variant_name(name: str) -> str:
    """A variant name `--variants` (comma-separated, each name stripped) can select, and
    that prints on one line in verdicts, tables and messages."""
    if not name.strip():
        raise ValueError("a variant name must not be empty")
    if "," in name:
        raise ValueError(
            f"variant name {name!r} contains a comma, so `--variants` (comma-separated) "
            "cannot select it; rename it"
        )
    if name != name.strip():
        raise ValueError(
            f"variant name {name!r} starts or ends with whitespace, which `--variants` "
            "strips; rename it"
        )
    if not name.isprintable():
        raise ValueError(f"variant name {name!r} contains a non-printing character; rename it")
    return name


VariantName = Annotated[str, AfterValidator(_selectable_variant_name)]


Operator = Literal["<", "<=", ">", ">=", "==", "!="]
NUMERIC_FIELDS = frozenset(
    {"input_tokens", "output_tokens", "cached_tokens", "cached_fraction", "uncached_tokens", "turn"}
)


class Condition(StrictModel):
    field: Literal[
        "input_tokens", "output_tokens", "cached_tokens", "cached_fraction", "uncached_tokens",
        "turn", "route", "source",
    ] = Field(description="Request field the rule tests.")  # fmt: skip
    op: Operator = Field(description="Comparison operator.")
    value: float | str = Field(description="Value compared against.")

    @field_validator("op")
    @classmethod
    def _op_fits_field(cls, op: str, info: ValidationInfo) -> str:
        field = info.data.get("field")
        if field is not None and field not in NUMERIC_FIELDS and op not in ("==", "!="):
            raise ValueError(f"{field} is text: use '==' or '!=' (got {op!r})")
        return op

    @field_validator("value", mode="before")
    @classmethod
    def _finite_value(cls, value: Any) -> Any:
        # One message instead of the union's two ("finite number", "valid string"): a NaN
        # or infinite threshold would silently match no request.
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value}")
        return value

    @field_validator("value")
    @classmethod
    def _value_fits_field(cls, value: float | str, info: ValidationInfo) -> float | str:
        field = info.data.get("field")
        if field in NUMERIC_FIELDS and isinstance(value, str):
            raise ValueError(f"{field} compares with a number, got {value!r}")
        return value


class ClassRule(StrictModel):
    """First matching rule labels the request; a rule with no conditions matches all."""

    name: str = Field(description="Class label, e.g. WARM, MEDIUM, HEAVY.")
    when: list[Condition] = Field(
        default_factory=list, description="All conditions must hold (AND)."
    )

    @field_validator("name")
    @classmethod
    def _printable_label(cls, name: str) -> str:
        """A label the report prints at the start of a line, and `class:` refers to."""
        if not name.strip():
            raise ValueError("a class name must not be empty")
        if name != name.strip() or not name.isprintable():
            raise ValueError(f"class name {name!r} has surrounding spaces or a non-printing "
                             "character; rename it")  # fmt: skip
        return name


class Guard(StrictModel):
    metric: str = Field(
        description="Metric name, e.g. ok_rate, ttft_p90, gpu_imbalance (checked against "
        "`config.metrics` by the loader)."
    )
    klass: str | None = Field(None, alias="class", description="Restrict to one class.")
    pool: str | None = Field(
        None, description="Restrict to one pool: the requests whose `source` is this."
    )
    max_worse: float = Field(
        ge=0,
        description="Largest allowed worsening vs baseline: absolute for ok_rate "
        "(0.01 = one point), relative otherwise (0.05 = 5%).",
    )


class Exclude(StrictModel):
    """Warmup and cooldown left out of metrics and verdicts, the same way on every backend:
    measured on the workload's arrival times (target send times) of each repeat."""

    first_s: float = Field(
        0.0, ge=0, description="Leave out requests arriving in the first this many seconds."
    )
    last_s: float = Field(
        0.0, ge=0, description="Leave out requests arriving in the last this many seconds."
    )
    first_requests: int = Field(0, ge=0, description="Leave out the first N requests.")
    last_requests: int = Field(0, ge=0, description="Leave out the last N requests.")

    @property
    def active(self) -> bool:
        return bool(self.first_s or self.last_s or self.first_requests or self.last_requests)


class VerdictRule(StrictModel):
    metric: str = Field(description="Primary metric, e.g. ttft_p90, tpot_p90, e2e_p50.")
    klass: str | None = Field(
        None, alias="class", description="Restrict the primary metric to one class."
    )
    pool: str | None = Field(
        None,
        description="Restrict the primary metric (and per-class checks) to one pool: the "
        "requests whose `source` is this, e.g. `synthetic` (the bursty windows of "
        "Bursted-ART) or `art` (the replayed real windows).",
    )
    exclude: Exclude | None = Field(
        None,
        description="Warmup / cooldown left out of every metric and the verdict: "
        "{first_s, last_s} seconds or {first_requests, last_requests} of each repeat.",
    )
    multiplicity: Literal["holm", "none"] = Field(
        "holm",
        description="With several variants against one baseline: `holm` adjusts each "
        "primary interval by Holm's step-down procedure (the verdict line says so); "
        "`none` judges every comparison at the plain confidence level.",
    )
    require_all_repeats: bool = Field(
        False,
        description="One repeat whose change points against the claimed direction means "
        "not confirmed (INCONCLUSIVE), however the pooled interval looks.",
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
        description="Classes checked separately (unadjusted): a claim the whole run shows "
        "that reverses for one of them is PARTIALLY VALIDATED; otherwise the verdict line "
        "only reports them.",
    )
    confidence: float = Field(0.95, gt=0, lt=1, description="Bootstrap interval level.")
    bootstrap_samples: int = Field(
        1000,
        ge=100,
        le=MAX_BOOTSTRAP_SAMPLES,
        description=f"Bootstrap resamples (at most {MAX_BOOTSTRAP_SAMPLES:,}: 10,000 already "
        "gives a stable interval and each resample recomputes the metric).",
    )
    min_ok_requests: int = Field(
        20,
        ge=1,
        description="Fewer successful requests per variant → INCONCLUSIVE (for ok_rate: "
        "fewer requests sent).",
    )

    @model_validator(mode="after")
    def _reachable_effect(self) -> VerdictRule:
        # every metric is non-negative: a relative decrease is at most 100%
        if self.direction == "decrease" and self.min_effect > 1:
            raise ValueError(
                f"min_effect {self.min_effect:g} asks for a decrease of more than 100%, which "
                "no variant can reach (0.05 = 5%)"
            )
        return self

    @model_validator(mode="after")
    def _pools_are_request_scopes(self) -> VerdictRule:
        # the error is placed at `verdict`: a guard's says which guard
        scoped = [("", self.metric, self.pool)]
        scoped += [(f"guard {g.metric}: ", g.metric, g.pool) for g in self.guards]
        for where, metric, pool in scoped:
            if pool is not None and metric in METRICS and METRICS[metric].level != "request":
                raise ValueError(f"{where}metric {metric!r} cannot be restricted to a pool")
        return self


class AutoRepeats(StrictModel):
    """`repeats: auto`: add repeats until every primary interval is tight enough."""

    min: int = Field(3, ge=2, le=MAX_REPEATS, description="Repeats run before the first check.")
    max: int = Field(
        20,
        ge=2,
        le=MAX_REPEATS,
        description=f"Never more repeats than this (at most {MAX_REPEATS:,}).",
    )
    half_width: float | None = Field(
        None,
        gt=0,
        description="Stop once every primary interval's half-width is at most this "
        "(relative, 0.05 = 5 points); default: the verdict's min_effect.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> AutoRepeats:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        return self


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
    costs: CostSettings = Field(
        default_factory=CostSettings,
        description="The cost model both backends use (prefill, decode, KV transfer).",
    )
    sim: SimSettings = Field(default_factory=SimSettings, description="Simulator fidelity.")
    workload: WorkloadSpec = Field(description="Requests to replay.")
    classes: list[ClassRule] = Field(default_factory=list, description="Ordered class rules.")
    variants: dict[VariantName, Variant] = Field(
        min_length=1,
        description="Name → variant. A name is not empty and has no comma, no leading or "
        "trailing whitespace and no non-printing character, so `--variants a,b` can select it.",
    )
    baseline: str = Field(description="Name of the baseline variant.")
    repeats: int = Field(
        1,
        ge=1,
        le=MAX_REPEATS,
        description=f"Repeats of every variant (at most {MAX_REPEATS:,}; each is a full run "
        "and draws a new workload seed); `auto` runs `auto_repeats.min` and adds repeats "
        "until the intervals are tight.",
    )
    auto_repeats: AutoRepeats | None = Field(
        None,
        description="Adaptive repeats (set by `repeats: auto`): min, max and the target "
        "half-width of the primary intervals.",
    )
    seed: int = Field(0, ge=0, description="Master seed.")
    verdict: VerdictRule = Field(description="Decision rule.")

    # `sim.<cost parameter>` spellings moved to `costs` while validating (aliases)
    _aliases: list[str] = PrivateAttr(default_factory=list)
    # settings `sim.profile` supplied (the rest were written out)
    _profile_set: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _cost_aliases(cls, data: Any, handler: ModelWrapValidatorHandler[Hypothesis]) -> Hypothesis:
        notes: list[str] = []
        profile_set: list[str] = []
        if isinstance(data, dict):
            data = dict(data)
            notes = move_sim_aliases(data)
            profile_set = apply_profile(data)
            # `repeats: auto` turns auto_repeats on (its defaults when absent); an explicit
            # count (an override, `--repeats N`) turns it off
            if data.get("repeats") == "auto":
                auto = data.get("auto_repeats")
                if auto is None:
                    auto = data["auto_repeats"] = {}
                data["repeats"] = auto.get("min", 3) if isinstance(auto, dict) else 3
            elif "repeats" in data and data.get("auto_repeats") is not None:
                data["auto_repeats"] = None
            variants = data.get("variants")
            if isinstance(variants, dict):
                moved = {}
                for name, variant in variants.items():
                    if isinstance(variant, dict) and isinstance(variant.get("sim"), dict):
                        variant = dict(variant)
                        notes += move_sim_aliases(variant, where=f"variants.{name}.")
                    moved[name] = variant
                data["variants"] = moved
        hyp = handler(data)
        hyp._aliases = notes
        hyp._profile_set = profile_set
        return hyp

    @field_serializer("repeats")
    def _dump_repeats(self, repeats: int) -> int | str:
        # stored hypotheses (manifests) read back as they were written: `repeats: auto`
        return "auto" if self.auto_repeats is not None else repeats

    @property
    def profile_settings(self) -> list[str]:
        """Dotted names whose value came from `sim.profile`, not from the file."""
        return list(self._profile_set)

    @property
    def aliases(self) -> list[str]:
        """Deprecated spellings this hypothesis used, e.g. `sim.mfu → costs.mfu`."""
        return list(self._aliases)

    @field_validator("classes")
    @classmethod
    def _classes_can_match(cls, classes: list[ClassRule]) -> list[ClassRule]:
        # the first rule that matches names a request: a second rule of one name would
        # silently split or shadow that class in every table
        first: dict[str, int] = {}
        for index, rule in enumerate(classes):
            if rule.name in first:
                raise ValueError(
                    f"class {rule.name!r} is named twice (classes.{first[rule.name]} and "
                    f"classes.{index})"
                )
            first[rule.name] = index
        # a rule without conditions matches every request: none after it ever matches
        catch_all = next((i for i, rule in enumerate(classes) if not rule.when), None)
        if catch_all is not None and catch_all < len(classes) - 1:
            shadowed = ", ".join(repr(rule.name) for rule in classes[catch_all + 1 :])
            raise ValueError(
                f"class {classes[catch_all].name!r} (classes.{catch_all}) has no conditions and "
                f"matches every request, so {shadowed} after it can never match: put it last"
            )
        return classes

    @field_validator("baseline")
    @classmethod
    def _baseline_exists(cls, baseline: str, info: ValidationInfo) -> str:
        # a field's check, not the model's: the error names `baseline` and its line
        variants = info.data.get("variants")  # absent when the variants were invalid
        if variants is not None and baseline not in variants:
            raise ValueError(f"{baseline!r} is not a variant; variants: " + ", ".join(variants))
        return baseline
