"""The discrete-event cluster engine: continuous batching, a block-level prefix cache per
instance, KV movement between instances, and a routing policy deciding at each arrival.

This module is the event loop, its handlers and the scheduling they share: one state
machine over the instances' runtime state, kept in one file (hence its ~900 lines) so a
handler and the scheduling it triggers read together. The parts with invariants of their
own live beside it: the per-instance prefix cache in `cache.py`, the decode-segment
arithmetic in `decode.py`, the job kinds of the waiting queues in `jobs.py`.

Events sit in one heap keyed `(time, priority, sequence)`, so ties resolve the same way
every run; arrivals stream in from the sorted request list under the same key order
instead of filling the heap. A decode phase is advanced in closed form to the next event
(the first sequence to finish, or the step boundary at which an admission pauses it)
rather than token by token. The simulated clock is the only clock.

KV accounting (`kv_prefix_sharing`, on by default; off reserves `input + output` tokens
per admitted request, engine version 1's rule). With sharing, as in vLLM's ref-counted prefix
cache, a request holds two things while it runs:

- *pinned* blocks: the cached blocks of its prompt it reuses, shared with every other
  running request that reuses them (a reference count per block). Pinned blocks stay in
  the HBM cache and are never evicted; when the last reference goes they become the most
  recently used unpinned (evictable) cache blocks.
- *reserved* tokens: the rest of its prompt (counted in whole blocks for the hashed
  part, as a paged cache allocates them) plus its output (none for a prefill done for
  another instance).

The budget invariant is `pinned blocks × block_tokens + reserved <= kv_budget_tokens`, and
the unpinned cache blocks fill what is left. Admission checks the same sum with the job's
full cost less the leading blocks of its prompt already pinned there (a lower bound on
what it will pin, so the check is never optimistic). Under `at_admission` the whole
prompt is inserted and pinned at admission; under `after_prefill` a request pins the
blocks it reuses at admission and, when its prefill completes and its own blocks become
resident, those blocks move from its reservation to its pins one for one (the simplest
rule that keeps the invariant and lets later requests share them at once).

Decode bandwidth. By default a decode step reads every sequence's whole context: sharing
saves memory, not bandwidth. With `shared_prefix_attention` (cascade attention, as in
vLLM) a pinned leading prompt block that several decoding sequences share is read once
per step: each instance counts the decoding sequences referencing each such block and
keeps the sum over blocks of (refs - 1) × block_tokens (`decode.SharedPrefixReads`),
subtracted from `ctx_base` as a sequence joins the batch and added back as it leaves.
Joins and leaves happen only at segment boundaries, so the closed form stays exact.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections import deque
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any

from btb_lab.errors import UserError
from btb_lab.policies.base import Decision, InstanceLoad, Policy, WarmAction
from btb_lab.records import Request, RequestRecord, UtilSample
from btb_lab.sim.cache import PrefixCache, RoutedBlocks, SimInvariantError
from btb_lab.sim.costs import SimCostModel
from btb_lab.sim.decode import TIME_EPS_S, SharedPrefixReads, segment_s, steps_reaching
from btb_lab.sim.hardware import InstanceSpec
from btb_lab.sim.jobs import DecodeJob, Job, KVJob, PrefillJob, ReqJob, WarmJob
from btb_lab.sim.settings import SimSettings

__all__ = ["Engine", "EngineResult", "SimInvariantError", "WarmLogEntry"]

# Event priorities at equal times: KV arrivals first (they can unblock admissions), then
# completions, then arrivals, so a router always sees the state after everything that
# happened at that instant.
PRI_TRANSFER = 0
PRI_PARK = 1
PRI_PREFILL = 2
PRI_SEGMENT = 3
PRI_ARRIVAL = 4

EV_TRANSFER = 0
EV_PARK = 1
EV_PREFILL = 2
EV_SEGMENT = 3

PHASE_IDLE = 0
PHASE_PREFILL = 1
PHASE_DECODE = 2


@dataclass(slots=True, frozen=True)
class WarmLogEntry:
    """One warming copy, for audits: it must never start before its source is complete."""

    source: int
    target: int
    n_blocks: int
    decided_s: float
    start_s: float
    source_complete_s: float  # when the copied blocks were complete on the source
    done_s: float


class _Warm:
    """A warming copy in flight: the payload of its transfer event."""

    __slots__ = ("hashes", "source", "target")

    def __init__(self, source: int, target: int, hashes: Sequence[int]) -> None:
        self.source = source
        self.target = target
        self.hashes = hashes


class _Inst:
    """Runtime state of one instance (its static shape is `spec`)."""

    __slots__ = (
        "busy_bins",
        "busy_since",
        "cache",
        "ctx_base",
        "dK",
        "dW",
        "disk_tok_s",
        "index",
        "link_free_s",
        "load",
        "mem_bin",
        "mem_peak",
        "mem_samples",
        "n_seqs",
        "name",
        "p_tok_s",
        "phase",
        "ram_tok_s",
        "routed",
        "run_heap",
        "run_seq",
        "seg_c0",
        "seg_c1",
        "seg_start",
        "seg_steps",
        "seg_version",
        "shared",
        "spec",
        "steps_done",
        "waiting",
    )

    def __init__(
        self,
        spec: InstanceSpec,
        settings: SimSettings,
        block_tokens: int,
        disk: set[int] | None,
    ) -> None:
        self.spec = spec
        self.index = spec.index
        self.name = spec.name
        self.waiting: deque[Job] = deque()
        self.phase = PHASE_IDLE
        self.seg_start = 0.0
        self.seg_steps = 0
        self.seg_c0 = 0.0
        self.seg_c1 = 0.0
        self.seg_version = 0
        self.steps_done = 0
        self.run_heap: list[tuple[int, int, DecodeJob]] = []
        self.run_seq = 0
        self.ctx_base = 0
        self.n_seqs = 0
        kvb = spec.kv_bytes_per_token
        ram_cap_blocks = (
            int(settings.host_ram_bytes // (kvb * block_tokens)) if settings.host_ram_tier else 0
        )
        self.cache = PrefixCache(
            spec.name,
            spec.kv_budget_tokens,
            block_tokens,
            ram_cap_blocks=ram_cap_blocks,
            disk=disk,
        )
        # shared_prefix_attention: the pinned prompt blocks the decoding batch shares
        self.shared = SharedPrefixReads(block_tokens)
        self.link_free_s = 0.0
        self.routed = RoutedBlocks(max(1, spec.kv_budget_tokens // block_tokens))
        self.load = InstanceLoad(spec.index, spec.name, spec.role, 0, 0, 0)
        self.busy_since = 0.0
        self.busy_bins: list[float] = []
        self.mem_bin = -1
        self.mem_peak = 0
        self.mem_samples: dict[int, int] = {}
        # Closed-form coefficients (seconds).
        self.p_tok_s = 2.0 * spec.model.active_params / (spec.flops * settings.mfu)
        slow = 1.0 + (settings.connector_decode_slowdown if spec.kv_connector else 0.0)
        bw = spec.hbm_bw * settings.mbu
        self.dW = spec.model.active_weight_bytes / bw * slow
        self.dK = kvb / bw * slow
        self.ram_tok_s = kvb / spec.ram_bw
        self.disk_tok_s = kvb / spec.disk_bw


class _View:
    """The `ClusterView` a policy sees; attributes are updated in place as the run goes."""

    __slots__ = ("_complete", "_known", "costs", "instances", "now_s")

    def __init__(self, engine: Engine) -> None:
        self.now_s = 0.0
        self.instances: list[InstanceLoad] = [i.load for i in engine.insts]
        self.costs = engine.costs
        # the cache objects live as long as the run, so the view can hold them directly
        self._complete = [i.cache for i in engine.insts]
        self._known: list[Container[int]] = [
            i.routed.block_set() if engine.view_routed else i.cache.block_set()
            for i in engine.insts
        ]

    def match_blocks(self, instance: int, block_hashes: Sequence[int]) -> int:
        # the cache's `lead` over the known blocks, fused here: policies call this for every
        # instance at every arrival, and a second call per match costs ~1% of a run
        known = self._known[instance]
        n = 0
        for h in block_hashes:
            if h not in known:
                return n
            n += 1
        return n

    def complete_blocks(self, instance: int, block_hashes: Sequence[int]) -> int:
        return self._complete[instance].lead(block_hashes)


@dataclass
class EngineResult:
    utilization: list[UtilSample] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    end_s: float = 0.0


class Engine:
    """One simulated run: build with the instances, settings and policy, then `run`."""

    def __init__(
        self,
        instances: list[InstanceSpec],
        settings: SimSettings,
        policy: Policy,
        *,
        block_tokens: int,
        variant: str = "",
        repeat: int = 0,
        audit: bool = False,
    ) -> None:
        if not instances:
            raise UserError("the cluster has no instances")
        self.specs = instances
        self.settings = settings
        self.policy = policy
        self.block_tokens = block_tokens
        self.variant = variant
        self.repeat = repeat
        self.audit = audit
        self.after_prefill = settings.kv_visibility == "after_prefill"
        self.view_routed = settings.router_view == "routed"
        self.reusable = settings.transferred_kv_reusable
        self.sharing = settings.kv_prefix_sharing
        self.shared_attn = settings.shared_prefix_attention and self.sharing
        self.max_batch = settings.max_batch
        self.setup_s = settings.transfer_setup_ms / 1e3
        self.dt = settings.sample_interval_s
        # the disk tier is one set of blocks shared by the cluster
        self.disk: set[int] = set()
        disk = self.disk if settings.disk_tier else None
        self.insts = [_Inst(s, settings, block_tokens, disk) for s in instances]
        self.costs = SimCostModel(instances, settings.mfu, self.setup_s)
        self.view = _View(self)
        self.heap: list[tuple[float, int, int, int, int, Any]] = []
        self.seq = 0
        self.now = 0.0
        self.emit: Callable[[RequestRecord], None] = lambda rec: None
        self.stats: dict[str, float] = {
            "warm_copies": 0,
            "warm_copies_skipped": 0,
            "warm_prefills": 0,
            "warm_bytes": 0.0,
            "kv_transfers": 0,
            "parked_for_warm": 0,
            "failed": 0,
            "events": 0,
        }
        self.warm_log: list[WarmLogEntry] = []
        # skip the call per finished request when the policy keeps no state
        self.notify_finish = type(policy).on_finish is not Policy.on_finish

    # ---------------------------------------------------------------- run loop
    def run(
        self, requests: Sequence[Request], emit: Callable[[RequestRecord], None]
    ) -> EngineResult:
        """Replay `requests` (sorted by arrival, ties by position); `emit` gets each
        record as its request finishes."""
        self.emit = emit
        # The run allocates millions of small acyclic objects; the cyclic collector would
        # rescan them over and over (about a third of the run time) for nothing.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(requests)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _run(self, requests: Sequence[Request]) -> EngineResult:
        # stable: ties keep their position (a C-level key, not a call per request)
        order = sorted(range(len(requests)), key=[r.arrival_s for r in requests].__getitem__)
        heap = self.heap
        pop = heapq.heappop
        handlers = (self._on_transfer, self._on_park, self._on_prefill, self._on_segment)
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
        return EngineResult(self._utilization(), dict(self.stats), self.now)

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

    def _push(self, t: float, pri: int, kind: int, inst: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, pri, self.seq, kind, inst, payload))

    # ---------------------------------------------------------------- arrivals
    def _on_arrival(self, req: Request) -> None:
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
        rec = RequestRecord(
            variant=self.variant,
            repeat=self.repeat,
            request_id=req.request_id,
            trace_id=req.trace_id,
            source=req.source,
            session_id=req.session_id,
            instance=insts[d].name,
            route=decision.route,
            arrival_s=now,
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
            self._enqueue(dinst, ReqJob(req, rec, prompt + req.output_tokens))
        else:
            pinst = insts[p]
            pinst.load.outstanding_tokens += req.input_tokens
            if self.view_routed:
                pinst.routed.note(req.block_hashes)
            job = PrefillJob(
                req, rec, prompt, prefill_inst=p, decode_inst=d, cold=decision.prefill_cold
            )
            self._enqueue(pinst, job)

    def _enqueue(self, inst: _Inst, job: Job) -> None:
        job.enq_s = self.now
        inst.waiting.append(job)
        inst.load.waiting += 1
        # _kick, inlined (once per queued job)
        phase = inst.phase
        if phase == PHASE_IDLE:
            self._step(inst)
        elif phase == PHASE_DECODE and self._admissible(inst, inst.waiting[0]):
            self._cut_segment(inst)

    # ---------------------------------------------------------------- warming
    def _warm(self, req: Request, action: WarmAction) -> None:
        insts = self.insts
        if not 0 <= action.target < len(insts):
            raise ValueError(f"warm target {action.target} out of range")
        target = insts[action.target]
        hashes = req.block_hashes[: max(0, action.n_blocks)]
        if not hashes or target.cache.lead(hashes) >= len(hashes):
            self.stats["warm_copies_skipped"] += 1
            return
        if self.view_routed:
            target.routed.note(hashes)
        if action.mode == "prefill":
            self.stats["warm_prefills"] += 1
            self._enqueue(target, WarmJob(hashes, len(hashes) * req.block_tokens))
            return
        if action.source is None or not 0 <= action.source < len(insts):
            raise ValueError(f"rdma warm action needs a valid source, got {action.source}")
        source = insts[action.source]
        now = self.now
        n_complete = source.cache.lead(hashes)
        ready = now
        n_copy = n_complete
        if n_complete < len(hashes):
            # Blocks still being produced on the source (its running prefill, or a copy
            # arriving there) may be copied once complete, never earlier.
            n_copy, ready = source.cache.pending_run(hashes, n_complete, now)
        if n_copy == 0:
            self.stats["warm_copies_skipped"] += 1
            return
        copy = hashes[:n_copy]
        bw = min(source.spec.rdma_bw, target.spec.rdma_bw)
        nbytes = n_copy * req.block_tokens * target.spec.kv_bytes_per_token
        start = max(now, ready, target.link_free_s)
        done = start + self.setup_s + nbytes / bw
        target.link_free_s = done
        target.cache.expect_copy(copy, done)
        self.stats["warm_copies"] += 1
        self.stats["warm_bytes"] += nbytes
        if self.audit:
            self.warm_log.append(
                WarmLogEntry(source.index, target.index, n_copy, now, start, ready, done)
            )
        self._push(
            done, PRI_TRANSFER, EV_TRANSFER, target.index, _Warm(source.index, target.index, copy)
        )

    # ---------------------------------------------------------------- scheduling
    def _admissible(self, inst: _Inst, job: Job) -> bool:
        """Whether `job`, first in `inst`'s queue, may start now: the batch has room (a
        warm job joins none) and its KV fits beside what admitted requests hold, at its
        full cost or, with sharing, at `_cost`. A job that can never fit is admissible: it
        fails at once, which also unblocks the queue."""
        cache = inst.cache
        cap = cache.cap_tokens
        need = job.need
        if need > cap:
            return True
        if inst.n_seqs >= self.max_batch and not isinstance(job, WarmJob):
            return False
        used = cache.reserved + cache.pinned_tokens  # no pins without sharing
        # the full cost fitting settles it without scanning the pins
        return used + need <= cap or (self.sharing and used + self._cost(inst, job) <= cap)

    def _cost(self, inst: _Inst, job: Job) -> int:
        """KV that admitting `job` adds at most (sharing): its full cost less the leading
        prompt blocks already pinned here, which it will reuse without new memory. Cold
        prefills, warm jobs and received KV that is not reusable share nothing."""
        need = job.need
        if isinstance(job, WarmJob) or not job.hashes:
            return need
        if isinstance(job, PrefillJob):
            if job.cold:
                return need
        elif isinstance(job, KVJob) and (job.cold or not self.reusable):
            return need
        return need - inst.cache.lead_pinned(job.hashes) * self.block_tokens

    def _kick(self, inst: _Inst) -> None:
        """Something changed on `inst`: start work if idle, or cut the current decode
        segment at the next step boundary when an admission is waiting (prefill priority)."""
        phase = inst.phase
        if phase == PHASE_IDLE:
            self._step(inst)
        elif phase == PHASE_DECODE and inst.waiting and self._admissible(inst, inst.waiting[0]):
            self._cut_segment(inst)

    def _cut_segment(self, inst: _Inst) -> None:
        """Stop the running decode segment at the step boundary at or after now."""
        k = steps_reaching(self.now - inst.seg_start, inst.seg_c0, inst.seg_c1)
        if k >= inst.seg_steps:
            return
        inst.seg_steps = k
        inst.seg_version += 1
        self._push(
            segment_s(k, inst.seg_c0, inst.seg_c1, inst.seg_start),
            PRI_SEGMENT,
            EV_SEGMENT,
            inst.index,
            inst.seg_version,
        )

    def _step(self, inst: _Inst) -> None:
        """Admit what fits (one prefill at a time, decode paused), else run a decode
        segment up to the next finishing sequence, else go idle."""
        now = self.now
        waiting = inst.waiting
        was_idle = inst.phase == PHASE_IDLE
        cap = inst.cache.cap_tokens
        while waiting:
            job = waiting[0]
            if job.need > cap:
                waiting.popleft()
                inst.load.waiting -= 1
                self._fail(inst, job, f"needs {job.need} KV tokens; {inst.name} holds {cap}")
                continue
            if not self._admissible(inst, job):
                break
            waiting.popleft()
            inst.load.waiting -= 1
            if isinstance(job, KVJob):
                self._admit_kv(inst, job)
                continue
            if self._start_prefill(inst, job):
                if was_idle:
                    inst.busy_since = now
                return
        if inst.run_heap:
            b = len(inst.run_heap)
            steps = inst.run_heap[0][0] - inst.steps_done
            k_tokens = inst.ctx_base + b * inst.steps_done
            c0 = inst.seg_c0 = inst.dW + k_tokens * inst.dK
            c1 = inst.seg_c1 = b * inst.dK
            inst.seg_start = now
            inst.seg_steps = steps
            inst.seg_version += 1
            inst.phase = PHASE_DECODE
            if was_idle:
                inst.busy_since = now
            self._push(
                segment_s(steps, c0, c1, now),
                PRI_SEGMENT,
                EV_SEGMENT,
                inst.index,
                inst.seg_version,
            )
            return
        if not was_idle:
            self._add_busy(inst, inst.busy_since, now)
        inst.phase = PHASE_IDLE

    def _reserve(self, inst: _Inst, tokens: int) -> None:
        """Reserve `tokens` of KV on `inst` (sampling its memory use), then fit the cache in
        what is left."""
        cache = inst.cache
        cache.reserved += tokens
        used = cache.reserved + cache.pinned_tokens
        k = int(self.now / self.dt)
        if k != inst.mem_bin:
            if inst.mem_bin >= 0:
                inst.mem_samples[inst.mem_bin] = inst.mem_peak
            inst.mem_bin = k
            inst.mem_peak = used
        elif used > inst.mem_peak:
            inst.mem_peak = used
        cache.fit()

    def _start_prefill(self, inst: _Inst, job: ReqJob | PrefillJob | WarmJob) -> bool:
        """Start the prefill of `job`; False when it was parked to wait for a warm copy."""
        now = self.now
        hashes = job.hashes
        bt = self.block_tokens
        tokens = job.tokens if isinstance(job, WarmJob) else job.req.input_tokens
        p_tok = inst.p_tok_s
        cached = 0
        load_s = 0.0
        tier: str | None = None
        n_use = 0
        cache = inst.cache
        if hashes and not (isinstance(job, PrefillJob) and job.cold):
            n_hbm_lead, n, n_ram, n_disk, m, ready = cache.locate(hashes, now)
            # best of: HBM-only lead, or the whole run loaded from lower tiers
            c_lead = min(n_hbm_lead * bt, tokens)
            best = (tokens - c_lead) * p_tok
            n_use, cached, load_s = n_hbm_lead, c_lead, 0.0
            tier = "hbm" if c_lead else None
            if n > n_hbm_lead:
                c_all = min(n * bt, tokens)
                ld = (n_ram * inst.ram_tok_s + n_disk * inst.disk_tok_s) * bt
                if ld + (tokens - c_all) * p_tok < best:
                    best = ld + (tokens - c_all) * p_tok
                    n_use, cached, load_s = n, c_all, ld
                    tier = "disk" if n_disk else "ram"
            # a warm copy in flight to this instance may beat recomputing: wait for it (once)
            if m > n and not isinstance(job, WarmJob) and not job.parked:
                c_wait = min(m * bt, tokens)
                ld = (n_ram * inst.ram_tok_s + n_disk * inst.disk_tok_s) * bt
                wait_cost = (ready - now) + ld + (tokens - c_wait) * p_tok
                if wait_cost < best:
                    job.parked = True
                    job.park_s = now
                    inst.load.waiting += 1
                    self.stats["parked_for_warm"] += 1
                    self._push(ready, PRI_PARK, EV_PARK, inst.index, job)
                    return False
            if n_use and self.after_prefill:
                # touch / promote the blocks this prefill reuses (at_admission inserts
                # the whole prompt below, which touches them too)
                cache.touch(hashes, n_use)
        prefill_s = (tokens - cached) * p_tok
        dur = load_s + prefill_s
        done = now + dur
        if isinstance(job, WarmJob):
            if hashes and not self.after_prefill:
                cache.insert(hashes, fit=False)
        else:
            inst.n_seqs += 1
            inst.load.running += 1
            rec = job.rec
            rec.queue_s += now - job.enq_s
            rec.cached_tokens = cached
            if job.parked and cached and tier == "hbm":
                tier = "remote"
            rec.cache_tier = tier
            rec.kv_load_s = load_s
            rec.prefill_s = prefill_s
            if isinstance(job, PrefillJob):
                job.prefill_start_s = now
            # at_admission: the whole prompt is resident now; with sharing, pin what it
            # uses before the fit in _reserve, so the fit never evicts it
            if hashes:
                if not self.sharing:
                    if not self.after_prefill:
                        cache.insert(hashes, fit=False)
                elif not self.after_prefill:
                    job.need -= cache.insert_pinned(hashes, job.n_pin)
                    job.n_pin = len(hashes)
                elif n_use > job.n_pin:
                    job.need -= cache.pin(hashes, job.n_pin, n_use)
                    job.n_pin = n_use
        self._reserve(inst, job.need)
        if hashes and self.after_prefill:
            cache.expect(hashes, n_use, done)
        inst.phase = PHASE_PREFILL
        self._push(done, PRI_PREFILL, EV_PREFILL, inst.index, job)
        return True

    def _admit_kv(self, inst: _Inst, job: KVJob) -> None:
        """Decode side of a prefill offload: the KV is here, the request joins the batch
        and streams its first token at this step."""
        now = self.now
        rec = job.rec
        rec.queue_s += now - job.enq_s
        rec.first_token_s = now
        inst.n_seqs += 1
        inst.load.running += 1
        hashes = job.hashes
        if self.reusable and hashes:
            if self.sharing:
                job.need -= inst.cache.insert_pinned(hashes, job.n_pin)
                job.n_pin = len(hashes)
                self._reserve(inst, job.need)
            else:
                self._reserve(inst, job.need)
                inst.cache.insert(hashes)
        else:
            self._reserve(inst, job.need)
        self._begin_decode(inst, job)

    def _begin_decode(self, inst: _Inst, job: DecodeJob) -> None:
        req = job.req
        left = req.output_tokens - 1
        if left <= 0:
            self._finish(inst, job)
            return
        start = inst.steps_done
        inst.run_seq += 1
        heapq.heappush(inst.run_heap, (start + left, inst.run_seq, job))
        inst.ctx_base += req.input_tokens + 1 - start
        if self.shared_attn and job.n_pin:
            inst.ctx_base -= self._join_shared(inst, job, req.input_tokens)

    def _join_shared(self, inst: _Inst, job: DecodeJob, input_tokens: int) -> int:
        """Count `job`'s pinned leading blocks (whole ones inside its prompt) as read by
        the batch; returns the tokens already read by another sequence."""
        n = min(job.n_pin, input_tokens // self.block_tokens)
        if n <= 0:
            return 0
        job.n_shared = n
        return inst.shared.join(job.hashes, n)

    def _leave_shared(self, inst: _Inst, job: DecodeJob) -> int:
        """Undo `_join_shared` as `job` leaves the batch; returns the tokens it no longer
        duplicates."""
        dup = inst.shared.leave(job.hashes, job.n_shared)
        job.n_shared = 0
        return dup

    # ---------------------------------------------------------------- handlers
    def _on_prefill(self, index: int, job: ReqJob | PrefillJob | WarmJob) -> None:
        inst = self.insts[index]
        hashes = job.hashes
        if self.after_prefill and hashes:
            if self.sharing and not isinstance(job, WarmJob):
                # its own blocks are resident now: move them from reserved to pinned
                pinned = inst.cache.insert_pinned(hashes, job.n_pin)
                job.n_pin = len(hashes)
                job.need -= pinned
                inst.cache.reserved -= pinned
                inst.cache.fit()
            else:
                inst.cache.insert(hashes)
        if isinstance(job, ReqJob):
            job.rec.first_token_s = self.now
            self._begin_decode(inst, job)
        elif isinstance(job, PrefillJob):
            self._ship_kv(inst, job)
        # phase is still PREFILL (busy): _step picks the next piece of work or goes idle
        self._step(inst)

    def _ship_kv(self, pinst: _Inst, job: PrefillJob) -> None:
        """Prefill instance done: move the KV to the decode instance over RDMA."""
        req = job.req
        now = self.now
        pinst.n_seqs -= 1
        pinst.load.running -= 1
        pinst.load.outstanding_tokens -= req.input_tokens
        dinst = self.insts[job.decode_inst]
        bw = min(pinst.spec.rdma_bw, dinst.spec.rdma_bw)
        dur = self.setup_s + req.input_tokens * dinst.spec.kv_bytes_per_token / bw
        if self.settings.layerwise:
            start = max(job.prefill_start_s, dinst.link_free_s)
            done = max(start + dur, now + dur / pinst.spec.model.layers)
        else:
            start = max(now, dinst.link_free_s)
            done = start + dur
        dinst.link_free_s = done
        job.rec.kv_transfer_s += done - now
        self.stats["kv_transfers"] += 1
        self._push(done, PRI_TRANSFER, EV_TRANSFER, dinst.index, job)

    def _on_transfer(self, index: int, payload: _Warm | PrefillJob) -> None:
        inst = self.insts[index]
        if isinstance(payload, _Warm):
            inst.cache.insert_arrived(payload.hashes, self.now, TIME_EPS_S)
            self._kick(inst)
            return
        # the KV of a prefill offload arrived: release it on the prefill instance, queue
        # its decode here
        job = payload
        req = job.req
        pinst = self.insts[job.prefill_inst]
        pinst.cache.reserved -= job.need
        if job.n_pin:
            pinst.cache.unpin(job.hashes, job.n_pin)
            job.n_pin = 0
        self._kick(pinst)
        need = job.prompt_tokens + req.output_tokens
        self._enqueue(inst, KVJob(req, job.rec, need, cold=job.cold))

    def _on_park(self, index: int, job: ReqJob | PrefillJob) -> None:
        inst = self.insts[index]
        inst.load.waiting -= 1
        wait = self.now - job.park_s
        job.rec.kv_transfer_s += wait
        job.rec.queue_s -= wait  # counted again at admission; it is transfer time
        inst.waiting.appendleft(job)
        inst.load.waiting += 1
        self._kick(inst)

    def _on_segment(self, index: int, version: int) -> None:
        inst = self.insts[index]
        if version != inst.seg_version or inst.phase != PHASE_DECODE:
            return  # superseded by a cut
        inst.steps_done += inst.seg_steps
        done = inst.steps_done
        run_heap = inst.run_heap
        while run_heap and run_heap[0][0] <= done:
            end_step, _, job = heapq.heappop(run_heap)
            req = job.req
            inst.ctx_base -= req.input_tokens + 1 - (end_step - (req.output_tokens - 1))
            if job.n_shared:
                inst.ctx_base += self._leave_shared(inst, job)
            self._finish(inst, job)
        self._step(inst)

    def _finish(self, inst: _Inst, job: DecodeJob) -> None:
        now = self.now
        rec = job.rec
        req = job.req
        rec.finish_s = now
        assert rec.first_token_s is not None  # stamped at prefill / KV admission
        rec.decode_s = now - rec.first_token_s
        inst.n_seqs -= 1
        inst.load.running -= 1
        inst.cache.reserved -= job.need
        if job.n_pin:
            inst.cache.unpin(job.hashes, job.n_pin)
            job.n_pin = 0
        inst.load.outstanding_tokens -= req.input_tokens + req.output_tokens
        if self.notify_finish:  # the same rule for a failed request (_fail)
            self.policy.on_finish(req, inst.index, now)
        self.emit(rec)

    def _fail(self, inst: _Inst, job: Job, error: str) -> None:
        self.stats["failed"] += 1
        if isinstance(job, WarmJob):
            return
        rec = job.rec
        req = job.req
        rec.ok = False
        rec.error = error
        rec.queue_s += self.now - job.enq_s
        # failed before admission: it reserved and pinned nothing
        if isinstance(job, PrefillJob):
            inst.load.outstanding_tokens -= req.input_tokens
            dinst = self.insts[job.decode_inst]
        else:
            dinst = inst
        dinst.load.outstanding_tokens -= req.input_tokens + req.output_tokens
        # stateful policies free per-request state here, as for a finished request; the
        # instance is the one it was routed to (its decode instance), as in _finish
        if self.notify_finish:
            self.policy.on_finish(req, dinst.index, self.now)
        self.emit(rec)

    # ---------------------------------------------------------------- utilization
    def _add_busy(self, inst: _Inst, a: float, b: float) -> None:
        if b <= a:
            return
        dt = self.dt
        bins = inst.busy_bins
        i = int(a / dt)
        j = int(b / dt)
        if j >= len(bins):
            bins.extend([0.0] * (j + 1 - len(bins)))
        if i == j:
            bins[i] += b - a
            return
        bins[i] += (i + 1) * dt - a
        for k in range(i + 1, j):
            bins[k] = dt
        bins[j] += b - j * dt

    def _utilization(self) -> list[UtilSample]:
        dt = self.dt
        end = self.now
        n_bins = max(1, math.ceil(end / dt - 1e-9))
        out: list[UtilSample] = []
        for inst in self.insts:
            if inst.mem_bin >= 0:
                inst.mem_samples[inst.mem_bin] = inst.mem_peak
            weights = inst.spec.model.weight_total_bytes
            kvb = inst.spec.kv_bytes_per_token
            bins = inst.busy_bins
            for k in range(n_bins):
                span = min(dt, end - k * dt) if end > k * dt else dt
                busy = bins[k] if k < len(bins) else 0.0
                util = min(1.0, busy / span) if span > 0 else 0.0
                mem = weights + inst.mem_samples.get(k, 0) * kvb
                out.append(
                    UtilSample(
                        time_s=min(end, (k + 1) * dt),
                        instance=inst.name,
                        device="sim",
                        utilization=util,
                        memory_bytes=mem,
                        source="sim",
                    )
                )
        return out
