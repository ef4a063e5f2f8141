"""The embedded simulator as a `Backend` (registered as "sim"), plus `simulate`, the plain
library entry point for running one variant without the runner."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from btb_lab.backends import BACKENDS, BackendResult, RunContext
from btb_lab.errors import UserError
from btb_lab.policies.base import Policy, build_policy
from btb_lab.records import Request, RequestRecord, UtilSample
from btb_lab.sim.engine import Engine
from btb_lab.sim.hardware import InstanceSpec, build_instances, resolve_model
from btb_lab.sim.settings import SimSettings

if TYPE_CHECKING:
    from btb_lab.hypothesis.schema import ClusterSpec, Hypothesis, Variant

__all__ = [
    "ENGINE_VERSION",
    "SimBackend",
    "effective_cluster",
    "effective_settings",
    "fidelity_facts",
    "run_engine",
    "simulate",
]

ENGINE_VERSION = "2"  # 2: kv_prefix_sharing (on by default) changes the numbers
_WRITE_BATCH = 4096


def effective_settings(hypothesis: Hypothesis, variant: Variant) -> SimSettings:
    """The hypothesis `sim:` block with the variant's overrides merged and revalidated."""
    merged = {**hypothesis.sim.model_dump(), **variant.sim}
    try:
        return SimSettings.model_validate(merged)
    except Exception as exc:  # pydantic.ValidationError, reported as a user mistake
        raise UserError(f"variant sim overrides are invalid: {exc}") from exc


def effective_cluster(hypothesis: Hypothesis, variant: Variant) -> ClusterSpec:
    """The hypothesis `cluster:` block with the variant's overrides merged (one level deep
    for nested blocks such as kv_connector)."""
    from btb_lab.hypothesis.schema import ClusterSpec

    if not variant.cluster:
        return hypothesis.cluster
    base = hypothesis.cluster.model_dump()
    for key, value in variant.cluster.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    try:
        return ClusterSpec.model_validate(base)
    except Exception as exc:
        raise UserError(f"variant cluster overrides are invalid: {exc}") from exc


def _block_tokens(requests: Sequence[Request]) -> int:
    if not requests:
        return 512
    sizes = {r.block_tokens for r in requests}
    if len(sizes) > 1:
        raise UserError(f"requests mix block sizes {sorted(sizes)}; the cache needs one")
    return sizes.pop()


def fidelity_facts(
    settings: SimSettings,
    instances: list[InstanceSpec],
    policy: Policy,
    block_tokens: int,
    kv_connector: str,
) -> dict[str, Any]:
    """Every setting and hardware fact that shapes the simulated numbers."""
    model = instances[0].model
    facts: dict[str, Any] = {f"sim.{k}": v for k, v in settings.model_dump().items()}
    facts.update(
        {
            "backend": "sim",
            "engine_version": ENGINE_VERSION,
            "model": model.name,
            "model_params": model.params,
            "model_active_params": model.active_params,
            "model_weight_bytes_per_param": model.weight_bytes,
            "kv_bytes_per_token": instances[0].kv_bytes_per_token,
            "block_tokens": block_tokens,
            "kv_connector": kv_connector,
            "policy": policy.name,
            "policy_params": policy.params.model_dump(),
            "topology": [
                {
                    "name": i.name,
                    "role": i.role,
                    "gpu": i.gpu.name,
                    "gpus": i.gpus,
                    "kv_budget_tokens": i.kv_budget_tokens,
                }
                for i in instances
            ],
            "kv_reservation": (
                "uncached prompt blocks + output tokens per admitted request; the cached "
                "prefix blocks it reuses are shared, pinned (ref-counted) while it runs and "
                "never evicted; its own prompt blocks join them once resident (no preemption)"
                if settings.kv_prefix_sharing
                else "input+output tokens per admitted request (no preemption)"
            ),
            "prefix_cache": "HBM not reserved or pinned by admitted requests, LRU to host RAM"
            + (", then disk (shared, unbounded)" if settings.disk_tier else ""),
            "decode_steps": "output_tokens - 1 after the prefill's first token",
            "rdma_link": "transfers into one instance share its RDMA link (serialized)",
        }
    )
    return facts


def run_engine(
    instances: list[InstanceSpec],
    settings: SimSettings,
    policy: Policy,
    requests: Sequence[Request],
    emit: Callable[[RequestRecord], None],
    *,
    variant: str = "",
    repeat: int = 0,
    audit: bool = False,
) -> tuple[list[UtilSample], dict[str, float], Engine]:
    """Run one engine over `requests`; lower-level than `simulate` (tests and bench)."""
    engine = Engine(
        instances,
        settings,
        policy,
        block_tokens=_block_tokens(requests),
        variant=variant,
        repeat=repeat,
        audit=audit,
    )
    result = engine.run(requests, emit)
    for sample in result.utilization:
        sample.source = "sim"
    return result.utilization, result.stats, engine


def _prepare(
    hypothesis: Hypothesis, variant_name: str, seed: int
) -> tuple[SimSettings, ClusterSpec, list[InstanceSpec], Policy]:
    if variant_name not in hypothesis.variants:
        raise UserError(
            f"unknown variant {variant_name!r}; variants: {', '.join(hypothesis.variants)}"
        )
    variant = hypothesis.variants[variant_name]
    settings = effective_settings(hypothesis, variant)
    cluster = effective_cluster(hypothesis, variant)
    instances = build_instances(
        resolve_model(hypothesis.model),
        cluster,
        gpu_memory_utilization=settings.gpu_memory_utilization,
    )
    policy = build_policy(variant.router.policy, variant.router.params, seed=seed)
    return settings, cluster, instances, policy


def simulate(
    hypothesis: Hypothesis,
    variant_name: str,
    requests: Sequence[Request],
    seed: int = 0,
    *,
    repeat: int = 0,
) -> tuple[list[RequestRecord], list[UtilSample], dict[str, Any]]:
    """Simulate one variant of a hypothesis: (records, utilization, fidelity)."""
    settings, cluster, instances, policy = _prepare(hypothesis, variant_name, seed)
    records: list[RequestRecord] = []
    util, stats, _ = run_engine(
        instances,
        settings,
        policy,
        requests,
        records.append,
        variant=variant_name,
        repeat=repeat,
    )
    fidelity = fidelity_facts(
        settings, instances, policy, _block_tokens(requests), cluster.kv_connector.type
    )
    fidelity["stats"] = stats
    for sample in util:
        sample.source = "sim"
    return records, util, fidelity


class SimBackend:
    """Backend "sim": the embedded discrete-event simulator."""

    name = "sim"

    def run_variant(self, ctx: RunContext, requests: list[Request]) -> BackendResult:
        settings, cluster, instances, policy = _prepare(ctx.hypothesis, ctx.variant_name, ctx.seed)
        total = len(requests)
        buffer: list[RequestRecord] = []
        done = 0
        ctx.progress(0, total)

        def emit(rec: RequestRecord) -> None:
            nonlocal done
            buffer.append(rec)
            if len(buffer) >= _WRITE_BATCH:
                ctx.sink.write(buffer)
                done += len(buffer)
                buffer.clear()
                ctx.progress(done, total)

        util, stats, _ = run_engine(
            instances,
            settings,
            policy,
            requests,
            emit,
            variant=ctx.variant_name,
            repeat=ctx.repeat,
        )
        if buffer:
            ctx.sink.write(buffer)
            done += len(buffer)
            buffer.clear()
        ctx.progress(done, total)
        fidelity = fidelity_facts(
            settings, instances, policy, _block_tokens(requests), cluster.kv_connector.type
        )
        return BackendResult(
            utilization=util,
            fidelity=fidelity,
            telemetry_source="sim",
            extra={"sim_stats": stats},
        )


BACKENDS.add("sim", SimBackend)
