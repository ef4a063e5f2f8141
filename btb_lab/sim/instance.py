"""Runtime state of one simulated instance (its queue, phase, decode batch, prefix cache,
load counters and busy/memory samples), the `ClusterView` a policy sees of the instances,
and the utilization samples a run yields from them.

The engine's layers (`scheduler.py`, `transfers.py`, `engine.py`) change this state; it
knows nothing of events or of other instances.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable, Sequence

from btb_lab.config.limits import MAX_UTIL_SAMPLES
from btb_lab.config.sim import SimSettings
from btb_lab.errors import UserError
from btb_lab.model.costmodel import InstanceCosts
from btb_lab.model.hardware import InstanceSpec
from btb_lab.policies.base import CostModel, InstanceLoad
from btb_lab.records import UtilSample
from btb_lab.sim.cache import PrefixCache, RoutedBlocks, implementation
from btb_lab.sim.decode import SharedPrefixReads
from btb_lab.sim.jobs import DecodeJob, Job, PrefillJob, ReqJob, WarmJob

__all__ = [
    "PHASE_DECODE",
    "PHASE_IDLE",
    "PHASE_PREFILL",
    "EngineView",
    "InstanceState",
    "TooLongSimulated",
    "utilization_samples",
]

PHASE_IDLE = 0
PHASE_PREFILL = 1  # one prefill (or warm recompute) running; decode paused
PHASE_DECODE = 2  # a closed-form decode segment running


class InstanceState:
    """Runtime state of one instance (its static shape is `spec`)."""

    __slots__ = (
        "admitted",
        "busy_bins",
        "busy_since",
        "cache",
        "ctx_base",
        "dK",
        "dS",
        "dW",
        "disk_tok_s",
        "egress_free_s",
        "host_free_s",
        "index",
        "link_free_s",
        "load",
        "max_bins",
        "mem_bin",
        "mem_peak",
        "mem_samples",
        "n_seqs",
        "name",
        "p_tok_s",
        "phase",
        "prefill_costs",
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
        costs: InstanceCosts,
        settings: SimSettings,
        block_tokens: int,
        disk: set[int] | None,
        n_instances: int = 1,
    ) -> None:
        self.spec = spec
        self.index = spec.index
        self.name = spec.name
        self.waiting: deque[Job] = deque()
        # admission all_that_fit: admitted (KV reserved), prefill not started yet
        self.admitted: deque[ReqJob | PrefillJob | WarmJob] = deque()
        self.phase = PHASE_IDLE
        # the running decode segment: start, steps, step-time coefficients (decode.py)
        self.seg_start = 0.0
        self.seg_steps = 0
        self.seg_c0 = 0.0
        self.seg_c1 = 0.0
        self.seg_version = 0  # bumped when a segment is cut; stale segment events drop
        self.steps_done = 0
        # decoding sequences by the step they finish at: (end step, order, job)
        self.run_heap: list[tuple[int, int, DecodeJob]] = []
        self.run_seq = 0
        # context the batch reads per step, less steps_done per sequence (decode.py)
        self.ctx_base = 0
        self.n_seqs = 0  # admitted requests (prefilling or decoding), against max_batch
        kvb = spec.kv_bytes_per_token
        if not settings.host_ram_tier:
            ram_cap_blocks = 0
        elif settings.host_ram_bytes is None:
            ram_cap_blocks = sys.maxsize  # unbounded
        else:
            ram_cap_blocks = int(settings.host_ram_bytes // (kvb * block_tokens))
        _, cache_cls, routed_cls = implementation()
        self.cache: PrefixCache = cache_cls(
            spec.name,
            spec.kv_budget_tokens,
            block_tokens,
            ram_cap_blocks=ram_cap_blocks,
            disk=disk,
            cache_whole=settings.prefix_cache_budget == "whole",
        )
        # shared_prefix_attention: the pinned prompt blocks the decoding batch shares
        self.shared = SharedPrefixReads(block_tokens)
        self.link_free_s = 0.0  # when its incoming RDMA link is next free
        self.egress_free_s = 0.0  # when its outgoing one is (`rdma_egress_shared`)
        self.host_free_s = 0.0  # when its HBM <-> host RAM link is next free (actions.py)
        self.routed: RoutedBlocks = routed_cls(max(1, spec.kv_budget_tokens // block_tokens))
        self.load = InstanceLoad(spec.index, spec.name, spec.role, 0, 0, 0)
        self.busy_since = 0.0
        self.busy_bins: list[float] = []
        self.max_bins = MAX_UTIL_SAMPLES // max(1, n_instances)  # the run's share of the limit
        self.mem_bin = -1
        self.mem_peak = 0
        self.mem_samples: dict[int, int] = {}
        # Closed-form coefficients (seconds), from the shared cost model.
        self.p_tok_s = costs.prefill_token_s
        # a fitted profile's prefill (fixed, attention, cached terms) goes through the cost
        # model's formula; the roofline's is the per-token product alone (None)
        self.prefill_costs = costs if costs.prefill_terms else None
        slow = 1.0 + (settings.connector_decode_slowdown if spec.kv_connector else 0.0)
        # decode step: dW + dS × batch + dK × context tokens (decode.py)
        self.dW = costs.decode_step_s * slow
        self.dS = costs.decode_seq_s * slow
        self.dK = costs.decode_context_token_s * slow
        self.ram_tok_s = costs.ram_token_s
        self.disk_tok_s = costs.disk_token_s

    def reserve(self, tokens: int, now_s: float, dt_s: float) -> None:
        """Reserve `tokens` of KV (sampling the peak memory use of the `dt_s` bin at
        `now_s`), then fit the cache in what is left."""
        cache = self.cache
        cache.reserved += tokens
        used = cache.reserved + cache.pinned_tokens
        k = int(now_s / dt_s)
        if k != self.mem_bin:
            if self.mem_bin >= 0:
                self.mem_samples[self.mem_bin] = self.mem_peak
            self.mem_bin = k
            self.mem_peak = used
        elif used > self.mem_peak:
            self.mem_peak = used
        cache.fit()

    def add_busy(self, a_s: float, b_s: float, dt_s: float) -> None:
        """Count [a_s, b_s) as busy in the `dt_s` bins it covers."""
        if b_s <= a_s:
            return
        bins = self.busy_bins
        if b_s >= self.max_bins * dt_s:  # an infinite time too
            raise TooLongSimulated(b_s, dt_s)
        i = int(a_s / dt_s)
        j = int(b_s / dt_s)
        if j >= len(bins):
            bins.extend([0.0] * (j + 1 - len(bins)))
        if i == j:
            bins[i] += b_s - a_s
            return
        bins[i] += (i + 1) * dt_s - a_s
        for k in range(i + 1, j):
            bins[k] = dt_s
        bins[j] += b_s - j * dt_s


class EngineView:
    """The `ClusterView` a policy sees; attributes are updated in place as the run goes."""

    __slots__ = ("_complete", "_match", "costs", "instances", "now_s")

    def __init__(
        self,
        insts: Sequence[InstanceState],
        costs: CostModel,
        *,
        routed: bool,
        match_ram: bool = False,
    ) -> None:
        self.now_s = 0.0
        self.instances: list[InstanceLoad] = [i.load for i in insts]
        self.costs = costs
        # the cache objects live as long as the run, so the view can hold them directly
        self._complete = [i.cache for i in insts]
        # the known blocks' lead per instance, bound once: policies call this for every
        # instance at every arrival (router_match_tiers hbm_ram: host RAM counts too)
        self._match: list[Callable[[Sequence[int]], int]] = [
            i.routed.lead if routed else i.cache.host_lead if match_ram else i.cache.lead
            for i in insts
        ]

    def match_blocks(self, instance: int, block_hashes: Sequence[int]) -> int:
        return self._match[instance](block_hashes)

    def complete_blocks(self, instance: int, block_hashes: Sequence[int]) -> int:
        return self._complete[instance].lead(block_hashes)

    def host_blocks(self, instance: int, block_hashes: Sequence[int]) -> int:
        return self._complete[instance].host_lead(block_hashes)


class TooLongSimulated(UserError):
    """The simulated time ran so far past the workload that its utilization samples would
    not fit in memory: the instances cannot keep up (a cost setting far off), found while
    the run goes (`runner._check_sim_sampling` checks the workload's own span before)."""

    def __init__(self, time_s: float, dt_s: float) -> None:
        shown = f"{time_s:,.0f}" if time_s < 1e15 else f"{time_s:.3g}"
        super().__init__(
            f"the simulated time passed {shown} s: the instances fall so far behind the "
            f"workload that sampling their utilization every {dt_s:g} s would keep more than "
            f"{MAX_UTIL_SAMPLES:,} samples; check the cost settings (costs.mfu, an engine "
            "profile's times) or raise sim.sample_interval_s"
        )


def utilization_samples(
    insts: Sequence[InstanceState], dt_s: float, end_s: float
) -> list[UtilSample]:
    """Per instance and `dt_s` bin up to `end_s`: the busy fraction and the peak memory
    (weights + KV in use)."""
    n_bins = max(1, math.ceil(end_s / dt_s - 1e-9))
    if n_bins * len(insts) > MAX_UTIL_SAMPLES:
        raise TooLongSimulated(end_s, dt_s)
    out: list[UtilSample] = []
    for inst in insts:
        if inst.mem_bin >= 0:
            inst.mem_samples[inst.mem_bin] = inst.mem_peak
        weights = inst.spec.model.weight_total_bytes
        kvb = inst.spec.kv_bytes_per_token
        bins = inst.busy_bins
        for k in range(n_bins):
            span = min(dt_s, end_s - k * dt_s) if end_s > k * dt_s else dt_s
            busy = bins[k] if k < len(bins) else 0.0
            util = min(1.0, busy / span) if span > 0 else 0.0
            mem = weights + inst.mem_samples.get(k, 0) * kvb
            out.append(
                UtilSample(
                    time_s=min(end_s, (k + 1) * dt_s),
                    instance=inst.name,
                    device="sim",
                    utilization=util,
                    memory_bytes=mem,
                    source="sim",
                )
            )
    return out
