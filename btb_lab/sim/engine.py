"""The discrete-event cluster engine: continuous batching, a block-level prefix cache per
instance, KV movement between instances, and a routing policy deciding at each arrival.

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
per step: each instance counts the decoding sequences referencing each such block
(`dec_refs`) and keeps `shared_dup_tokens` = sum over blocks of (refs - 1) × block_tokens,
subtracted from `ctx_base` as a sequence joins the batch and added back as it leaves.
Joins and leaves happen only at segment boundaries, so the closed form stays exact.
"""

from __future__ import annotations

import gc
import heapq
import math
import sys
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from btb_lab.config.sim import SimSettings
from btb_lab.errors import UserError
from btb_lab.model.costmodel import InstanceCosts, RooflineCostModel
from btb_lab.model.hardware import InstanceSpec
from btb_lab.policies.base import Decision, InstanceLoad, Policy, WarmAction
from btb_lab.records import Request, RequestRecord, UtilSample

__all__ = ["Engine", "SimInvariantError", "WarmLogEntry"]

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

# Job kinds in an instance's waiting queue.
JOB_REQ = 0  # co-located: prefill here, then decode here
JOB_P = 1  # prefill here for another (decode) instance, then ship the KV
JOB_KV = 2  # decode here from KV shipped by a prefill instance
JOB_WARM = 3  # recompute a prefix here to warm the cache (no request behind it)

PHASE_IDLE = 0
PHASE_PREFILL = 1
PHASE_DECODE = 2

_EPS = 1e-12


class SimInvariantError(AssertionError):
    """A model invariant broke (only checked with `audit=True`, as tests do)."""


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


class _Job:
    __slots__ = (
        "admit_s",
        "block_tokens",
        "cold",
        "copy_s",
        "ctx_off",
        "decode_inst",
        "enq_s",
        "hashes",
        "kind",
        "n_pin",
        "n_shared",
        "need",
        "parked",
        "prefill_inst",
        "prefill_start_s",
        "rec",
        "req",
        "run_s",
        "warm_tokens",
    )

    def __init__(self, kind: int, req: Request | None, rec: RequestRecord | None) -> None:
        self.kind = kind
        self.req = req
        self.rec = rec
        self.need = 0  # KV tokens reserved while admitted (the full cost while waiting)
        self.n_pin = 0  # leading blocks of `hashes` this job pins on its current instance
        self.n_shared = 0  # leading blocks it counts in `dec_refs` while decoding
        self.enq_s = 0.0
        self.hashes: Sequence[int] = req.block_hashes if req is not None else ()
        self.block_tokens = req.block_tokens if req is not None else 0
        self.parked = False
        self.cold = False
        self.decode_inst = -1
        self.prefill_inst = -1
        self.prefill_start_s = 0.0
        self.warm_tokens = 0
        self.admit_s = -1.0  # admission: all_that_fit: when admitted (its prefill waits)
        self.run_s = 0.0  # admission: all_that_fit: its prefill's (or copy's) duration
        self.copy_s = -1.0  # a warm copy on the target's compute queue: its duration
        self.ctx_off = 0  # context tokens this sequence adds to ctx_base while decoding


class _Warm:
    __slots__ = ("hashes", "source", "target")

    def __init__(self, source: int, target: int, hashes: Sequence[int]) -> None:
        self.source = source
        self.target = target
        self.hashes = hashes


class _Inst:
    """Runtime state of one instance (its static shape is `spec`)."""

    __slots__ = (
        "admitted",
        "busy_bins",
        "busy_since",
        "cap_tokens",
        "ctx_base",
        "dK",
        "dW",
        "dec_refs",
        "disk_tok_s",
        "hbm",
        "index",
        "link_free_s",
        "load",
        "mem_bin",
        "mem_peak",
        "mem_samples",
        "n_seqs",
        "name",
        "p_tok_s",
        "pending",
        "phase",
        "pins",
        "ram",
        "ram_cap_blocks",
        "ram_tok_s",
        "reserved",
        "routed",
        "routed_cap",
        "run_heap",
        "run_seq",
        "seg_c0",
        "seg_c1",
        "seg_start",
        "seg_steps",
        "seg_version",
        "shared_dup_tokens",
        "spec",
        "steps_done",
        "waiting",
    )

    def __init__(
        self, spec: InstanceSpec, costs: InstanceCosts, settings: SimSettings, block_tokens: int
    ) -> None:
        self.spec = spec
        self.index = spec.index
        self.name = spec.name
        self.waiting: deque[_Job] = deque()
        # admission: all_that_fit: admitted (KV reserved), prefill not started yet
        self.admitted: deque[_Job] = deque()
        self.phase = PHASE_IDLE
        self.seg_start = 0.0
        self.seg_steps = 0
        self.seg_c0 = 0.0
        self.seg_c1 = 0.0
        self.seg_version = 0
        self.steps_done = 0
        self.run_heap: list[tuple[int, int, _Job]] = []
        self.run_seq = 0
        self.ctx_base = 0
        self.n_seqs = 0
        self.reserved = 0
        self.cap_tokens = spec.kv_budget_tokens
        self.hbm: OrderedDict[int, None] = OrderedDict()
        # HBM blocks in use by admitted requests (kv_prefix_sharing): hash -> reference
        # count. Always a subset of `hbm`; never evicted.
        self.pins: dict[int, int] = {}
        # shared_prefix_attention: pinned block -> decoding sequences whose context holds
        # it, and the tokens a step would read twice without cascade attention
        self.dec_refs: dict[int, int] = {}
        self.shared_dup_tokens = 0
        self.ram: OrderedDict[int, None] = OrderedDict()
        kvb = spec.kv_bytes_per_token
        if not settings.host_ram_tier:
            self.ram_cap_blocks = 0
        elif settings.host_ram_bytes is None:
            self.ram_cap_blocks = sys.maxsize  # unbounded
        else:
            self.ram_cap_blocks = int(settings.host_ram_bytes // (kvb * block_tokens))
        self.pending: dict[int, float] = {}
        self.link_free_s = 0.0
        self.routed: OrderedDict[int, None] = OrderedDict()
        self.routed_cap = max(1, self.cap_tokens // block_tokens)
        self.load = InstanceLoad(spec.index, spec.name, spec.role, 0, 0, 0)
        self.busy_since = 0.0
        self.busy_bins: list[float] = []
        self.mem_bin = -1
        self.mem_peak = 0
        self.mem_samples: dict[int, int] = {}
        # Closed-form coefficients (seconds), from the shared cost model.
        self.p_tok_s = costs.prefill_token_s
        slow = 1.0 + (settings.connector_decode_slowdown if spec.kv_connector else 0.0)
        self.dW = costs.decode_step_s * slow
        self.dK = costs.decode_context_token_s * slow
        self.ram_tok_s = costs.ram_token_s
        self.disk_tok_s = costs.disk_token_s


def _lead(cache: dict[int, Any] | OrderedDict[int, None], hashes: Sequence[int]) -> int:
    """Leading blocks of `hashes` present in `cache`."""
    n = 0
    for h in hashes:
        if h not in cache:
            break
        n += 1
    return n


class _View:
    """The `ClusterView` a policy sees; attributes are updated in place as the run goes."""

    __slots__ = ("_hbm", "_known", "_ram", "costs", "instances", "now_s")

    def __init__(self, engine: Engine) -> None:
        self.now_s = 0.0
        self.instances: list[InstanceLoad] = [i.load for i in engine.insts]
        self.costs = engine.costs
        # the cache objects live as long as the run, so the view can hold them directly
        self._hbm = [i.hbm for i in engine.insts]
        self._known = [i.routed for i in engine.insts] if engine.view_routed else self._hbm
        # router_match_tiers hbm_ram: a resident match also counts host RAM
        both = not engine.view_routed and engine.settings.router_match_tiers == "hbm_ram"
        self._ram = [i.ram for i in engine.insts] if both else None

    def match_blocks(self, instance: int, block_hashes: Sequence[int]) -> int:
        cache = self._known[instance]
        if self._ram is not None:
            ram = self._ram[instance]
            n = 0
            for h in block_hashes:
                if h not in cache and h not in ram:
                    return n
                n += 1
            return n
        n = 0
        for h in block_hashes:
            if h not in cache:
                return n
            n += 1
        return n

    def complete_blocks(self, instance: int, block_hashes: Sequence[int]) -> int:
        return _lead(self._hbm[instance], block_hashes)


@dataclass
class EngineResult:
    utilization: list[UtilSample] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    end_s: float = 0.0


class Engine:
    """One simulated run: build with the instances, settings and policy, then `run`."""

    def __init__(
        self,
        costs: RooflineCostModel,
        settings: SimSettings,
        policy: Policy,
        *,
        block_tokens: int,
        variant: str = "",
        repeat: int = 0,
        audit: bool = False,
    ) -> None:
        instances = costs.instances
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
        self.seed_decode = settings.decode_steps == "output_tokens"
        self.cache_whole = settings.prefix_cache_budget == "whole"
        self.output_blocks = settings.output_blocks_cached
        self.copy_blocks = settings.warm_copy_blocks_target
        self.batch_admit = settings.admission == "all_that_fit"
        self.next_output_block = -1  # synthetic output-block ids count down from -1
        self.setup_s = costs.transfer_setup_s
        self.dt = settings.sample_interval_s
        self.insts = [
            _Inst(s, c, settings, block_tokens)
            for s, c in zip(instances, costs.per_instance, strict=True)
        ]
        self.costs = costs
        self.view = _View(self)
        self.disk: set[int] = set()
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
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
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
                ev = pop(heap)
                if audit:
                    last = self._audit_time(ev[0], last)
                self.now = ev[0]
                handlers[ev[3]](ev[4], ev[5])
                events += 1
            if audit:
                last = self._audit_time(t, last)
            self.now = t
            self._on_arrival(req)
            events += 1
        while heap:
            ev = pop(heap)
            if audit:
                last = self._audit_time(ev[0], last)
            self.now = ev[0]
            handlers[ev[3]](ev[4], ev[5])
            events += 1
        self.stats["events"] = events
        for inst in self.insts:
            if inst.phase != PHASE_IDLE or inst.waiting or inst.run_heap:
                raise SimInvariantError(f"{inst.name} did not drain")
        return EngineResult(self._utilization(), dict(self.stats), self.now)

    def _audit_time(self, t: float, last: float) -> float:
        if t < last:
            raise SimInvariantError(f"time went backwards: {t} < {last}")
        for inst in self.insts:
            bt = self.block_tokens
            if inst.reserved > inst.cap_tokens:
                raise SimInvariantError(f"{inst.name}: reserved KV above budget")
            cache_cap = inst.cap_tokens if self.cache_whole else inst.cap_tokens - inst.reserved
            if len(inst.hbm) * bt > cache_cap:
                raise SimInvariantError(f"{inst.name}: HBM cache above its budget")
            if len(inst.pins) * bt + inst.reserved > inst.cap_tokens:
                raise SimInvariantError(f"{inst.name}: pinned + reserved KV above budget")
            if inst.pins and not self.sharing:
                raise SimInvariantError(f"{inst.name}: blocks pinned without sharing")
            for h, refs in inst.pins.items():
                if refs <= 0:
                    raise SimInvariantError(f"{inst.name}: block {h} pinned {refs} times")
                if h not in inst.hbm:
                    raise SimInvariantError(f"{inst.name}: pinned block {h} was evicted")
            if len(inst.ram) > inst.ram_cap_blocks:
                raise SimInvariantError(f"{inst.name}: host RAM cache above its budget")
            if inst.n_seqs > self.max_batch:
                raise SimInvariantError(f"{inst.name}: batch above max_batch")
            dup = 0
            for h, refs in inst.dec_refs.items():
                if refs <= 0 or h not in inst.pins:
                    raise SimInvariantError(f"{inst.name}: decode reference to block {h} bad")
                dup += (refs - 1) * bt
            if dup != inst.shared_dup_tokens or (dup and not self.shared_attn):
                raise SimInvariantError(f"{inst.name}: shared prefix count {dup} is off")
            if not inst.run_heap and (inst.dec_refs or inst.ctx_base):
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
            self._route_note(dinst, req.block_hashes)
        prompt = req.input_tokens
        if self.sharing and len(req.block_hashes) * self.block_tokens > prompt:
            prompt = len(req.block_hashes) * self.block_tokens  # whole blocks
        if p is None:
            job = _Job(JOB_REQ, req, rec)
            job.need = prompt + req.output_tokens
            job.decode_inst = d
            job.prefill_inst = d
            self._enqueue(dinst, job)
        else:
            pinst = insts[p]
            pinst.load.outstanding_tokens += req.input_tokens
            if self.view_routed:
                self._route_note(pinst, req.block_hashes)
            job = _Job(JOB_P, req, rec)
            job.need = prompt
            job.cold = decision.prefill_cold
            job.decode_inst = d
            job.prefill_inst = p
            self._enqueue(pinst, job)

    def _prompt_tokens(self, req: Request) -> int:
        """KV a prompt occupies: its tokens, or with sharing its hashed blocks whole."""
        if self.sharing:
            blocks = len(req.block_hashes) * self.block_tokens
            if blocks > req.input_tokens:
                return blocks
        return req.input_tokens

    def _route_note(self, inst: _Inst, hashes: Sequence[int]) -> None:
        routed = inst.routed
        for h in hashes:
            if h in routed:
                routed.move_to_end(h)
            else:
                routed[h] = None
        while len(routed) > inst.routed_cap:
            routed.popitem(last=False)

    def _enqueue(self, inst: _Inst, job: _Job, *, front: bool = False) -> None:
        job.enq_s = self.now
        if front:
            inst.waiting.appendleft(job)
        else:
            inst.waiting.append(job)
        inst.load.waiting += 1
        phase = inst.phase
        if self.batch_admit:
            self._admit_all(inst)
            if phase == PHASE_IDLE:
                self._step(inst)
            elif phase == PHASE_DECODE and inst.admitted:
                self._cut_segment(inst)
            return
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
        if not hashes or _lead(target.hbm, hashes) >= len(hashes):
            self.stats["warm_copies_skipped"] += 1
            return
        if self.view_routed:
            self._route_note(target, hashes)
        if action.mode == "prefill":
            job = _Job(JOB_WARM, None, None)
            job.hashes = hashes
            job.block_tokens = req.block_tokens
            job.warm_tokens = len(hashes) * req.block_tokens
            self.stats["warm_prefills"] += 1
            self._enqueue(target, job)
            return
        if action.source is None or not 0 <= action.source < len(insts):
            raise ValueError(f"rdma warm action needs a valid source, got {action.source}")
        source = insts[action.source]
        now = self.now
        n_complete = _lead(source.hbm, hashes)
        ready = now
        n_copy = n_complete
        if n_complete < len(hashes):
            # Blocks still being produced on the source (its running prefill, or a copy
            # arriving there) may be copied once complete, never earlier.
            pending = source.pending
            for h in hashes[n_complete:]:
                t = pending.get(h)
                if t is None:
                    break
                n_copy += 1
                ready = max(ready, t)
        if n_copy == 0:
            self.stats["warm_copies_skipped"] += 1
            return
        copy = hashes[:n_copy]
        bw = min(source.spec.rdma_bw, target.spec.rdma_bw)
        nbytes = n_copy * req.block_tokens * target.spec.kv_bytes_per_token
        if self.copy_blocks:
            # on the target's compute queue, ahead of waiting work; lands when it ends
            job = _Job(JOB_WARM, None, None)
            job.hashes = copy
            job.block_tokens = req.block_tokens
            job.warm_tokens = n_copy * req.block_tokens
            job.copy_s = self.setup_s + nbytes / bw
            self.stats["warm_copies"] += 1
            self.stats["warm_bytes"] += nbytes
            self._enqueue(target, job, front=True)
            return
        start = max(now, ready, target.link_free_s)
        done = start + self.setup_s + nbytes / bw
        target.link_free_s = done
        pend = target.pending
        for h in copy:
            if h not in target.hbm:
                pend[h] = max(pend.get(h, 0.0), done)
        self.stats["warm_copies"] += 1
        self.stats["warm_bytes"] += nbytes
        if self.audit:
            self.warm_log.append(
                WarmLogEntry(source.index, target.index, n_copy, now, start, ready, done)
            )
        self._push(
            done, PRI_TRANSFER, EV_TRANSFER, target.index, _Warm(source.index, target.index, copy)
        )

    # ---------------------------------------------------------------- cache
    def _fit_hbm(self, inst: _Inst) -> None:
        """Evict least recently used blocks to host RAM (then disk) until the HBM cache fits
        in the KV budget not reserved by admitted requests."""
        if self.cache_whole:
            allowed = inst.cap_tokens // self.block_tokens
        else:
            allowed = (inst.cap_tokens - inst.reserved) // self.block_tokens
        hbm = inst.hbm
        if len(hbm) <= allowed:
            return
        ram = inst.ram
        ram_cap = inst.ram_cap_blocks
        disk = self.disk if self.settings.disk_tier else None
        pins = inst.pins
        skipped = 0
        while len(hbm) > allowed:
            h, _ = hbm.popitem(last=False)
            if pins and h in pins:
                # in use by a running request: it stays resident (now the most recent)
                hbm[h] = None
                skipped += 1
                if skipped > len(pins):
                    raise SimInvariantError(f"{inst.name}: pinned blocks exceed the KV budget")
                continue
            if ram_cap:
                ram[h] = None
                if len(ram) > ram_cap:
                    old, _ = ram.popitem(last=False)
                    if disk is not None:
                        disk.add(old)
            elif disk is not None:
                disk.add(h)

    def _insert(self, inst: _Inst, hashes: Sequence[int], *, fit: bool = True) -> None:
        hbm = inst.hbm
        ram = inst.ram
        pending = inst.pending
        for h in hashes:
            if h in hbm:
                hbm.move_to_end(h)
            else:
                hbm[h] = None
                if ram:
                    ram.pop(h, None)
            if pending:
                pending.pop(h, None)
        if fit:
            self._fit_hbm(inst)

    def _pin(self, inst: _Inst, job: _Job, upto: int) -> None:
        """Pin `job.hashes[job.n_pin:upto]` (resident in HBM) for `job`; its reservation
        (`need`) shrinks by as many blocks. The caller adjusts `inst.reserved`."""
        start = job.n_pin
        if upto <= start:
            return
        pins = inst.pins
        hashes = job.hashes
        get = pins.get
        if start == 0 and upto == len(hashes):
            for h in hashes:
                pins[h] = get(h, 0) + 1
        else:
            for i in range(start, upto):
                h = hashes[i]
                pins[h] = get(h, 0) + 1
        job.n_pin = upto
        job.need -= (upto - start) * self.block_tokens

    def _insert_pinned(self, inst: _Inst, job: _Job) -> None:
        """`_insert` of the whole prompt of `job` without the fit, pinning the blocks it
        does not pin yet (one pass: this runs once per request)."""
        hbm = inst.hbm
        ram = inst.ram
        pending = inst.pending
        pins = inst.pins
        get = pins.get
        hashes = job.hashes
        start = job.n_pin
        for i, h in enumerate(hashes):
            if h in hbm:
                hbm.move_to_end(h)
            else:
                hbm[h] = None
                if ram:
                    ram.pop(h, None)
            if pending:
                pending.pop(h, None)
            if i >= start:
                pins[h] = get(h, 0) + 1
        job.n_pin = len(hashes)
        job.need -= (len(hashes) - start) * self.block_tokens

    def _unpin(self, inst: _Inst, job: _Job) -> None:
        """Drop `job`'s references; a block nobody pins becomes evictable, most recent."""
        pins = inst.pins
        hbm = inst.hbm
        hashes = job.hashes
        n = job.n_pin
        for h in hashes if n == len(hashes) else hashes[:n]:
            refs = pins[h] - 1
            if refs:
                pins[h] = refs
            else:
                del pins[h]
                hbm.move_to_end(h)
        job.n_pin = 0

    # ---------------------------------------------------------------- scheduling
    def _admissible(self, inst: _Inst, job: _Job) -> bool:
        if job.need > inst.cap_tokens:
            return True  # fails at once, which also unblocks the queue
        if job.kind != JOB_WARM and inst.n_seqs >= self.max_batch:
            return False
        if not self.sharing:
            return inst.reserved + job.need <= inst.cap_tokens
        used = inst.reserved + len(inst.pins) * self.block_tokens
        return used + job.need <= inst.cap_tokens or used + self._cost(inst, job) <= inst.cap_tokens

    def _cost(self, inst: _Inst, job: _Job) -> int:
        """KV that admitting `job` adds at most (sharing): its full cost less the leading
        prompt blocks already pinned here, which it will reuse without new memory. Cold
        prefills, warm jobs and received KV that is not reusable share nothing."""
        need = job.need
        pins = inst.pins
        if not pins or not job.hashes or job.cold:
            return need
        kind = job.kind
        if kind == JOB_WARM or (kind == JOB_KV and not self.reusable):
            return need
        n = 0
        for h in job.hashes:
            if h not in pins:
                break
            n += 1
        return need - n * self.block_tokens

    def _admit_all(self, inst: _Inst) -> None:
        """admission: all_that_fit: admit every waiting job that fits, in order, stopping at
        the first that does not (head-of-line): its KV is reserved (and visible under
        at_admission) now; its prefill runs when the instance gets to it."""
        waiting = inst.waiting
        now = self.now
        while waiting:
            job = waiting[0]
            if job.need > inst.cap_tokens:
                waiting.popleft()
                inst.load.waiting -= 1
                self._fail(
                    inst, job, f"needs {job.need} KV tokens; {inst.name} holds {inst.cap_tokens}"
                )
                continue
            if not self._admissible(inst, job):
                return
            waiting.popleft()
            inst.load.waiting -= 1
            if job.kind == JOB_KV:
                self._admit_kv(inst, job)
                continue
            job.admit_s = now
            self._start_prefill(inst, job)
            inst.admitted.append(job)

    def _run_admitted(self, inst: _Inst) -> None:
        """Start the oldest admitted job's prefill (or warm copy)."""
        job = inst.admitted.popleft()
        now = self.now
        wait = now - job.admit_s
        job.prefill_start_s = now
        if job.rec is not None:
            job.rec.queue_s += wait
        inst.phase = PHASE_PREFILL
        self._push(now + job.run_s, PRI_PREFILL, EV_PREFILL, inst.index, job)

    def _kick(self, inst: _Inst) -> None:
        """Something changed on `inst`: start work if idle, or cut the current decode
        segment at the next step boundary when an admission is waiting (prefill priority)."""
        if self.batch_admit:
            self._admit_all(inst)
            if inst.phase == PHASE_IDLE:
                self._step(inst)
            elif inst.phase == PHASE_DECODE and inst.admitted:
                self._cut_segment(inst)
            return
        phase = inst.phase
        if phase == PHASE_IDLE:
            self._step(inst)
        elif phase == PHASE_DECODE and inst.waiting and self._admissible(inst, inst.waiting[0]):
            self._cut_segment(inst)

    def _seg_dur(self, inst: _Inst, k: int) -> float:
        return k * inst.seg_c0 + inst.seg_c1 * k * (k - 1) * 0.5

    def _cut_segment(self, inst: _Inst) -> None:
        elapsed = self.now - inst.seg_start
        c0, c1 = inst.seg_c0, inst.seg_c1
        if elapsed <= 0:
            k = 0
        else:
            # smallest k with dur(k) >= elapsed: the step boundary at or after now
            a = 0.5 * c1
            b = c0 - 0.5 * c1
            if a > 0:
                k = math.ceil((-b + math.sqrt(b * b + 4 * a * elapsed)) / (2 * a))
            else:
                k = math.ceil(elapsed / b)
            # guard the float root: k is the smallest step count reaching `elapsed`
            target = elapsed - _EPS
            while k > 0 and (k - 1) * c0 + c1 * (k - 1) * (k - 2) * 0.5 >= target:
                k -= 1
            while k * c0 + c1 * k * (k - 1) * 0.5 < target:
                k += 1
        if k >= inst.seg_steps:
            return
        inst.seg_steps = k
        inst.seg_version += 1
        end = inst.seg_start + k * c0 + c1 * k * (k - 1) * 0.5
        self.seq += 1
        heapq.heappush(
            self.heap, (end, PRI_SEGMENT, self.seq, EV_SEGMENT, inst.index, inst.seg_version)
        )

    def _step(self, inst: _Inst) -> None:
        """Admit what fits (one prefill at a time, decode paused), else run a decode
        segment up to the next finishing sequence, else go idle."""
        now = self.now
        waiting = inst.waiting
        was_idle = inst.phase == PHASE_IDLE
        sharing = self.sharing
        bt = self.block_tokens
        if self.batch_admit:
            self._admit_all(inst)
            if inst.admitted:
                if was_idle:
                    inst.busy_since = now
                self._run_admitted(inst)
                return
            waiting = deque()  # nothing more fits: decode what runs
        while waiting:
            job = waiting[0]
            if job.need > inst.cap_tokens:
                waiting.popleft()
                inst.load.waiting -= 1
                self._fail(
                    inst, job, f"needs {job.need} KV tokens; {inst.name} holds {inst.cap_tokens}"
                )
                continue
            if job.kind != JOB_WARM and inst.n_seqs >= self.max_batch:
                break
            if sharing:
                used = inst.reserved + len(inst.pins) * bt
                # the full cost fitting settles it without scanning the pins
                if used + job.need > inst.cap_tokens and (
                    used + self._cost(inst, job) > inst.cap_tokens
                ):
                    break
            elif inst.reserved + job.need > inst.cap_tokens:
                break
            waiting.popleft()
            inst.load.waiting -= 1
            if job.kind == JOB_KV:
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
            inst.seg_c0 = inst.dW + k_tokens * inst.dK
            inst.seg_c1 = b * inst.dK
            inst.seg_start = now
            inst.seg_steps = steps
            inst.seg_version += 1
            inst.phase = PHASE_DECODE
            if was_idle:
                inst.busy_since = now
            self._push(
                now + steps * inst.seg_c0 + inst.seg_c1 * steps * (steps - 1) * 0.5,
                PRI_SEGMENT,
                EV_SEGMENT,
                inst.index,
                inst.seg_version,
            )
            return
        if not was_idle:
            self._add_busy(inst, inst.busy_since, now)
        inst.phase = PHASE_IDLE

    def _reserve(self, inst: _Inst, tokens: int, *, fit: bool = True) -> None:
        inst.reserved += tokens
        used = inst.reserved + len(inst.pins) * self.block_tokens
        k = int(self.now / self.dt)
        if k != inst.mem_bin:
            if inst.mem_bin >= 0:
                inst.mem_samples[inst.mem_bin] = inst.mem_peak
            inst.mem_bin = k
            inst.mem_peak = used
        elif used > inst.mem_peak:
            inst.mem_peak = used
        if fit:
            self._fit_hbm(inst)

    def _start_prefill(self, inst: _Inst, job: _Job) -> bool:
        """Start the prefill of `job`; False when it was parked to wait for a warm copy."""
        now = self.now
        hashes = job.hashes
        bt = job.block_tokens
        rec = job.rec
        if job.kind == JOB_WARM:
            tokens = job.warm_tokens
            if job.copy_s >= 0:
                return self._start_copy(inst, job)
        else:
            assert job.req is not None
            tokens = job.req.input_tokens
        p_tok = inst.p_tok_s
        cached = 0
        load_s = 0.0
        tier: str | None = None
        n_use = 0
        if hashes and not job.cold:
            hbm = inst.hbm
            ram = inst.ram
            disk = self.disk if self.settings.disk_tier else None
            n_hbm_lead = -1
            n = n_ram = n_disk = 0
            for h in hashes:
                if h in hbm:
                    pass
                elif h in ram:
                    n_ram += 1
                elif disk is not None and h in disk:
                    n_disk += 1
                else:
                    break
                if n_hbm_lead < 0 and (n_ram or n_disk):
                    n_hbm_lead = n
                n += 1
            if n_hbm_lead < 0:
                n_hbm_lead = n
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
            # a warm copy in flight to this instance may beat recomputing: wait for it
            pending = inst.pending
            if pending and not job.parked and job.kind != JOB_WARM and n < len(hashes):
                ready = now
                m = n
                for h in hashes[n:]:
                    t = pending.get(h)
                    if t is None:
                        break
                    m += 1
                    ready = max(ready, t)
                if m > n:
                    c_wait = min(m * bt, tokens)
                    ld = (n_ram * inst.ram_tok_s + n_disk * inst.disk_tok_s) * bt
                    wait_cost = (ready - now) + ld + (tokens - c_wait) * p_tok
                    if wait_cost < best:
                        job.parked = True
                        job.prefill_start_s = now  # park start, read back in _on_park
                        inst.load.waiting += 1
                        self.stats["parked_for_warm"] += 1
                        self._push(ready, PRI_PARK, EV_PARK, inst.index, job)
                        return False
            if n_use and self.after_prefill:
                # touch / promote the blocks this prefill reuses (at_admission inserts
                # the whole prompt below, which touches them too)
                for h in hashes[:n_use]:
                    if h in hbm:
                        hbm.move_to_end(h)
                    else:
                        hbm[h] = None
                        ram.pop(h, None)
        prefill_s = (tokens - cached) * p_tok
        dur = load_s + prefill_s
        if self.batch_admit:
            job.run_s = dur  # the prefill runs when _run_admitted gets to it
        done = now + dur
        if job.kind != JOB_WARM:
            inst.n_seqs += 1
            inst.load.running += 1
            assert rec is not None
            rec.queue_s += now - job.enq_s
            rec.cached_tokens = cached
            if job.parked and cached and tier == "hbm":
                tier = "remote"
            rec.cache_tier = tier
            rec.kv_load_s = load_s
            rec.prefill_s = prefill_s
        job.prefill_start_s = now
        # at_admission: the whole prompt is resident now; with sharing, pin what it uses
        # before the fit in _reserve, so the fit never evicts it
        if hashes and self.sharing and job.kind != JOB_WARM:
            if self.after_prefill:
                self._pin(inst, job, n_use)
            else:
                self._insert_pinned(inst, job)
        elif hashes and not self.after_prefill:
            self._insert(inst, hashes, fit=False)
        if self.output_blocks and job.kind != JOB_WARM:
            self._insert_output_blocks(inst, job)
        self._reserve(inst, job.need)
        if hashes and self.after_prefill:
            pending = inst.pending
            hbm = inst.hbm
            for h in hashes[n_use:]:
                if h not in hbm:
                    pending[h] = done
        if self.batch_admit:
            return True
        inst.phase = PHASE_PREFILL
        self.seq += 1
        heapq.heappush(self.heap, (done, PRI_PREFILL, self.seq, EV_PREFILL, inst.index, job))
        return True

    def _start_copy(self, inst: _Inst, job: _Job) -> bool:
        """A warm copy occupying `inst`'s compute (warm_copy_blocks_target)."""
        if self.batch_admit:
            job.run_s = job.copy_s
            return True  # _run_admitted starts it
        job.prefill_start_s = self.now
        inst.phase = PHASE_PREFILL
        self._push(self.now + job.copy_s, PRI_PREFILL, EV_PREFILL, inst.index, job)
        return True

    def _insert_output_blocks(self, inst: _Inst, job: _Job) -> None:
        """output_blocks_cached: the blocks a request's output will fill enter the HBM
        cache at admission, each with its own (negative) id, so they take cache space."""
        req = job.req
        assert req is not None
        bt = self.block_tokens
        n = -(-(req.input_tokens + req.output_tokens) // bt) - len(job.hashes)
        if n <= 0:
            return
        first = self.next_output_block
        self.next_output_block = first - n
        self._insert(inst, range(first, first - n, -1), fit=False)

    def _admit_kv(self, inst: _Inst, job: _Job) -> None:
        """Decode side of a prefill offload: the KV is here, the request joins the batch
        and streams its first token at this step."""
        now = self.now
        rec = job.rec
        req = job.req
        assert rec is not None
        assert req is not None
        rec.queue_s += now - job.enq_s
        rec.first_token_s = now
        inst.n_seqs += 1
        inst.load.running += 1
        if self.reusable and job.hashes:
            if self.sharing:
                self._insert_pinned(inst, job)
                self._reserve(inst, job.need)
            else:
                self._reserve(inst, job.need)
                self._insert(inst, job.hashes)
        else:
            self._reserve(inst, job.need)
        self._begin_decode(inst, job)

    def _begin_decode(self, inst: _Inst, job: _Job) -> None:
        req = job.req
        assert req is not None
        if self.seed_decode:  # output_tokens steps from context = input
            left = req.output_tokens
            first_ctx = req.input_tokens
        else:  # the prefill produced the first token
            left = req.output_tokens - 1
            first_ctx = req.input_tokens + 1
        if left <= 0:
            self._finish(inst, job)
            return
        start = inst.steps_done
        inst.run_seq += 1
        heapq.heappush(inst.run_heap, (start + left, inst.run_seq, job))
        job.ctx_off = first_ctx - start
        inst.ctx_base += job.ctx_off
        if self.shared_attn and job.n_pin:
            inst.ctx_base -= self._join_shared(inst, job, req.input_tokens)

    def _join_shared(self, inst: _Inst, job: _Job, input_tokens: int) -> int:
        """Count `job`'s pinned leading blocks (whole ones inside its prompt) as read by
        the batch; returns the tokens already read by another sequence."""
        bt = self.block_tokens
        n = min(job.n_pin, input_tokens // bt)
        if n <= 0:
            return 0
        refs = inst.dec_refs
        get = refs.get
        dup = 0
        for h in job.hashes[:n]:
            c = get(h, 0)
            if c:
                dup += 1
            refs[h] = c + 1
        job.n_shared = n
        inst.shared_dup_tokens += dup * bt
        return dup * bt

    def _leave_shared(self, inst: _Inst, job: _Job) -> int:
        """Undo `_join_shared` as `job` leaves the batch; returns the tokens it no longer
        duplicates."""
        refs = inst.dec_refs
        dup = 0
        for h in job.hashes[: job.n_shared]:
            c = refs[h] - 1
            if c:
                refs[h] = c
                dup += 1
            else:
                del refs[h]
        job.n_shared = 0
        dup *= self.block_tokens
        inst.shared_dup_tokens -= dup
        return dup

    # ---------------------------------------------------------------- handlers
    def _on_prefill(self, index: int, job: _Job) -> None:
        inst = self.insts[index]
        kind = job.kind
        if job.copy_s >= 0:
            self._insert(inst, job.hashes)
        elif self.after_prefill and job.hashes:
            if self.sharing and kind != JOB_WARM:
                # its own blocks are resident now: move them from reserved to pinned
                before = job.need
                self._insert_pinned(inst, job)
                inst.reserved -= before - job.need
                self._fit_hbm(inst)
            else:
                self._insert(inst, job.hashes)
        if kind == JOB_REQ:
            assert job.rec is not None
            job.rec.first_token_s = self.now
            self._begin_decode(inst, job)
        elif kind == JOB_P:
            self._ship_kv(inst, job)
        # phase is still PREFILL (busy): _step picks the next piece of work or goes idle
        self._step(inst)

    def _ship_kv(self, pinst: _Inst, job: _Job) -> None:
        """Prefill instance done: move the KV to the decode instance over RDMA."""
        req = job.req
        assert req is not None
        assert job.rec is not None
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

    def _on_transfer(self, index: int, payload: Any) -> None:
        inst = self.insts[index]
        if isinstance(payload, _Warm):
            hashes = [h for h in payload.hashes if inst.pending.get(h, math.inf) <= self.now + _EPS]
            self._insert(inst, hashes)
            self._kick(inst)
            return
        job: _Job = payload
        req = job.req
        assert req is not None
        pinst = self.insts[job.prefill_inst]
        pinst.reserved -= job.need
        if job.n_pin:
            self._unpin(pinst, job)
        self._kick(pinst)
        job.kind = JOB_KV
        job.need = self._prompt_tokens(req) + req.output_tokens
        self._enqueue(inst, job)

    def _on_park(self, index: int, job: _Job) -> None:
        inst = self.insts[index]
        inst.load.waiting -= 1
        assert job.rec is not None
        wait = self.now - job.prefill_start_s
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
            job = heapq.heappop(run_heap)[2]
            inst.ctx_base -= job.ctx_off
            if job.n_shared:
                inst.ctx_base += self._leave_shared(inst, job)
            self._finish(inst, job)
        self._step(inst)

    def _finish(self, inst: _Inst, job: _Job) -> None:
        now = self.now
        rec = job.rec
        req = job.req
        assert rec is not None
        assert req is not None
        rec.finish_s = now
        assert rec.first_token_s is not None
        rec.decode_s = now - rec.first_token_s
        inst.n_seqs -= 1
        inst.load.running -= 1
        inst.reserved -= job.need
        if job.n_pin:
            self._unpin(inst, job)
        inst.load.outstanding_tokens -= req.input_tokens + req.output_tokens
        if self.notify_finish:
            self.policy.on_finish(req, inst.index, now)
        self.emit(rec)

    def _fail(self, inst: _Inst, job: _Job, error: str) -> None:
        self.stats["failed"] += 1
        rec = job.rec
        req = job.req
        if rec is None or req is None:
            return
        rec.ok = False
        rec.error = error
        rec.queue_s += self.now - job.enq_s
        # failed before admission: it reserved and pinned nothing
        if job.kind == JOB_P:
            inst.load.outstanding_tokens -= req.input_tokens
        else:
            inst.load.outstanding_tokens -= req.input_tokens + req.output_tokens
        if job.kind == JOB_P:
            self.insts[job.decode_inst].load.outstanding_tokens -= (
                req.input_tokens + req.output_tokens
            )
        self.policy.on_finish(req, inst.index, self.now)
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
