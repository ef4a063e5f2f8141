"""The embedded simulator as a `Backend` ("sim"), plus `simulate`, the plain library entry
point for running one variant without the runner.

The backend receives a variant-resolved hypothesis and that variant's cost model (built
once by the runner): it reads `hypothesis.sim` for the fidelity settings and hands the
cost model to the engine, so the engine and the policies price work identically.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from btb_lab.backends import BackendResult, RunContext
from btb_lab.config.sim import SimSettings
from btb_lab.config.variants import resolve_variant
from btb_lab.errors import UserError
from btb_lab.events import EventLog
from btb_lab.model.costmodel import RooflineCostModel, build_cost_model
from btb_lab.policies.base import Policy, build_policy
from btb_lab.records import Request, RequestRecord, UtilSample
from btb_lab.sim.engine import Engine
from btb_lab.workload.sessions import session_gate

if TYPE_CHECKING:
    from btb_lab.config.hypothesis import Hypothesis

__all__ = [
    "ENGINE_VERSION",
    "SimBackend",
    "fidelity_facts",
    "run_engine",
    "simulate",
]

ENGINE_VERSION = "4"  # 2: kv_prefix_sharing on by default; 3: prompt_cache_hit full_blocks;
# 4: output fills the last prompt block's slack (sharing)
_WRITE_BATCH = 4096


def _block_tokens(requests: Sequence[Request]) -> int:
    if not requests:
        return 512
    sizes = {r.block_tokens for r in requests}
    if len(sizes) > 1:
        raise UserError(f"requests mix block sizes {sorted(sizes)}; the cache needs one")
    return sizes.pop()


def fidelity_facts(
    settings: SimSettings,
    costs: RooflineCostModel,
    policy: Policy,
    block_tokens: int,
    kv_connector: str,
) -> dict[str, Any]:
    """Every setting and hardware fact that shapes the simulated numbers."""
    instances = costs.instances
    model = instances[0].model
    facts: dict[str, Any] = {f"sim.{k}": v for k, v in settings.model_dump().items()}
    facts.update(costs.facts())
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
            "prefix_cache": (
                "the whole KV budget, regardless of reservations (counted twice)"
                if settings.prefix_cache_budget == "whole"
                else "HBM not reserved or pinned by admitted requests"
            )
            + (", LRU to host RAM" if settings.host_ram_tier else "")
            + (" (unbounded)" if settings.host_ram_tier and settings.host_ram_bytes is None else "")
            + (", then disk (shared, unbounded)" if settings.disk_tier else ""),
            "decode_steps": (
                "output_tokens from context = input (a 1-token request decodes once)"
                if settings.decode_steps == "output_tokens"
                else "output_tokens - 1 after the prefill's first token"
            ),
            "prompt_hits": (
                "every matched block, up to the whole prompt (a repeated prompt's first "
                "token is free)"
                if settings.prompt_cache_hit == "whole_prompt"
                else "whole blocks, short of the last prompt token (computed for its logits)"
            ),
            "window_replay": (
                "each trace window on a fresh, empty cluster, results pooled"
                if settings.window_replay == "fresh"
                else "windows one after another on one cluster"
            ),
            "engine_steps": (
                f"mixed: waiting prefills start together, up to {settings.max_batched_tokens} "
                "tokens a step less one per running decode (longer prefills in chunks), the "
                "fixed prefill cost once a step; decodes advance during them"
                if settings.step_model == "mixed"
                else "serial: one prefill at a time, decode paused, the fixed cost per prefill"
            ),
            "rdma_link": (
                "transfers into one instance share its RDMA link, and transfers out of one "
                "its outgoing link (each serialized)"
                if settings.rdma_egress_shared
                else "transfers into one instance share its RDMA link (serialized); a source "
                "sends to any number at once"
            ),
        }
    )
    return facts


def windows_of(requests: Sequence[Request]) -> list[list[Request]]:
    """The trace windows (trace_ids) of `requests`, in order of first appearance."""
    groups: dict[str, list[Request]] = {}
    for request in requests:
        groups.setdefault(request.trace_id, []).append(request)
    return list(groups.values())


def run_replay(
    costs: RooflineCostModel,
    settings: SimSettings,
    make_policy: Callable[[], Policy],
    requests: Sequence[Request],
    emit: Callable[[RequestRecord], None],
    *,
    variant: str = "",
    repeat: int = 0,
    events: EventLog | None = None,
    sessions: str = "open",
) -> tuple[list[UtilSample], dict[str, float], list[Policy]]:
    """Run `requests` as `sim.window_replay` says: on one engine (continuous), or each
    trace window on a fresh engine with a freshly built (re-seeded) policy (fresh). A
    fresh window's utilization is kept from its first arrival to the next window's.
    `sessions`: workload.session_replay."""
    if settings.window_replay == "continuous":
        policy = make_policy()
        util, stats, _ = run_engine(
            costs, settings, policy, requests, emit, variant=variant, repeat=repeat,
            events=events, sessions=sessions,
        )  # fmt: skip
        return util, stats, [policy]
    windows = windows_of(requests)
    util_all: list[UtilSample] = []
    totals: dict[str, float] = {}
    policies: list[Policy] = []
    for n, window in enumerate(windows):
        policy = make_policy()
        policies.append(policy)
        util, stats, _ = run_engine(
            costs, settings, policy, window, emit, variant=variant, repeat=repeat,
            events=events, sessions=sessions,
        )  # fmt: skip
        start_s = window[0].arrival_s
        end_s = windows[n + 1][0].arrival_s if n + 1 < len(windows) else float("inf")
        util_all.extend(u for u in util if u.time_s <= end_s and (n == 0 or u.time_s > start_s))
        for key, value in stats.items():
            totals[key] = totals.get(key, 0) + value
    totals["windows"] = len(windows)
    return util_all, totals, policies


def run_engine(
    costs: RooflineCostModel,
    settings: SimSettings,
    policy: Policy,
    requests: Sequence[Request],
    emit: Callable[[RequestRecord], None],
    *,
    variant: str = "",
    repeat: int = 0,
    audit: bool = False,
    events: EventLog | None = None,
    sessions: str = "open",
) -> tuple[list[UtilSample], dict[str, float], Engine]:
    """Run one engine over `requests`; lower-level than `simulate` (tests and bench).
    `sessions` (workload.session_replay): open, or closed / closed_think, under which a
    turn waits for its session's earlier turns (`SessionGate`)."""
    engine = Engine(
        costs,
        settings,
        policy,
        block_tokens=_block_tokens(requests),
        variant=variant,
        repeat=repeat,
        audit=audit,
        events=events,
    )
    result = engine.run(requests, emit, sessions=session_gate(sessions))
    return result.utilization, result.stats, engine


def simulate(
    hypothesis: Hypothesis,
    variant_name: str,
    requests: Sequence[Request],
    seed: int = 0,
    *,
    repeat: int = 0,
) -> tuple[list[RequestRecord], list[UtilSample], dict[str, Any]]:
    """Simulate one variant of a hypothesis: (records, utilization, fidelity)."""
    if variant_name not in hypothesis.variants:
        raise UserError(
            f"unknown variant {variant_name!r}; variants: {', '.join(hypothesis.variants)}"
        )
    try:
        resolved = resolve_variant(hypothesis, variant_name)
    except ValidationError as exc:
        raise UserError(f"variant {variant_name!r}: sim overrides are invalid: {exc}") from None
    costs = build_cost_model(resolved)
    router = hypothesis.variants[variant_name].router
    records: list[RequestRecord] = []
    util, stats, policies = run_replay(
        costs, resolved.sim, lambda: build_policy(router.policy, router.params, seed=seed),
        requests, records.append, variant=variant_name, repeat=repeat,
        sessions=hypothesis.workload.session_replay,
    )  # fmt: skip
    fidelity = fidelity_facts(
        resolved.sim, costs, policies[0], _block_tokens(requests),
        resolved.cluster.kv_connector.type,
    )  # fmt: skip
    fidelity["stats"] = stats
    return records, util, fidelity


class SimBackend:
    """Backend "sim": the embedded discrete-event simulator."""

    name = "sim"
    # a variant's run shares nothing with another's (its own engine, policy and record
    # sink), so a repeat's variants may run at once in worker processes (`workers`)
    parallel_variants = True
    # binary parts: JSON text of the records' floats cost more than simulating them
    record_format = "arrow"

    def run_variant(self, ctx: RunContext, requests: list[Request]) -> BackendResult:
        hyp = ctx.hypothesis
        router = ctx.variant.router
        log = EventLog("engine")  # queue, batch, warm copies and KV transfers
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

        util, stats, policies = run_replay(
            ctx.costs, hyp.sim, lambda: build_policy(router.policy, router.params, seed=ctx.seed),
            requests, emit, variant=ctx.variant_name, repeat=ctx.repeat, events=log,
            sessions=hyp.workload.session_replay,
        )  # fmt: skip
        if buffer:
            ctx.sink.write(buffer)
            done += len(buffer)
            buffer.clear()
        ctx.progress(done, total)
        fidelity = fidelity_facts(
            hyp.sim, ctx.costs, policies[0], _block_tokens(requests), hyp.cluster.kv_connector.type
        )
        for policy in policies:
            log.extend(policy.events)
        return BackendResult(
            utilization=util,
            events=log.records(),
            fidelity=fidelity,
            telemetry_source="sim",
            extra={"sim_stats": stats},
        )
