"""Simulator fidelity settings (the `sim:` block): every simplification is a named,
recorded setting. Cost-model parameters shared with the cluster backend live in
`config.costs` instead."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from btb_lab.config.base import StrictModel
from btb_lab.config.limits import MIN_SAMPLE_INTERVAL_S

__all__ = ["SimSettings"]


class SimSettings(StrictModel):
    """The `sim:` block of a hypothesis (and of a variant's overrides)."""

    profile: Literal["causal", "infer-sim"] = Field(
        "causal",
        description="A named set of defaults for this block, `costs:` and the routers' "
        "params (config/profiles.py): causal (btb-lab's defaults) or infer-sim (the BTB "
        "seed simulator's rules). Settings written out still win; the manifest records "
        "the profile and every resolved value.",
    )

    kv_visibility: Literal["after_prefill", "at_admission"] = Field(
        "after_prefill",
        description="When a request's KV becomes resident, matchable and copyable: after its "
        "prefill completes (causal) or the moment it is admitted (the seed simulator).",
    )
    kv_prefix_sharing: bool = Field(
        True,
        description="Running requests share the KV blocks of a cached prefix, as vLLM's "
        "prefix cache does (ref-counted): a request reserves only the prompt blocks it does "
        "not reuse plus its output, and pins the reused blocks while it runs; false "
        "reserves each request's whole prompt.",
    )
    shared_prefix_attention: bool = Field(
        False,
        description="A decode step reads the KV of a prefix shared by several running "
        "sequences once, as vLLM's cascade attention does (the pinned leading blocks two or "
        "more decoding sequences on an instance share count once); false (default): each "
        "sequence reads its whole context. Needs kv_prefix_sharing.",
    )
    router_view: Literal["routed", "resident"] = Field(
        "routed",
        description="What a cache-aware router sees: prefixes it routed (SGLang's approximate "
        "tree) or the engines' actual resident caches.",
    )
    layerwise: bool = Field(
        False, description="KV transfer overlaps the producer's prefill layer by layer."
    )
    connector_decode_slowdown: float = Field(
        0.0,
        ge=0,
        description="Relative decode-step slowdown on instances running a KV connector (H1).",
    )
    max_batch: int = Field(256, ge=1, description="Continuous-batching limit per instance.")
    host_ram_tier: bool = Field(True, description="Evicted HBM blocks move to host RAM.")
    disk_tier: bool = Field(False, description="Blocks evicted from host RAM move to disk.")
    host_ram_bytes: float | None = Field(
        512e9,
        ge=0,
        description="Host RAM available for KV per instance; null: unbounded (the seed "
        "simulator's host RAM is an unbounded set).",
    )
    transferred_kv_reusable: bool = Field(
        True,
        description="KV received from another instance enters the receiver's prefix cache "
        "and serves later turns (H6; only a real cluster can settle it).",
    )
    rdma_egress_shared: bool = Field(
        True,
        description="Transfers out of one instance share its RDMA link too, one at a time "
        "(a warm copy fanned out to M targets lands after M copy times, as a NIC's egress "
        "bandwidth is shared); false: only transfers into an instance queue, the source "
        "sends to any number of targets at full bandwidth each (btb-lab before engine "
        "version 3; the seed simulator has no link contention at all).",
    )
    window_replay: Literal["continuous", "fresh"] = Field(
        "continuous",
        description="How a workload of several trace windows (trace_ids) replays: one "
        "after another on one cluster whose caches and queues carry over (continuous), or "
        "each window on a fresh, empty cluster with a freshly seeded router, results pooled "
        "(fresh: the seed simulator; on a real cluster, a restart or flush per window).",
    )
    admission: Literal["serial", "all_that_fit"] = Field(
        "serial",
        description="When a queued request is admitted (its KV reserved): as its prefill "
        "starts, one at a time (serial), or every queued request that fits the moment it "
        "fits, head-of-line, their prefills then run one after another (all_that_fit: the "
        "seed simulator; needs kv_visibility at_admission, whose blocks become visible at "
        "that admission).",
    )
    prefix_cache_budget: Literal["unreserved", "whole"] = Field(
        "unreserved",
        description="HBM the prefix cache may fill: what admitted requests have not "
        "reserved (one memory, counted once), or the whole KV budget regardless of "
        "reservations (the seed simulator: the same memory counted twice, once by "
        "admission and once by the cache).",
    )
    output_blocks_cached: bool = Field(
        False,
        description="At admission, a request's output blocks (ceil((input + output) / "
        "block) − prompt blocks, each its own id) enter the HBM cache with its prompt, "
        "taking cache space (the seed simulator); false: output KV is never cached.",
    )
    decode_steps: Literal["after_first_token", "output_tokens"] = Field(
        "after_first_token",
        description="Decode steps a request runs: output_tokens − 1 after the prefill "
        "produced the first token (vLLM), or output_tokens starting from context = input "
        "(the seed simulator: a 1-token request still runs one decode step).",
    )
    prompt_cache_hit: Literal["full_blocks", "whole_prompt"] = Field(
        "full_blocks",
        description="What a prefix-cache hit spares a prefill: whole blocks only, and the "
        "last prompt token is always computed for its logits (vLLM: a fully cached prompt "
        "still computes one token, so a first token is never free), or every matched "
        "block up to the whole prompt, a partly filled last block included (the seed "
        "simulator).",
    )
    router_match_tiers: Literal["hbm", "hbm_ram"] = Field(
        "hbm",
        description="With router_view: resident, which tiers a cache-aware router's match "
        "counts: HBM only, or HBM and host RAM (the seed simulator).",
    )
    warm_copy_blocks_target: bool = Field(
        False,
        description="A warm copy (RDMA) runs on the target's compute queue, ahead of "
        "waiting work, and blocks it for the copy's duration; its blocks land when it ends "
        "(the seed simulator; no link contention). False: copies use the target's RDMA "
        "link beside its compute.",
    )
    step_model: Literal["serial", "mixed"] = Field(
        "serial",
        description="How an instance's engine steps combine prefill and decode: one prefill "
        "at a time with decode paused, each paying the profile's fixed prefill cost "
        "(serial), or vLLM's mixed steps (chunked prefill, as vLLM V1 schedules): the "
        "prefills waiting together start in one step up to max_batched_tokens, paying the "
        "fixed cost once per step, and running decodes keep making one token per step, "
        "each step lasting a decode step plus the prefill's share (mixed; a prefill "
        "longer than the budget runs in chunks, one step each).",
    )
    max_batched_tokens: int = Field(
        2048,
        ge=1,
        description="With step_model mixed, the tokens one engine step takes (vLLM's "
        "max_num_batched_tokens): each running decode takes one, prefills share the "
        "rest. 2048 is vLLM's default for its API server on CPUs (per tensor-parallel rank) "
        "and GPUs under 70 GB; it uses 8192 on H100/H200 and 16384 from 160 GB.",
    )
    sample_interval_s: float = Field(
        1.0,
        ge=MIN_SAMPLE_INTERVAL_S,
        description="Utilization sampling period on the simulated clock (at least "
        f"{MIN_SAMPLE_INTERVAL_S:g} s, ten times finer than the real cluster's 10 Hz; one "
        "sample per instance per period is kept in memory).",
    )

    @model_validator(mode="after")
    def _batch_admission_needs_visibility(self) -> SimSettings:
        """An admitted request's prefill may start long after admission; with KV visible
        only after prefill the engine would have to track two clocks per request."""
        if self.admission == "all_that_fit" and self.kv_visibility != "at_admission":
            raise ValueError("sim.admission: all_that_fit needs sim.kv_visibility: at_admission")
        return self

    @model_validator(mode="after")
    def _mixed_steps_alone(self) -> SimSettings:
        """Mixed steps batch prefills as they start; admission all_that_fit admits ahead of
        the prefill and a blocking warm copy holds the compute alone: neither has a meaning
        inside a mixed step yet, so asking for both would silently measure one of them."""
        if self.step_model == "mixed":
            if self.admission == "all_that_fit":
                raise ValueError("sim.step_model: mixed needs sim.admission: serial")
            if self.warm_copy_blocks_target:
                raise ValueError("sim.step_model: mixed needs sim.warm_copy_blocks_target: false")
        return self

    @model_validator(mode="after")
    def _shared_attention_needs_sharing(self) -> SimSettings:
        """Without prefix sharing nothing is pinned, so there is no shared prefix to read
        once: asking for both would silently measure nothing."""
        if self.shared_prefix_attention and not self.kv_prefix_sharing:
            raise ValueError(
                "sim.shared_prefix_attention: true needs sim.kv_prefix_sharing: true "
                "(the shared prefix is the pinned, ref-counted cached blocks)"
            )
        return self

    @model_validator(mode="after")
    def _match_tiers_need_resident(self) -> SimSettings:
        """The routed view is the router's own record of where it sent prefixes, which has
        no host-RAM tier: the setting would silently measure nothing."""
        if self.router_match_tiers == "hbm_ram" and self.router_view == "routed":
            raise ValueError(
                "sim.router_match_tiers: hbm_ram needs sim.router_view: resident (the routed "
                "view knows no host RAM)"
            )
        return self
