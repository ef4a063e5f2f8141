"""The in-process router for real clusters: the same Policy objects as the simulator,
fed a ClusterView built from the router's own bookkeeping, with each Decision carried
out as HTTP traffic — plain routing, prefill offload and BTB warming as KV transfers
through the cluster's connector (NIXL, ExampleConnector, Mooncake), or, with no
connector, offloads on the decode instance alone and warming as a prefix-only
speculative prefill.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from btb_lab.cluster.connectors import (
    Connector,
    TransferIO,
    TransferJob,
    TransferMeter,
    TransferResult,
    build_connector,
)
from btb_lab.cluster.driver import ClientPool, RunClock, StreamResult, completion_payload
from btb_lab.cluster.launcher import Endpoint
from btb_lab.errors import UserError
from btb_lab.events import EventLog
from btb_lab.policies.base import CostModel, Decision, InstanceLoad, Policy, WarmAction
from btb_lab.records import Request, RequestRecord

if TYPE_CHECKING:
    from btb_lab.config.hypothesis import KVConnector

__all__ = ["BlockLRU", "Router", "RouterState", "RoutingStats"]


class BlockLRU:
    """Prefix blocks one instance is believed to hold, bounded; least recently used
    blocks are forgotten first (as the engine would evict them)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def add(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if block in self._blocks:
                self._blocks.move_to_end(block)
            else:
                self._blocks[block] = None
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def match(self, blocks: Sequence[int]) -> int:
        """Leading blocks present; matched blocks count as used (moved to the MRU end)."""
        n = 0
        for block in blocks:
            if block not in self._blocks:
                break
            n += 1
        for block in blocks[:n]:
            self._blocks.move_to_end(block)
        return n


class RouterState:
    """The ClusterView the policies see on a real cluster: in-flight requests and
    outstanding tokens per instance, prefix blocks routed there (LRU), and blocks whose
    prefill finished there (valid copy sources), plus the shared cost model."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        costs: CostModel,
        clock: RunClock,
        *,
        cache_blocks: int = 100_000,
    ) -> None:
        self.endpoints = list(endpoints)
        self._costs = costs
        self._clock = clock
        n = len(self.endpoints)
        self.in_flight = [0] * n
        self.outstanding_tokens = [0] * n
        self.routed = [BlockLRU(cache_blocks) for _ in range(n)]
        self.complete = [BlockLRU(cache_blocks) for _ in range(n)]

    # ClusterView ------------------------------------------------------------------------
    @property
    def now_s(self) -> float:
        return self._clock.now()

    @property
    def instances(self) -> Sequence[InstanceLoad]:
        # The router only knows what it sent: every in-flight request counts as running.
        return [
            InstanceLoad(e.index, e.name, e.role, self.in_flight[i], 0, self.outstanding_tokens[i])
            for i, e in enumerate(self.endpoints)
        ]

    @property
    def costs(self) -> CostModel:
        return self._costs

    def match_blocks(self, instance: int, block_hashes: Sequence[int]) -> int:
        return self.routed[instance].match(block_hashes)

    def complete_blocks(self, instance: int, block_hashes: Sequence[int]) -> int:
        return self.complete[instance].match(block_hashes)

    def host_blocks(self, instance: int, block_hashes: Sequence[int]) -> int:
        # vLLM reports no per-prefix view of its CPU offload tier: the router knows what
        # completed there, nothing more
        return self.complete[instance].match(block_hashes)

    # bookkeeping ------------------------------------------------------------------------
    def begin(self, instance: int, tokens: int, blocks: Sequence[int]) -> None:
        self.in_flight[instance] += 1
        self.outstanding_tokens[instance] += tokens
        self.routed[instance].add(blocks)

    def prefilled(self, instance: int, blocks: Sequence[int]) -> None:
        """KV of `blocks` now exists on `instance` (first token seen there)."""
        self.routed[instance].add(blocks)
        self.complete[instance].add(blocks)

    def end(self, instance: int, tokens: int) -> None:
        self.in_flight[instance] -= 1
        self.outstanding_tokens[instance] -= tokens


@dataclass
class RoutingStats:
    """Counters of what the router did (reported in the backend result)."""

    routes: dict[str, int] = field(default_factory=dict)
    per_instance: dict[str, int] = field(default_factory=dict)
    offloads: int = 0
    offloads_without_connector: int = 0
    warms_sent: int = 0
    warms_ok: int = 0
    warms_failed: int = 0
    warms_skipped_duplicate: int = 0
    parked_for_warm: int = 0  # requests that waited for a warm copy to their instance
    warm_s: list[float] = field(default_factory=list)
    transfers_failed: int = 0
    warms: list[dict[str, Any]] = field(default_factory=list)  # one entry per warm copy

    def as_dict(self) -> dict[str, Any]:
        warm = sorted(self.warm_s)
        return {
            "routes": dict(self.routes),
            "per_instance": dict(self.per_instance),
            "offloads": self.offloads,
            "offloads_without_connector": self.offloads_without_connector,
            "warms_sent": self.warms_sent,
            "warms_ok": self.warms_ok,
            "warms_failed": self.warms_failed,
            "warms_skipped_duplicate": self.warms_skipped_duplicate,
            "parked_for_warm": self.parked_for_warm,
            "warm_p50_s": warm[len(warm) // 2] if warm else None,
            "transfers_failed": self.transfers_failed,
            "warms": list(self.warms),
        }


PromptFn = Callable[[Request], list[int]]


class Router:
    """Routes each request with the policy and executes the decision over HTTP. One
    Router serves one variant × repeat (the policy object may keep state)."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        policy: Policy,
        costs: CostModel,
        *,
        client: ClientPool,
        clock: RunClock,
        model: str,
        prompt_fn: PromptFn,
        connector: str | KVConnector | Connector = "none",
        cache_blocks: int = 100_000,
        variant: str = "",
        repeat: int = 0,
        transfer_timeout_s: float | None = None,
    ) -> None:
        self.endpoints = list(endpoints)
        self.policy = policy
        self.client = client
        self.clock = clock
        self.model = model
        self.prompt_fn = prompt_fn
        self.kv = _as_connector(connector)
        self.connector = self.kv.name
        self.variant = variant
        self.repeat = repeat
        self.state = RouterState(self.endpoints, costs, clock, cache_blocks=cache_blocks)
        self.stats = RoutingStats()
        self.events = EventLog("router")  # warm copies and KV transfers, as they happen
        self.io = TransferIO(
            client, clock, self.endpoints, model,
            TransferMeter(client, self.endpoints, enabled=self.kv.spec.attribute_transfers),
            timeout_s=transfer_timeout_s,
        )  # fmt: skip
        self._warm_tasks: set[asyncio.Task[None]] = set()
        # warm copies in flight: (target, blocks, last block) -> the prefix and its landing
        self._warming: dict[tuple[int, int, int], tuple[tuple[int, ...], asyncio.Event]] = {}
        self.transfer_timeout_s = transfer_timeout_s
        self._ids = itertools.count()

    def _url(self, instance: int) -> str:
        return self.endpoints[instance].base_url + "/v1/completions"

    def _tag(self, kind: str, request: Request) -> str:
        return f"{kind}-{self.variant}-{self.repeat}-{request.request_id}-{next(self._ids)}"

    def count_route(self, route: str, instance: int) -> None:
        """Count one request routed `route` to `instance` (the load driver's and the
        proxy's requests alike)."""
        stats = self.stats
        stats.routes[route] = stats.routes.get(route, 0) + 1
        name = self.endpoints[instance].name
        stats.per_instance[name] = stats.per_instance.get(name, 0) + 1

    # one request ------------------------------------------------------------------------
    async def dispatch(self, request: Request, target_s: float) -> RequestRecord:
        """Route, execute, and return the finished record (never raises for HTTP)."""
        decision = self.policy.route(request, self.state)
        if decision.cache:  # the loader refuses such policies on a cluster; never silently
            raise UserError(
                f"policy {self.policy.name!r} decided cache actions "
                f"({', '.join(sorted({a.kind for a in decision.cache}))}), which vLLM "
                "cannot carry out per prefix (see btb_lab/policies/btb_cache.py)"
            )
        self.count_route(decision.route, decision.instance)
        prompt = self.prompt_fn(request)
        for action in decision.warm:
            self.start_warm(action, request, prompt)
        offload = (
            decision.prefill_instance is not None and decision.prefill_instance != decision.instance
        )
        if offload and self.kv.moves_kv:
            record = await self._offload(request, decision, prompt, target_s)
        else:
            if offload:
                self.stats.offloads_without_connector += 1
            record = await self._plain(request, decision, prompt, target_s)
        self.policy.on_finish(request, decision.instance, self.clock.now())
        return record

    async def _plain(
        self, request: Request, decision: Decision, prompt: list[int], target_s: float
    ) -> RequestRecord:
        inst = decision.instance
        tokens = request.input_tokens + request.output_tokens
        blocks = request.block_hashes
        self.state.begin(inst, tokens, blocks)
        try:
            parked_s = await self._park_for_warm(inst, blocks)
            payload = completion_payload(self.model, prompt, request.output_tokens)
            res = await self.client.stream_completion(self._url(inst), payload, self.clock)
        finally:
            self.state.end(inst, tokens)
        if res.first_token_s is not None:
            self.state.prefilled(inst, blocks)
        record = self._record(request, decision, res, target_s)
        if parked_s is not None:
            record.extra["parked_for_warm_s"] = round(parked_s, 6)
        return record

    async def _park_for_warm(self, instance: int, blocks: Sequence[int]) -> float | None:
        """Hold a request whose prefix is being copied to its instance until the copy
        lands (or fails, or the transfer timeout passes), so that it hits the copied KV
        instead of computing the prefix beside it, as the simulator parks a request for a
        warm copy in flight. The seconds it waited, or None when nothing was in flight."""
        pending = [
            done for (target, n, _), (prefix, done) in self._warming.items()
            if target == instance and n <= len(blocks) and tuple(blocks[:n]) == prefix
        ]  # fmt: skip
        if not pending:
            return None
        self.stats.parked_for_warm += 1
        start = self.clock.now()
        waits = [asyncio.create_task(done.wait()) for done in pending]
        try:
            await asyncio.wait(waits, timeout=self.transfer_timeout_s)
        finally:
            for task in waits:
                task.cancel()
        return self.clock.now() - start

    async def _offload(
        self, request: Request, decision: Decision, prompt: list[int], target_s: float
    ) -> RequestRecord:
        """The prefill instance computes the prompt, its KV moves to the decode instance
        through the connector, and the decode instance generates the output."""
        assert decision.prefill_instance is not None
        p, d = decision.prefill_instance, decision.instance
        self.stats.offloads += 1
        blocks = request.block_hashes
        self.state.begin(p, request.input_tokens, blocks)
        self.state.begin(d, request.input_tokens + request.output_tokens, blocks)
        job = TransferJob(
            producer=p, consumer=d, prompt=prompt, max_tokens=request.output_tokens,
            cold=decision.prefill_cold, tag=self._tag("xfer", request),
        )  # fmt: skip
        try:
            result = await self.kv.transfer(self.io, job)
        finally:
            self.state.end(p, request.input_tokens)
            self.state.end(d, request.input_tokens + request.output_tokens)
        prefill, decode = result.prefill, result.consume
        if prefill is not None and prefill.ok:
            self.state.prefilled(p, blocks)
        if decode.first_token_s is not None:
            self.state.prefilled(d, blocks)
        if prefill is not None and prefill.finish_s is not None:
            # the KV moves once the producer's prefill is done
            landed = decode.first_token_s
            self.events.kv_transfer(
                prefill.finish_s, max(landed, prefill.finish_s) if landed is not None else None,
                self.endpoints[d].name, self.endpoints[p].name, request.input_tokens,
                request_id=request.request_id,
            )  # fmt: skip
        if not result.ok:
            self.stats.transfers_failed += 1
        record = self._record(request, decision, decode, target_s)
        record.extra.update(result.record_extra())
        if prefill is not None:
            # the offloaded request's cache hit is the prefill instance's, as simulated
            record.cached_tokens = int(prefill.cached_tokens or 0)
            if prefill.finish_s is not None:
                record.prefill_s = prefill.finish_s - prefill.sent_s
                if decode.first_token_s is not None:
                    record.kv_transfer_s = max(0.0, decode.first_token_s - prefill.finish_s)
        return record

    def _record(
        self, request: Request, decision: Decision, res: StreamResult, target_s: float
    ) -> RequestRecord:
        output = request.output_tokens
        if res.ok and res.completion_tokens is not None:
            output = int(res.completion_tokens)
        prefill = decision.prefill_instance
        return RequestRecord(
            variant=self.variant,
            repeat=self.repeat,
            request_id=request.request_id,
            trace_id=request.trace_id,
            source=request.source,
            session_id=request.session_id,
            instance=self.endpoints[decision.instance].name,
            route=decision.route,
            arrival_s=target_s,
            sent_s=res.sent_s,
            first_token_s=res.first_token_s,
            finish_s=res.last_chunk_s if res.ok else None,
            input_tokens=request.input_tokens,
            output_tokens=output,
            # at most the prompt: a server's count beyond it is no cache hit to report
            cached_tokens=min(int(res.cached_tokens or 0), request.input_tokens),
            ok=res.ok,
            error=res.error,
            klass=request.klass,
            turn=request.turn,
            group_id=request.group_id,
            prefill_instance=(
                self.endpoints[prefill].name
                if prefill is not None and prefill != decision.instance
                else None
            ),
            extra=_result_extra(res),
        )

    # warming ----------------------------------------------------------------------------
    def start_warm(self, action: WarmAction, request: Request, prompt: list[int]) -> None:
        n = min(action.n_blocks, len(request.block_hashes))
        tokens = prompt[: n * request.block_tokens]
        if n <= 0 or not tokens:
            return
        key = (action.target, n, request.block_hashes[n - 1])
        if key in self._warming:
            self.stats.warms_skipped_duplicate += 1
            return
        blocks = request.block_hashes[:n]
        self._warming[key] = (tuple(blocks), asyncio.Event())
        # The router believes it from now on (as for a routed request).
        self.state.routed[action.target].add(blocks)
        task = asyncio.create_task(self._warm(action, key, blocks, tokens, request))
        self._warm_tasks.add(task)
        task.add_done_callback(self._warm_tasks.discard)

    async def _warm(
        self,
        action: WarmAction,
        key: tuple[int, int, int],
        blocks: Sequence[int],
        tokens: list[int],
        request: Request,
    ) -> None:
        self.stats.warms_sent += 1
        target = action.target
        start = self.clock.now()
        self.state.begin(target, len(tokens), ())
        transfer: TransferResult | None = None
        try:
            copy = (
                action.mode == "rdma"
                and self.kv.moves_kv
                and action.source is not None
                and action.source != target
            )
            if copy:  # copy the prefix's KV from the holder through the connector
                assert action.source is not None
                job = TransferJob(
                    producer=action.source, consumer=target, prompt=tokens, max_tokens=1,
                    stream=False, tag=self._tag("warm", request),
                )  # fmt: skip
                transfer = await self.kv.transfer(self.io, job)
                res = transfer.consume
            else:  # speculative prefill: compute the prefix on the target itself
                body = completion_payload(self.model, tokens, 1, stream=False)
                res = await self.client.stream_completion(self._url(target), body, self.clock)
        finally:
            self.state.end(target, len(tokens))
            _, landed = self._warming.pop(key)
            landed.set()
        entry: dict[str, Any] = {
            "request_id": request.request_id,
            "source": None if action.source is None else self.endpoints[action.source].name,
            "target": self.endpoints[target].name,
            "prefix_tokens": len(tokens),
            "mode": "transfer" if transfer is not None else "prefill",
            "ok": res.ok,
            "error": res.error,
            "start_s": round(start, 6),
            "end_s": round(self.clock.now(), 6),
        }
        if transfer is not None:
            entry.update(transfer.record_extra())
        self.stats.warms.append(entry)
        if res.ok:
            self.stats.warms_ok += 1
            self.stats.warm_s.append(self.clock.now() - start)
            self.state.prefilled(target, blocks)
        else:
            self.stats.warms_failed += 1
        copied = transfer is not None
        source = self.endpoints[action.source].name if copied and action.source is not None else ""
        self.events.warm_copy(
            start, self.clock.now() if res.ok else None, self.endpoints[target].name, source,
            len(tokens), mode="rdma" if copied else "prefill", request_id=request.request_id,
        )  # fmt: skip

    async def drain(self) -> None:
        """Wait for warm transfers still in flight (they belong to this run)."""
        while self._warm_tasks:
            await asyncio.wait(set(self._warm_tasks))


def _as_connector(connector: str | KVConnector | Connector) -> Connector:
    if isinstance(connector, Connector):
        return connector
    from btb_lab.config.hypothesis import KVConnector

    spec = KVConnector(type=connector) if isinstance(connector, str) else connector
    return build_connector(spec)


def _result_extra(res: StreamResult) -> dict[str, float | int | str]:
    """Per-request facts kept in the record's `extra`: chunk count, retry, a digest of the
    generated text (equal digests = equal greedy outputs), the server's error message."""
    out: dict[str, float | int | str] = {"chunks": res.chunks, "retried": int(res.retried)}
    if res.ok:
        out["output_digest"] = hashlib.blake2b(res.text.encode(), digest_size=8).hexdigest()
    elif res.detail:
        out["error_detail"] = res.detail
    return out
