"""The in-process router for real clusters: the same Policy objects as the simulator,
fed a ClusterView built from the router's own bookkeeping, with each Decision carried
out as HTTP traffic — plain routing, prefill offload over vLLM's Mooncake connector
protocol, and BTB warming (a Mooncake transfer, or a prefix-only speculative prefill).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from btb_lab.cluster.driver import ClientPool, RunClock, StreamResult, completion_payload
from btb_lab.cluster.launcher import Endpoint
from btb_lab.events import EventLog
from btb_lab.policies.base import CostModel, Decision, InstanceLoad, Policy, WarmAction
from btb_lab.records import Request, RequestRecord

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
    warm_s: list[float] = field(default_factory=list)

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
            "warm_p50_s": warm[len(warm) // 2] if warm else None,
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
        connector: str = "none",
        cache_blocks: int = 100_000,
        variant: str = "",
        repeat: int = 0,
    ) -> None:
        self.endpoints = list(endpoints)
        self.policy = policy
        self.client = client
        self.clock = clock
        self.model = model
        self.prompt_fn = prompt_fn
        self.connector = connector
        self.variant = variant
        self.repeat = repeat
        self.state = RouterState(self.endpoints, costs, clock, cache_blocks=cache_blocks)
        self.stats = RoutingStats()
        self.events = EventLog("router")  # warm copies and KV transfers, as they happen
        self._engine_ids: dict[int, str] = {}
        self._warm_tasks: set[asyncio.Task[None]] = set()
        self._warming: set[tuple[int, int, int]] = set()
        self._ids = itertools.count()

    def _url(self, instance: int) -> str:
        return self.endpoints[instance].base_url + "/v1/completions"

    async def engine_id(self, instance: int) -> str:
        """The prefiller's engine id from its Mooncake bootstrap server (`/query`)."""
        if instance not in self._engine_ids:
            boot = self.endpoints[instance].bootstrap_url
            if boot is None:
                raise RuntimeError(f"instance {self.endpoints[instance].name} has no bootstrap")
            resp = await self.client.get(boot + "/query")
            resp.raise_for_status()
            data = resp.json()
            self._engine_ids[instance] = str(data[min(data, key=int)]["engine_id"])
        return self._engine_ids[instance]

    # one request ------------------------------------------------------------------------
    async def dispatch(self, request: Request, target_s: float) -> RequestRecord:
        """Route, execute, and return the finished record (never raises for HTTP)."""
        decision = self.policy.route(request, self.state)
        self.stats.routes[decision.route] = self.stats.routes.get(decision.route, 0) + 1
        name = self.endpoints[decision.instance].name
        self.stats.per_instance[name] = self.stats.per_instance.get(name, 0) + 1
        prompt = self.prompt_fn(request)
        for action in decision.warm:
            self.start_warm(action, request, prompt)
        offload = (
            decision.prefill_instance is not None and decision.prefill_instance != decision.instance
        )
        if offload and self.connector == "mooncake":
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
            payload = completion_payload(self.model, prompt, request.output_tokens)
            res = await self.client.stream_completion(self._url(inst), payload, self.clock)
        finally:
            self.state.end(inst, tokens)
        if res.first_token_s is not None:
            self.state.prefilled(inst, blocks)
        return self._record(request, decision, res, target_s)

    async def _offload(
        self, request: Request, decision: Decision, prompt: list[int], target_s: float
    ) -> RequestRecord:
        """vLLM's Mooncake P/D protocol: the router names a transfer id; the prefiller
        runs the prompt with `do_remote_decode` and max_tokens 1 while the decoder, told
        the prefiller's bootstrap address and engine id, pulls the KV and decodes."""
        assert decision.prefill_instance is not None
        p, d = decision.prefill_instance, decision.instance
        self.stats.offloads += 1
        transfer_id = f"xfer-{self.variant}-{self.repeat}-{request.request_id}-{next(self._ids)}"
        blocks = request.block_hashes
        self.state.begin(p, request.input_tokens, blocks)
        self.state.begin(d, request.input_tokens + request.output_tokens, blocks)
        try:
            try:
                engine_id = await self.engine_id(p)
            except Exception as exc:  # bootstrap unreachable: a failed request, not a crash
                res = StreamResult(sent_s=self.clock.now(), error=f"Bootstrap:{type(exc).__name__}")
                return self._record(request, decision, res, target_s)
            produce, consume = self._mooncake_params(p, engine_id, transfer_id)
            prefill_body = completion_payload(
                self.model, prompt, 1, stream=False, kv_transfer_params=produce
            )
            if decision.prefill_cold:
                # A prefill service without the session's cache: a unique salt makes vLLM's
                # prefix cache miss, so the prefill is computed cold as the policy modeled.
                prefill_body["cache_salt"] = f"cold-{transfer_id}"
            decode_body = completion_payload(
                self.model, prompt, request.output_tokens, kv_transfer_params=consume
            )
            prefill_task = asyncio.create_task(
                self.client.stream_completion(self._url(p), prefill_body, self.clock)
            )
            decode = await self.client.stream_completion(self._url(d), decode_body, self.clock)
            prefill = await prefill_task
        finally:
            self.state.end(p, request.input_tokens)
            self.state.end(d, request.input_tokens + request.output_tokens)
        if prefill.ok:
            self.state.prefilled(p, blocks)
        if decode.first_token_s is not None:
            self.state.prefilled(d, blocks)
        if prefill.finish_s is not None:  # the KV moves once the producer's prefill is done
            landed = decode.first_token_s
            self.events.kv_transfer(
                prefill.finish_s, max(landed, prefill.finish_s) if landed is not None else None,
                self.endpoints[d].name, self.endpoints[p].name, request.input_tokens,
                request_id=request.request_id,
            )  # fmt: skip
        if not prefill.ok and decode.ok:
            decode.ok, decode.error = False, f"Prefill:{prefill.error}"
        record = self._record(request, decision, decode, target_s)
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
            cached_tokens=int(res.cached_tokens or 0),
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
            extra={"chunks": res.chunks, "retried": int(res.retried)},
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
        self._warming.add(key)
        blocks = request.block_hashes[:n]
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
        try:
            use_rdma = (
                action.mode == "rdma"
                and self.connector == "mooncake"
                and action.source is not None
                and action.source != target
            )
            if use_rdma:
                assert action.source is not None
                ok = await self._warm_transfer(action.source, target, tokens, request)
            else:  # speculative prefill: compute the prefix on the target itself
                body = completion_payload(self.model, tokens, 1, stream=False)
                res = await self.client.stream_completion(self._url(target), body, self.clock)
                ok = res.ok
        finally:
            self.state.end(target, len(tokens))
            self._warming.discard(key)
        if ok:
            self.stats.warms_ok += 1
            self.stats.warm_s.append(self.clock.now() - start)
            self.state.prefilled(target, blocks)
        else:
            self.stats.warms_failed += 1
        # (the try above either bound use_rdma or raised)
        source = "" if not use_rdma or action.source is None else self.endpoints[action.source].name
        self.events.warm_copy(
            start, self.clock.now() if ok else None, self.endpoints[target].name, source,
            len(tokens), mode="rdma" if use_rdma else "prefill", request_id=request.request_id,
        )  # fmt: skip

    def _mooncake_params(
        self, producer: int, engine_id: str, transfer_id: str
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """`kv_transfer_params` of one Mooncake transfer: the producer's (prefill for remote
        decode) and the consumer's (pull from the producer's bootstrap server)."""
        produce = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
        consume = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": self.endpoints[producer].bootstrap_url,
            "remote_engine_id": engine_id,
            "transfer_id": transfer_id,
        }
        return produce, consume

    async def _warm_transfer(
        self, source: int, target: int, tokens: list[int], request: Request
    ) -> bool:
        """Copy the prefix's KV source → target with the connector: the source prefills
        the prefix for remote decode (cache hit there), the target pulls it."""
        try:
            engine_id = await self.engine_id(source)
        except Exception:
            return False
        transfer_id = f"warm-{self.variant}-{self.repeat}-{request.request_id}-{next(self._ids)}"
        produce, consume = self._mooncake_params(source, engine_id, transfer_id)
        src_body = completion_payload(
            self.model, tokens, 1, stream=False, kv_transfer_params=produce
        )
        dst_body = completion_payload(
            self.model, tokens, 1, stream=False, kv_transfer_params=consume
        )
        src_task = asyncio.create_task(
            self.client.stream_completion(self._url(source), src_body, self.clock)
        )
        dst = await self.client.stream_completion(self._url(target), dst_body, self.clock)
        src = await src_task
        return src.ok and dst.ok

    async def drain(self) -> None:
        """Wait for warm transfers still in flight (they belong to this run)."""
        while self._warm_tasks:
            await asyncio.wait(set(self._warm_tasks))
