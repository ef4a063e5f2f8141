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
    host_ram_bytes: float = Field(
        512e9, ge=0, description="Host RAM available for KV per instance."
    )
    transferred_kv_reusable: bool = Field(
        True,
        description="KV received from another instance enters the receiver's prefix cache "
        "and serves later turns (H6; only a real cluster can settle it).",
    )
    sample_interval_s: float = Field(
        1.0,
        ge=MIN_SAMPLE_INTERVAL_S,
        description="Utilization sampling period on the simulated clock (at least "
        f"{MIN_SAMPLE_INTERVAL_S:g} s, ten times finer than the real cluster's 10 Hz; one "
        "sample per instance per period is kept in memory).",
    )

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
