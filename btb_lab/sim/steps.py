"""Mixed prefill/decode engine steps (`sim.step_model: mixed`), as vLLM V1 schedules them
with chunked prefill: the prefills waiting together on an instance start in one batch and
the running decodes keep advancing while it runs, one token per step.

A batch takes the admissible waiting prefills in order while their uncached tokens fit in
one step's budget (`max_batched_tokens` less one token per running decode); the first
always goes in, and a first prefill longer than the budget runs alone in
`ceil(tokens / budget)` chunks, one step each. The batch's work is the sum of its
prefills' costs with the profile's fixed prefill cost paid once per step instead of once
per prefill, shared evenly over its steps. Each step of the batch is one decode step of
the running batch (the closed form of `decode.py`) plus that share, so the batch runs as
decode segments with `c0` raised by the share: cut where a decoding sequence finishes,
then resumed until its steps are done. Its prefills produce their first tokens when the
batch ends, and join the decode batch there. Work arriving meanwhile waits for the next
batch, as a running step in vLLM is not changed either. With no decode running, a batch
is its work alone. An idle instance forms its batch after every arrival of the same
instant (requests that arrive together start together), a decoding one at the step
boundary its first waiting prefill cuts the segment at.

This layer sits on `actions.py` and below `engine.py`. With `step_model: serial` (the
default) nothing here runs but `_land_prefill` and `_retire`, which are the serial
engine's own handlers' bodies.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace
from typing import Any

from btb_lab.sim.actions import CacheActions
from btb_lab.sim.decode import segment_s
from btb_lab.sim.instance import PHASE_IDLE, PHASE_PREFILL, InstanceState
from btb_lab.sim.jobs import KVJob, PrefillJob, ReqJob, WarmJob, pin_prompt
from btb_lab.sim.scheduler import PRI_ARRIVAL, PRI_PREFILL

__all__ = ["EV_BATCH", "EV_WAKE", "PRI_WAKE", "MixedSteps", "PrefillBatch"]

# `Engine._run`'s handler indexes: the end of a mixed batch's steps, and an idle instance
# forming its first batch once everything at this instant has arrived
EV_BATCH = 5
EV_WAKE = 6
PRI_WAKE = PRI_ARRIVAL + 1  # after the arrivals of the same instant


class PrefillBatch:
    """The prefills one mixed batch runs, the steps it has left and each step's share of
    their work (seconds)."""

    __slots__ = ("jobs", "share_s", "start_s", "steps_left")

    def __init__(
        self, jobs: list[ReqJob | PrefillJob | WarmJob], steps: int, share_s: float, start_s: float
    ) -> None:
        self.jobs = jobs
        self.steps_left = steps
        self.share_s = share_s
        self.start_s = start_s


class MixedSteps(CacheActions):
    """Batches of prefills run inside decode steps (step_model mixed), and the completion
    bodies both step models share."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_batched_tokens = self.settings.max_batched_tokens
        self.batches: list[PrefillBatch | None] = [None] * len(self.insts)
        # the least one step of a batch with no decode running takes (prefill_weight_read:
        # the weights read once a step, not once a prefill of the batch)
        self.batch_floor_s = [0.0] * len(self.insts)
        if self.mixed:
            for inst in self.insts:
                costs = inst.prefill_costs
                if costs is not None and costs.prefill_floor_s:
                    self.batch_floor_s[inst.index] = costs.prefill_floor_s
                    costs = replace(costs, prefill_floor_s=0.0)
                    inst.prefill_costs = costs if costs.prefill_terms else None
            self.stats["prefill_batches"] = 0
            # bound once, so the serial engine's hot path keeps its direct call
            self._step = self._step_mixed  # type: ignore[method-assign]  # a bound override

    # ---------------------------------------------------------------- both models
    def _land_prefill(self, inst: InstanceState, job: ReqJob | PrefillJob | WarmJob) -> None:
        """`job`'s prefill (or warm recompute or copy) on `inst` is done now."""
        hashes = job.hashes
        if isinstance(job, WarmJob) and job.copy_s >= 0:
            inst.cache.insert(hashes)  # a copy on the target's compute has landed
        elif self.after_prefill and hashes:
            if self.sharing and not isinstance(job, WarmJob):
                # its own blocks are resident now: move them from reserved to pinned
                pinned = pin_prompt(inst.cache, job)
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
        elif self.events is not None:  # a warm recompute or copy: the prefix is here now
            self.events.warm_copy(
                job.start_s, self.now, inst.name, job.source, job.tokens,
                mode="rdma" if job.copy_s >= 0 else "prefill", request_id=job.request_id,
            )  # fmt: skip

    def _retire(self, inst: InstanceState, steps: int) -> None:
        """`steps` decode steps of `inst`'s batch are done: finish the sequences they end."""
        inst.steps_done += steps
        done = inst.steps_done
        run_heap = inst.run_heap
        while run_heap and run_heap[0][0] <= done:
            job = heapq.heappop(run_heap)[2]
            inst.ctx_base -= job.ctx_off
            if job.n_shared:
                inst.ctx_base += self._leave_shared(inst, job)
            self._finish(inst, job)

    # ---------------------------------------------------------------- mixed steps
    def _new_tokens(self, inst: InstanceState, job: ReqJob | PrefillJob | WarmJob) -> int:
        """The tokens `job`'s prefill computes, for the step budget: its prompt less the
        leading blocks resident in HBM (a cold prefill reuses none)."""
        tokens = job.tokens if isinstance(job, WarmJob) else job.req.input_tokens
        if job.hashes and not (isinstance(job, PrefillJob) and job.cold):
            tokens -= min(
                inst.cache.lead(job.hashes) * self.block_tokens, self._hit_cap(job, tokens)
            )
        return tokens

    def _step_mixed(self, inst: InstanceState) -> None:
        """`_step` for step_model mixed: start every waiting prefill that fits one step's
        budget as one batch, else decode (or go idle) as the serial engine does. An idle
        instance waits for the rest of this instant's arrivals first (held busy meanwhile,
        so they queue)."""
        if inst.phase == PHASE_IDLE and inst.waiting:
            inst.phase = PHASE_PREFILL
            self._push(self.now, PRI_WAKE, EV_WAKE, inst.index, None)
            return
        self._form_batch(inst)

    def _on_wake(self, index: int, _: None) -> None:
        inst = self.insts[index]
        inst.phase = PHASE_IDLE
        self._form_batch(inst)

    def _form_batch(self, inst: InstanceState) -> None:
        now = self.now
        waiting = inst.waiting
        was_idle = inst.phase == PHASE_IDLE
        cap = inst.cache.cap_tokens
        budget = max(1, self.max_batched_tokens - len(inst.run_heap))
        jobs: list[ReqJob | PrefillJob | WarmJob] = []
        used = 0
        while waiting:
            job = waiting[0]
            if job.need > cap:
                self._dequeue(inst)
                self._fail(inst, job, f"needs {job.need} KV tokens; {inst.name} holds {cap}")
                continue
            if not self._admissible(inst, job):
                break
            if isinstance(job, KVJob):
                if jobs:
                    break  # joins the decode batch once this batch is done
                self._dequeue(inst)
                self._admit_kv(inst, job)
                continue
            new = self._new_tokens(inst, job)
            if jobs and used + new > budget:
                break
            self._dequeue(inst)
            if self._start_prefill(inst, job):
                jobs.append(job)
                used += new
        if not jobs:
            # nothing admissible waits: the serial step decodes or goes idle
            super()._step(inst)
            return
        if was_idle:
            inst.busy_since = now
        costs = inst.prefill_costs
        fixed = costs.prefill_fixed_s if costs is not None else 0.0
        steps = 1 if len(jobs) > 1 else max(1, math.ceil(used / budget))
        work = sum(j.run_s for j in jobs) + fixed * (steps - len(jobs))
        batch = PrefillBatch(jobs, steps, work / steps, now)
        self.batches[inst.index] = batch
        self.stats["prefill_batches"] += 1
        inst.phase = PHASE_PREFILL
        end = self._run_batch(inst, batch)
        if self.deferred_expects:
            # the batch's blocks are pending until it ends (as its decodes stand now)
            for hashes, start in self.deferred_expects:
                inst.cache.expect(hashes, start, end)
            self.deferred_expects.clear()

    def _dequeue(self, inst: InstanceState) -> None:
        inst.waiting.popleft()
        inst.load.waiting -= 1
        if self.events is not None:
            self.waiting_down[inst.index](self.now)

    def _run_batch(self, inst: InstanceState, batch: PrefillBatch) -> float:
        """Run `batch`'s next steps as one segment, up to its end or the next finishing
        decode; returns when the whole batch would end at the current decode batch."""
        now = self.now
        run_heap = inst.run_heap
        b = len(run_heap)
        left = batch.steps_left
        if b:
            k_tokens = inst.ctx_base + b * inst.steps_done
            c0 = inst.dW + k_tokens * inst.dK + b * inst.dS + batch.share_s
            c1 = b * inst.dK
            steps = min(left, run_heap[0][0] - inst.steps_done)
        else:  # no decode step reads the weights: the batch's own steps do
            c0 = max(batch.share_s, self.batch_floor_s[inst.index])
            c1 = 0.0
            steps = left
        inst.seg_c0 = c0
        inst.seg_c1 = c1
        inst.seg_start = now
        inst.seg_steps = steps
        inst.seg_version += 1
        self._push(
            segment_s(steps, c0, c1, now), PRI_PREFILL, EV_BATCH, inst.index, inst.seg_version
        )
        return segment_s(left, c0, c1, now)

    def _on_batch(self, index: int, version: int) -> None:
        """A mixed batch's segment ended: retire the decodes it finished, then run its next
        steps, or land its prefills and pick the next work."""
        inst = self.insts[index]
        batch = self.batches[index]
        if version != inst.seg_version or batch is None:
            return
        steps = inst.seg_steps
        if inst.run_heap:
            self._retire(inst, steps)
        batch.steps_left -= steps
        if batch.steps_left > 0:
            self._run_batch(inst, batch)
            return
        self.batches[index] = None
        wall_s = self.now - batch.start_s
        for job in batch.jobs:
            if not isinstance(job, WarmJob):
                job.rec.prefill_s = wall_s - job.rec.kv_load_s
            self._land_prefill(inst, job)
        self._step(inst)
