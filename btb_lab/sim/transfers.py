"""KV moving between instances: warming a prefix on another instance (an RDMA copy from a
source, or a recompute there), shipping an offloaded prefill's KV to its decode instance,
and the events these end in (a transfer landing, a parked job resuming).

Transfers into one instance share its RDMA link, one at a time (`link_free_s`), and with
`rdma_egress_shared` so do transfers out of one (`egress_free_s`). A copy
never starts before its blocks are complete on the source; a prefill may wait once for a
copy in flight to it when that beats recomputing (it is parked until the copy lands).
"""

from __future__ import annotations

from typing import Any

from btb_lab.policies.base import WarmAction
from btb_lab.records import Request
from btb_lab.sim.decode import TIME_EPS_S
from btb_lab.sim.instance import InstanceState
from btb_lab.sim.jobs import (
    KVJob,
    PrefillJob,
    ReqJob,
    WarmCopy,
    WarmJob,
    WarmLogEntry,
    kv_need,
)
from btb_lab.sim.scheduler import EV_TRANSFER, PRI_TRANSFER, Scheduler

__all__ = ["Transfers"]


class Transfers(Scheduler):
    """The engine's KV movement, on top of the scheduling it feeds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # `cluster.kv_connector.type: none`: no connector moves KV, as on a real cluster
        # (README, "Real clusters"): an offload runs on its decode instance alone and a warm
        # copy is a speculative prefill of the prefix on its target
        self.moves_kv = all(inst.spec.kv_connector for inst in self.insts)
        if not self.moves_kv:
            self.stats.update(offloads_without_connector=0, warm_copies_as_prefills=0)

    def _warm(self, req: Request, action: WarmAction) -> None:
        """Carry out one warm action a policy asked for at `req`'s arrival."""
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
        if action.mode == "prefill" or not self.moves_kv:
            if action.mode != "prefill":
                self.stats["warm_copies_as_prefills"] += 1
            self.stats["warm_prefills"] += 1
            warm = WarmJob(hashes, len(hashes) * req.block_tokens, req.request_id)
            self._enqueue(target, warm)
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
        tokens = n_copy * req.block_tokens
        nbytes = tokens * target.spec.kv_bytes_per_token
        if self.copy_blocks:
            # on the target's compute queue, ahead of waiting work; lands when it ends
            copy_s = self.setup_s + self.costs.kv_move_s(tokens, source.index, target.index)
            warm = WarmJob(copy, tokens, req.request_id, copy_s=copy_s, source=source.name)
            self.stats["warm_copies"] += 1
            self.stats["warm_bytes"] += nbytes
            self._enqueue(target, warm, front=True)
            return
        start = max(now, ready, target.link_free_s, self._egress_free(source))
        done = start + self.setup_s + self.costs.kv_move_s(tokens, source.index, target.index)
        target.link_free_s = done
        self._egress_used(source, done)
        target.cache.expect_copy(copy, done)
        self.stats["warm_copies"] += 1
        self.stats["warm_bytes"] += nbytes
        if self.audit:
            self.warm_log.append(
                WarmLogEntry(source.index, target.index, n_copy, now, start, ready, done)
            )
        self._push(
            done,
            PRI_TRANSFER,
            EV_TRANSFER,
            target.index,
            WarmCopy(source.index, target.index, copy, start, tokens, req.request_id),
        )

    def _ship_kv(self, pinst: InstanceState, job: PrefillJob) -> None:
        """Prefill instance done: move the KV to the decode instance over RDMA."""
        req = job.req
        now = self.now
        pinst.n_seqs -= 1
        pinst.load.running -= 1
        if self.events is not None:
            self.running_down[pinst.index](now)
        pinst.load.outstanding_tokens -= req.input_tokens
        dinst = self.insts[job.decode_inst]
        dur = self.setup_s + self.costs.kv_move_s(req.input_tokens, pinst.index, dinst.index)
        if self.settings.layerwise:
            start = max(job.prefill_start_s, dinst.link_free_s, self._egress_free(pinst))
            done = max(start + dur, now + dur / pinst.spec.model.layers)
        else:
            start = max(now, dinst.link_free_s, self._egress_free(pinst))
            done = start + dur
        dinst.link_free_s = done
        self._egress_used(pinst, done)
        job.rec.kv_transfer_s += done - now
        self.stats["kv_transfers"] += 1
        if self.events is not None:
            self.events.kv_transfer(
                start, done, dinst.name, pinst.name, req.input_tokens, request_id=req.request_id
            )
        self._push(done, PRI_TRANSFER, EV_TRANSFER, dinst.index, job)

    def _egress_free(self, source: InstanceState) -> float:
        """When `source` may start sending: its outgoing link's queue, when shared."""
        return source.egress_free_s if self.settings.rdma_egress_shared else 0.0

    def _egress_used(self, source: InstanceState, done_s: float) -> None:
        if self.settings.rdma_egress_shared:
            source.egress_free_s = done_s

    # ---------------------------------------------------------------- handlers
    def _on_transfer(self, index: int, payload: WarmCopy | PrefillJob) -> None:
        inst = self.insts[index]
        if isinstance(payload, WarmCopy):
            if self.events is not None:
                self.events.warm_copy(
                    payload.start_s,
                    self.now,
                    inst.name,
                    self.insts[payload.source].name,
                    payload.tokens,
                    mode="rdma",
                    request_id=payload.request_id,
                )
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
        self._enqueue(inst, KVJob(req, job.rec, *kv_need(job.prompt_tokens, req), cold=job.cold))

    def _on_park(self, index: int, job: ReqJob | PrefillJob) -> None:
        """A job parked for a warm copy resumes, first in its queue (it waited all along,
        so the queue depth does not change)."""
        inst = self.insts[index]
        wait = self.now - job.park_s
        job.rec.kv_transfer_s += wait
        job.rec.queue_s -= wait  # counted again at admission; it is transfer time
        inst.waiting.appendleft(job)
        self._kick(inst)
