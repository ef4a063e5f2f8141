"""The discrete-event cluster engine: continuous batching, a block-level prefix cache per
instance, KV movement between instances, and a routing policy deciding at each arrival.

This module is the event loop, the arrivals (routing) and the completion handlers. The
engine is built in layers, each importing only those below it: `Engine` here extends
`steps.py` (mixed prefill/decode steps, `step_model: mixed`), over `actions.py` (a
policy's pin, evict, demote and promote), over `transfers.py` (warm
copies and prefill offload), which extends `scheduler.py` (the
engine's state, the admission rule, prefills, decode segments, KV accounting), over
`instance.py` (per-instance runtime state, the policy's view, utilization) and the parts
with invariants of their own: the prefix cache in `cache.py`, the decode-segment
arithmetic in `decode.py`, the job kinds in `jobs.py`. With an `EventLog` the engine
records queue and batch changes, warm copies and KV transfers as they happen.

Events sit in one heap keyed `(time, priority, sequence)`, so ties resolve the same way
every run; arrivals stream in from the sorted request list under the same key order
instead of filling the heap. A decode phase is advanced in closed form to the next event
(the first sequence to finish, or the step boundary at which an admission pauses it)
rather than token by token. The simulated clock is the only clock.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from btb_lab.collector import paused
from btb_lab.policies.base import Decision
from btb_lab.records import Request, RequestRecord, UtilSample
from btb_lab.sim.cache import SimInvariantError
from btb_lab.sim.instance import PHASE_DECODE, PHASE_IDLE, utilization_samples
from btb_lab.sim.jobs import PrefillJob, ReqJob, WarmJob, WarmLogEntry, kv_need
from btb_lab.sim.scheduler import PRI_ARRIVAL
from btb_lab.sim.steps import MixedSteps
from btb_lab.workload.sessions import SessionGate

__all__ = ["Engine", "EngineResult", "SimInvariantError", "WarmLogEntry"]

EV_RELEASE = 7  # `_run`'s handler index: a held turn of a closed session goes now


@dataclass
class EngineResult:
    utilization: list[UtilSample] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    end_s: float = 0.0


class Engine(MixedSteps):
    """One simulated run: build with the cost model, settings and policy (the constructor
    is `Scheduler`'s), then `run`."""

    # ---------------------------------------------------------------- run loop
    def run(
        self,
        requests: Sequence[Request],
        emit: Callable[[RequestRecord], None],
        *,
        sessions: SessionGate | None = None,
    ) -> EngineResult:
        """Replay `requests` (sorted by arrival, ties by position); `emit` gets each
        record as its request finishes. With `sessions` (closed session replay) a turn
        waits for the session's earlier turns to finish."""
        self.emit = emit
        if sessions is not None:
            self.emit = self._releasing(emit, sessions)
            self._on_arrival = self._gated(sessions)  # type: ignore[method-assign,assignment]
        # The run allocates millions of small acyclic objects; the cyclic collector would
        # rescan them over and over (about a third of the run time) for nothing.
        with paused():
            result = self._run(requests)
        if sessions is not None:
            if sessions.holding:
                raise SimInvariantError(f"{sessions.holding} held turns were never sent")
            result.stats["session_held"] = sessions.held_total
        return result

    def _gated(self, sessions: SessionGate) -> Callable[[Request], None]:
        """`_on_arrival` for closed sessions: a turn whose session is still answering an
        earlier turn is held (`_releasing` sends it); under closed_think a turn whose
        earlier turns are done goes after its think gap."""
        route = self._route

        def on_arrival(req: Request) -> None:
            now = self.now
            send_s = sessions.arrive(req, now)
            if send_s == now:
                route(req)
            elif send_s is not None:  # closed_think: after the think gap
                self._push(send_s, PRI_ARRIVAL, EV_RELEASE, 0, req)

        return on_arrival

    def _releasing(
        self, emit: Callable[[RequestRecord], None], sessions: SessionGate
    ) -> Callable[[RequestRecord], None]:
        """`emit`, then the held turns this finish lets go, routed at their send time (this
        instant, or after a think gap) after everything else at it (as arrivals are)."""

        def emit_and_release(rec: RequestRecord) -> None:
            emit(rec)
            for send_s, req in sessions.finish(rec.trace_id, rec.session_id, rec.turn, self.now):
                self._push(send_s, PRI_ARRIVAL, EV_RELEASE, 0, req)

        return emit_and_release

    def _run(self, requests: Sequence[Request]) -> EngineResult:
        # stable: ties keep their position (a C-level key, not a call per request)
        order = sorted(range(len(requests)), key=[r.arrival_s for r in requests].__getitem__)
        heap = self.heap
        pop = heapq.heappop
        handlers = (
            self._on_transfer,
            self._on_park,
            self._on_prefill,
            self._on_segment,
            self._on_cache,
            self._on_batch,
            self._on_wake,
            self._on_release,
        )
        audit = self.audit
        events = 0
        last = -math.inf
        for i in order:
            req = requests[i]
            t = req.arrival_s
            while heap and (heap[0][0] < t or (heap[0][0] == t and heap[0][1] < PRI_ARRIVAL)):
                te, _, _, kind, index, payload = pop(heap)
                if audit:
                    last = self._audit_time(te, last)
                self.now = te
                handlers[kind](index, payload)
                events += 1
            if audit:
                last = self._audit_time(t, last)
            self.now = t
            self._on_arrival(req)
            events += 1
        while heap:
            te, _, _, kind, index, payload = pop(heap)
            if audit:
                last = self._audit_time(te, last)
            self.now = te
            handlers[kind](index, payload)
            events += 1
        self.stats["events"] = events
        for inst in self.insts:
            if inst.phase != PHASE_IDLE or inst.waiting or inst.run_heap:
                raise SimInvariantError(f"{inst.name} did not drain")
        utilization = utilization_samples(self.insts, self.dt, self.now)
        return EngineResult(utilization, dict(self.stats), self.now)

    def _audit_time(self, t: float, last: float) -> float:
        if t < last:
            raise SimInvariantError(f"time went backwards: {t} < {last}")
        bt = self.block_tokens
        for inst in self.insts:
            cache = inst.cache
            cache.check()
            if cache.n_pinned() and not self.sharing:
                raise SimInvariantError(f"{inst.name}: blocks pinned without sharing")
            if inst.n_seqs > self.max_batch:
                raise SimInvariantError(f"{inst.name}: batch above max_batch")
            dup = 0
            for h, refs in inst.shared.refs.items():
                if refs <= 0 or not cache.pin_count(h):
                    raise SimInvariantError(f"{inst.name}: decode reference to block {h} bad")
                dup += (refs - 1) * bt
            if dup != inst.shared.dup_tokens or (dup and not self.shared_attn):
                raise SimInvariantError(f"{inst.name}: shared prefix count {dup} is off")
            if not inst.run_heap and (inst.shared.refs or inst.ctx_base):
                raise SimInvariantError(f"{inst.name}: decode context left with no batch")
        return t

    # ---------------------------------------------------------------- arrivals
    def _on_release(self, _index: int, req: Request) -> None:
        self._route(req)

    def _route(self, req: Request) -> None:
        """Route `req` and queue its work: it is sent now (its arrival, or the finish of
        the turn it waited for)."""
        now = self.now
        view = self.view
        view.now_s = now
        decision: Decision = self.policy.route(req, view)
        insts = self.insts
        n = len(insts)
        d = decision.instance
        p = decision.prefill_instance
        if not 0 <= d < n or (p is not None and not 0 <= p < n):
            raise ValueError(
                f"policy {self.policy.name!r} chose instance {d} / prefill {p} "
                f"for request {req.request_id}; the cluster has {n} instances"
            )
        if p == d:
            p = None
        elif p is not None and not self.moves_kv:  # no connector: prefilled where it decodes
            self.stats["offloads_without_connector"] += 1
            p = None
        rec = RequestRecord(
            variant=self.variant,
            repeat=self.repeat,
            request_id=req.request_id,
            trace_id=req.trace_id,
            source=req.source,
            session_id=req.session_id,
            instance=insts[d].name,
            route=decision.route,
            arrival_s=req.arrival_s,
            sent_s=now,
            first_token_s=None,
            finish_s=None,
            input_tokens=req.input_tokens,
            output_tokens=req.output_tokens,
            klass=req.klass,
            turn=req.turn,
            group_id=req.group_id,
            prefill_instance=insts[p].name if p is not None else None,
        )
        for action in decision.warm:
            self._warm(req, action)
        if decision.cache:
            for cache_action in decision.cache:
                self._cache_action(req, cache_action)
        dinst = insts[d]
        total = req.input_tokens + req.output_tokens
        dinst.load.outstanding_tokens += total
        if self.view_routed:
            dinst.routed.note(req.block_hashes)
        # KV the prompt occupies: its tokens, or with sharing its hashed blocks whole
        prompt = req.input_tokens
        if self.sharing and len(req.block_hashes) * self.block_tokens > prompt:
            prompt = len(req.block_hashes) * self.block_tokens
        if p is None:
            self._enqueue(dinst, ReqJob(req, rec, *kv_need(prompt, req)))
        else:
            pinst = insts[p]
            pinst.load.outstanding_tokens += req.input_tokens
            if self.view_routed:
                pinst.routed.note(req.block_hashes)
            job = PrefillJob(
                req, rec, prompt, prefill_inst=p, decode_inst=d, cold=decision.prefill_cold
            )
            self._enqueue(pinst, job)

    _on_arrival = _route  # open replay: every arrival is sent at once (see run)

    # ---------------------------------------------------------------- handlers
    def _on_prefill(self, index: int, job: ReqJob | PrefillJob | WarmJob) -> None:
        inst = self.insts[index]
        self._land_prefill(inst, job)
        # phase is still PREFILL (busy): _step picks the next piece of work or goes idle
        self._step(inst)

    def _on_segment(self, index: int, version: int) -> None:
        inst = self.insts[index]
        if version != inst.seg_version or inst.phase != PHASE_DECODE:
            return  # superseded by a cut
        self._retire(inst, inst.seg_steps)
        self._step(inst)
