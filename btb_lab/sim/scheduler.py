"""The engine's shared state (clock, event heap, instances, counters) and the scheduling
of each instance's work: the admission rule, starting prefills and received KV, the
closed-form decode segments, and finishing or failing requests.

An instance runs one prefill at a time with its decode paused (prefill priority), else a
decode segment up to the next finishing sequence, cut at a step boundary when an
admission is waiting; else it is idle (`step_model: serial`; `steps.py` has the mixed
steps that replace the prefill phase with `step_model: mixed`). `transfers.py` (KV
moving between instances) and `engine.py` (the event loop, arrivals and completion
handlers) build on this class.

KV accounting (`kv_prefix_sharing`, on by default; off reserves `input + output` tokens
per admitted request, engine version 1's rule). With sharing, as in vLLM's ref-counted prefix
cache, a request holds two things while it runs:

- *pinned* blocks: the cached blocks of its prompt it reuses, shared with every other
  running request that reuses them (a reference count per block). Pinned blocks stay in
  the HBM cache and are never evicted; when the last reference goes they become the most
  recently used unpinned (evictable) cache blocks.
- *reserved* tokens: the rest of its prompt (counted in whole blocks for the hashed
  part, as a paged cache allocates them) plus its output past the last prompt block's
  slack, or all of it when another running request pins that block too (`jobs.kv_need`,
  `jobs.pin_prompt`; none for a prefill done for another instance).

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

import heapq
from collections import deque
from collections.abc import Callable
from typing import Any

from btb_lab.config.sim import SimSettings
from btb_lab.errors import UserError
from btb_lab.events import EventLog
from btb_lab.model.costmodel import RooflineCostModel
from btb_lab.policies.base import Policy
from btb_lab.records import RequestRecord
from btb_lab.sim.decode import segment_s, steps_reaching
from btb_lab.sim.instance import (
    PHASE_DECODE,
    PHASE_IDLE,
    PHASE_PREFILL,
    EngineView,
    InstanceState,
)
from btb_lab.sim.jobs import (
    DecodeJob,
    Job,
    KVJob,
    PrefillJob,
    ReqJob,
    WarmJob,
    WarmLogEntry,
    admission_cost,
    pin_prompt,
)

__all__ = [
    "EV_PARK",
    "EV_PREFILL",
    "EV_SEGMENT",
    "EV_TRANSFER",
    "PRI_ARRIVAL",
    "PRI_PARK",
    "PRI_PREFILL",
    "PRI_SEGMENT",
    "PRI_TRANSFER",
    "Scheduler",
]

# Event priorities at equal times: KV arrivals first (they can unblock admissions), then
# completions, then arrivals: a router sees the state after all else at that instant.
PRI_TRANSFER = 0
PRI_PARK = 1
PRI_PREFILL = 2
PRI_SEGMENT = 3
PRI_ARRIVAL = 4

# Event kinds: the run loop's handler index (`Engine._run`).
EV_TRANSFER = 0
EV_PARK = 1
EV_PREFILL = 2
EV_SEGMENT = 3


class Scheduler:
    """The engine's state and every instance's scheduling (the base of `Engine`, whose
    constructor this is)."""

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
        events: EventLog | None = None,
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
        # what happened over time (queue and batch per instance, warm copies, KV transfers;
        # None: nothing, at one test per change) and each instance's counter appenders
        self.events = events
        if events is not None:
            names = [spec.name for spec in instances]
            self.waiting_up, self.waiting_down = events.counters(names, "waiting")
            self.running_up, self.running_down = events.counters(names, "running")
        self.after_prefill = settings.kv_visibility == "after_prefill"
        self.view_routed = settings.router_view == "routed"
        self.reusable = settings.transferred_kv_reusable
        self.sharing = settings.kv_prefix_sharing
        self.shared_attn = settings.shared_prefix_attention and self.sharing
        self.max_batch = settings.max_batch
        # the seed simulator's rules (config/sim.py, sim.profile infer-sim)
        self.seed_decode = settings.decode_steps == "output_tokens"
        self.batch_admit = settings.admission == "all_that_fit"
        self.output_blocks = settings.output_blocks_cached
        self.hit_whole = settings.prompt_cache_hit == "whole_prompt"
        self.copy_blocks = settings.warm_copy_blocks_target
        # step_model mixed (steps.py) starts prefills in batches: _start_prefill only books
        self.mixed = settings.step_model == "mixed"
        self.defer_prefill = self.batch_admit or self.mixed
        self.deferred_expects: list[tuple[Any, int]] = []  # (hashes, first pending block)
        self.next_output_block = -1  # synthetic output-block ids count down from -1
        self.setup_s = costs.transfer_setup_s
        self.dt = settings.sample_interval_s
        # the disk tier is one set of blocks shared by the cluster
        self.disk: set[int] = set()
        disk = self.disk if settings.disk_tier else None
        self.insts = [
            InstanceState(s, c, settings, block_tokens, disk, len(instances))
            for s, c in zip(instances, costs.per_instance, strict=True)
        ]
        self.costs = costs
        self.view = EngineView(
            self.insts,
            self.costs,
            routed=self.view_routed,
            match_ram=settings.router_match_tiers == "hbm_ram",
        )
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
        self.warm_log: list[WarmLogEntry] = []  # with audit
        # skip the call per finished request when the policy keeps no state
        self.notify_finish = type(policy).on_finish is not Policy.on_finish

    def _push(self, t: float, pri: int, kind: int, inst: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, pri, self.seq, kind, inst, payload))

    # ---------------------------------------------------------------- admission
    def _enqueue(self, inst: InstanceState, job: Job, *, front: bool = False) -> None:
        job.enq_s = self.now
        if front:
            inst.waiting.appendleft(job)
        else:
            inst.waiting.append(job)
        inst.load.waiting += 1
        if self.events is not None:
            self.waiting_up[inst.index](self.now)
        if self.batch_admit:
            self._kick(inst)
            return
        # _kick, inlined (once per queued job)
        phase = inst.phase
        if phase == PHASE_IDLE:
            self._step(inst)
        elif phase == PHASE_DECODE and self._admissible(inst, inst.waiting[0]):
            self._cut_segment(inst)

    def _admissible(self, inst: InstanceState, job: Job) -> bool:
        """Whether `job`, first in `inst`'s queue, may start now: the batch has room (a
        warm job joins none) and its KV fits beside what admitted requests hold, at its
        full cost or, with sharing, at `jobs.admission_cost`. A job that can never fit is
        admissible: it fails at once, which also unblocks the queue."""
        cache = inst.cache
        cap = cache.cap_tokens
        need = job.need
        if need > cap:
            return True
        if inst.n_seqs >= self.max_batch and not isinstance(job, WarmJob):
            return False
        used = cache.reserved + cache.pinned_tokens  # no pins without sharing
        # the full cost fitting settles it without scanning the pins
        if used + need <= cap or not self.sharing:
            return used + need <= cap
        return used + admission_cost(inst.cache, job, self.block_tokens, self.reusable) <= cap

    def _hit_cap(self, job: Job, tokens: int) -> int:
        """Prompt tokens a cache hit may spare `job` (`sim.prompt_cache_hit`): vLLM's hits are
        whole blocks short of the last prompt token (its logits); a warm prefill makes none."""
        if self.hit_whole or isinstance(job, WarmJob):
            return tokens
        return (tokens - 1) // self.block_tokens * self.block_tokens

    def _admit_all(self, inst: InstanceState) -> None:
        """admission all_that_fit: admit every waiting job that fits, in order, stopping at
        the first that does not (head-of-line): its KV is reserved (and visible under
        at_admission) now; its prefill runs when the instance gets to it."""
        waiting = inst.waiting
        now = self.now
        cap = inst.cache.cap_tokens
        while waiting:
            job = waiting[0]
            if job.need > cap:
                waiting.popleft()
                inst.load.waiting -= 1
                if self.events is not None:
                    self.waiting_down[inst.index](now)
                self._fail(inst, job, f"needs {job.need} KV tokens; {inst.name} holds {cap}")
                continue
            if not self._admissible(inst, job):
                return
            waiting.popleft()
            inst.load.waiting -= 1
            if self.events is not None:
                self.waiting_down[inst.index](now)
            if isinstance(job, KVJob):
                self._admit_kv(inst, job)
                continue
            job.admit_s = now
            self._start_prefill(inst, job)
            inst.admitted.append(job)

    def _run_admitted(self, inst: InstanceState) -> None:
        """admission all_that_fit: start the oldest admitted job's prefill (or copy)."""
        job = inst.admitted.popleft()
        now = self.now
        if isinstance(job, WarmJob):
            job.start_s = now
        else:
            job.rec.queue_s += now - job.admit_s
            if isinstance(job, PrefillJob):
                job.prefill_start_s = now
        inst.phase = PHASE_PREFILL
        self._push(now + job.run_s, PRI_PREFILL, EV_PREFILL, inst.index, job)

    def _kick(self, inst: InstanceState) -> None:
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

    def _cut_segment(self, inst: InstanceState) -> None:
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

    def _step(self, inst: InstanceState) -> None:
        """Admit what fits (one prefill at a time, decode paused), else run a decode
        segment up to the next finishing sequence, else go idle."""
        now = self.now
        waiting = inst.waiting
        was_idle = inst.phase == PHASE_IDLE
        cap = inst.cache.cap_tokens
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
            if job.need > cap:
                waiting.popleft()
                inst.load.waiting -= 1
                if self.events is not None:
                    self.waiting_down[inst.index](now)
                self._fail(inst, job, f"needs {job.need} KV tokens; {inst.name} holds {cap}")
                continue
            if not self._admissible(inst, job):
                break
            waiting.popleft()
            inst.load.waiting -= 1
            if self.events is not None:
                self.waiting_down[inst.index](now)
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
            c0 = inst.seg_c0 = inst.dW + k_tokens * inst.dK + b * inst.dS
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
            inst.add_busy(inst.busy_since, now, self.dt)
        inst.phase = PHASE_IDLE

    # ---------------------------------------------------------------- starting work
    def _start_prefill(self, inst: InstanceState, job: ReqJob | PrefillJob | WarmJob) -> bool:
        """Start the prefill of `job`; False when it was parked to wait for a warm copy."""
        now = self.now
        if isinstance(job, WarmJob) and job.copy_s >= 0:
            return self._start_copy(inst, job)
        hashes = job.hashes
        bt = self.block_tokens
        tokens = job.tokens if isinstance(job, WarmJob) else job.req.input_tokens
        p_tok = inst.p_tok_s
        costs = inst.prefill_costs  # None: the roofline, (tokens - cached) × p_tok

        def compute_s(hit: int) -> float:  # the prefill after `hit` cached tokens
            return (tokens - hit) * p_tok if costs is None else costs.prefill_s(tokens - hit, hit)

        cap = self._hit_cap(job, tokens)
        cached, load_s = 0, 0.0
        tier: str | None = None
        n_use = 0
        cache = inst.cache
        if hashes and not (isinstance(job, PrefillJob) and job.cold):
            n_hbm_lead, n, n_ram, n_disk, m, ready = cache.locate(hashes, now)
            # best of: HBM-only lead, or the whole run loaded from lower tiers
            c_lead = min(n_hbm_lead * bt, cap)
            best = compute_s(c_lead)
            n_use, cached, load_s = n_hbm_lead, c_lead, 0.0
            tier = "hbm" if c_lead else None
            if n > n_hbm_lead:
                c_all = min(n * bt, cap)
                ld = (n_ram * inst.ram_tok_s + n_disk * inst.disk_tok_s) * bt
                cost = ld + compute_s(c_all)
                if cost < best:
                    best = cost
                    n_use, cached, load_s = n, c_all, ld
                    tier = "disk" if n_disk else "ram"
            # a warm copy in flight to this instance may beat recomputing: wait for it (once)
            if m > n and not isinstance(job, WarmJob) and not job.parked:
                c_wait = min(m * bt, cap)
                ld = (n_ram * inst.ram_tok_s + n_disk * inst.disk_tok_s) * bt
                wait_cost = (ready - now) + ld + compute_s(c_wait)
                if wait_cost < best:
                    job.parked = True
                    job.park_s = now
                    inst.load.waiting += 1  # a parked job still waits
                    if self.events is not None:
                        self.waiting_up[inst.index](now)
                    self.stats["parked_for_warm"] += 1
                    self._push(ready, PRI_PARK, EV_PARK, inst.index, job)
                    return False
            if n_use and self.after_prefill:
                # touch / promote the blocks this prefill reuses (at_admission inserts the
                # whole prompt below, which touches them too); with sharing they are pinned
                # below, where their LRU order no longer matters (a warm copy pins nothing)
                if not self.sharing or isinstance(job, WarmJob):
                    cache.touch(hashes, n_use)
                elif n_use > n_hbm_lead:
                    cache.promote(hashes, n_hbm_lead, n_use)
        prefill_s = compute_s(cached)
        dur = load_s + prefill_s
        done = now + dur
        if self.defer_prefill:
            job.run_s = dur  # the prefill runs when _run_admitted or its batch gets to it
        if isinstance(job, WarmJob):
            job.start_s = now
            if hashes and not self.after_prefill:
                cache.insert(hashes, fit=False)
        else:
            inst.n_seqs += 1
            inst.load.running += 1
            if self.events is not None:
                self.running_up[inst.index](now)
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
            # uses before the fit in reserve, so the fit never evicts it
            if hashes:
                if not self.sharing:
                    if not self.after_prefill:
                        cache.insert(hashes, fit=False)
                elif not self.after_prefill:
                    job.need -= pin_prompt(cache, job)
                elif n_use > job.n_pin:
                    job.need -= pin_prompt(cache, job, n_use)
            if self.output_blocks:
                self._insert_output_blocks(inst, job)
        inst.reserve(job.need, now, self.dt)
        if hashes and self.after_prefill:
            if self.mixed:  # pending until the batch ends, known once it is formed
                self.deferred_expects.append((hashes, n_use))
            else:
                cache.expect(hashes, n_use, done)
        if self.defer_prefill:
            return True
        inst.phase = PHASE_PREFILL
        self._push(done, PRI_PREFILL, EV_PREFILL, inst.index, job)
        return True

    def _start_copy(self, inst: InstanceState, job: WarmJob) -> bool:
        """A warm copy occupying `inst`'s compute (warm_copy_blocks_target)."""
        if self.batch_admit:
            job.run_s = job.copy_s
            return True  # _run_admitted starts it
        job.start_s = self.now
        inst.phase = PHASE_PREFILL
        self._push(self.now + job.copy_s, PRI_PREFILL, EV_PREFILL, inst.index, job)
        return True

    def _insert_output_blocks(self, inst: InstanceState, job: ReqJob | PrefillJob) -> None:
        """output_blocks_cached: the blocks a request's output will fill enter the HBM
        cache at admission, each with its own (negative) id, so they take cache space."""
        req = job.req
        n = -(-(req.input_tokens + req.output_tokens) // self.block_tokens) - len(job.hashes)
        if n <= 0:
            return
        first = self.next_output_block
        self.next_output_block = first - n
        inst.cache.insert(range(first, first - n, -1), fit=False)

    def _admit_kv(self, inst: InstanceState, job: KVJob) -> None:
        """Decode side of a prefill offload: the KV is here, the request joins the batch
        and streams its first token at this step."""
        now = self.now
        rec = job.rec
        rec.queue_s += now - job.enq_s
        rec.first_token_s = now
        inst.n_seqs += 1
        inst.load.running += 1
        if self.events is not None:
            self.running_up[inst.index](now)
        hashes = job.hashes
        if self.reusable and hashes:
            if self.sharing:
                job.need -= pin_prompt(inst.cache, job)
                inst.reserve(job.need, now, self.dt)
            else:
                inst.reserve(job.need, now, self.dt)
                inst.cache.insert(hashes)
        else:
            inst.reserve(job.need, now, self.dt)
        self._begin_decode(inst, job)

    def _begin_decode(self, inst: InstanceState, job: DecodeJob) -> None:
        req = job.req
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

    def _join_shared(self, inst: InstanceState, job: DecodeJob, input_tokens: int) -> int:
        """Count `job`'s pinned leading blocks (whole ones inside its prompt) as read by
        the batch; returns the tokens already read by another sequence."""
        n = min(job.n_pin, input_tokens // self.block_tokens)
        if n <= 0:
            return 0
        job.n_shared = n
        return inst.shared.join(job.hashes, n)

    def _leave_shared(self, inst: InstanceState, job: DecodeJob) -> int:
        """Undo `_join_shared` as `job` leaves the batch; returns the tokens it no longer
        duplicates."""
        dup = inst.shared.leave(job.hashes, job.n_shared)
        job.n_shared = 0
        return dup

    # ---------------------------------------------------------------- ending requests
    def _finish(self, inst: InstanceState, job: DecodeJob) -> None:
        now = self.now
        rec = job.rec
        req = job.req
        rec.finish_s = now
        assert rec.first_token_s is not None  # stamped at prefill / KV admission
        rec.decode_s = now - rec.first_token_s
        inst.n_seqs -= 1
        inst.load.running -= 1
        if self.events is not None:
            self.running_down[inst.index](now)
        inst.cache.reserved -= job.need
        if job.n_pin:
            inst.cache.unpin(job.hashes, job.n_pin)
            job.n_pin = 0
        inst.load.outstanding_tokens -= req.input_tokens + req.output_tokens
        if self.notify_finish:  # the same rule for a failed request (_fail)
            self.policy.on_finish(req, inst.index, now)
        self.emit(rec)

    def _fail(self, inst: InstanceState, job: Job, error: str) -> None:
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
