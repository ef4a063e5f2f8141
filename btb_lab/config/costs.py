"""The backend-neutral cost-model block (`costs:`): what a prefill, a decode step and a KV
transfer cost. The simulator's engine and the cost-based policies on a real cluster read
the same block, so a cost-based decision is configured the same way in both worlds.

The four parameters used to live under `sim:`; `sim.mfu`, `sim.mbu`,
`sim.transfer_setup_ms` and `sim.gpu_memory_utilization` are still accepted as aliases
(also in a variant's `sim` overrides and in `--set`), moved here by the hypothesis model
and recorded in the manifest as aliases.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Literal

from pydantic import Field, model_validator

from btb_lab.config.base import StrictModel

__all__ = ["SIM_ALIASES", "CostSettings", "ProfileRef", "move_sim_aliases"]


class ProfileRef(StrictModel):
    """`costs.model: {profile: PATH}`: costs from an engine profile fitted by calibrate."""

    profile: str = Field(
        description="Profile YAML written by `btb-lab calibrate`, relative to the hypothesis "
        "file's folder."
    )


class CostSettings(StrictModel):
    """Where costs come from, and the roofline's parameters (presets × these factors)."""

    model: Literal["roofline"] | ProfileRef = Field(
        "roofline",
        description="Where costs come from: `roofline` (GPU and model presets × MFU/MBU and "
        "the bandwidths of each tier) or `{profile: PATH}` (an engine profile fitted to "
        "measurements by `btb-lab calibrate`; memory still follows the presets).",
    )
    mfu: float = Field(0.5, gt=0, le=1, description="Model FLOP utilization during prefill.")
    prefill_attention: bool = Field(
        False,
        description="The roofline's prefill also computes attention: each new token over "
        "every token before it, cached or new, 4 × layers × query width FLOPs a pair at "
        "costs.mfu (a 65,536-token prompt on llama-3.3-70b costs 1.61× the linear layers "
        "alone); needs the model's query width (a preset that has it, or "
        "model.attention_heads). False: only the linear layers' 2 × active params per token "
        "(the seed simulator). A fitted profile has its own attention term.",
    )
    prefill_weight_read: bool = Field(
        False,
        description="A prefill reads the active weights once, as a decode step does: it "
        "takes at least active weight bytes / (HBM bandwidth × costs.mbu) however few its "
        "new tokens (llama-3.3-70b on 4×H100: 13.2 ms, the compute of ~185 tokens), so a "
        "prompt found almost whole in cache is not nearly free. Under sim.step_model mixed "
        "a batch's steps pay it once a step, and not beside running decodes, whose steps "
        "read the weights already. False: compute only (the seed simulator). A fitted "
        "profile's fixed prefill cost measured this.",
    )
    mbu: float = Field(0.8, gt=0, le=1, description="Memory bandwidth utilization in decode.")
    transfer_setup_ms: float = Field(
        1.0, ge=0, le=60_000, description="Fixed latency of one KV transfer between instances."
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Fraction of HBM the engine may use (vLLM's gpu_memory_utilization); KV "
        "gets what is left after the weights.",
    )

    @model_validator(mode="after")
    def _attention_on_the_roofline(self) -> CostSettings:
        """A fitted profile measured its prefill attention; adding the roofline's on top
        would count it twice."""
        if self.prefill_attention and self.model != "roofline":
            raise ValueError(
                "costs.prefill_attention applies to the roofline; a fitted profile "
                "(costs.model.profile) has its own prefill attention term"
            )
        if self.prefill_weight_read and self.model != "roofline":
            raise ValueError(
                "costs.prefill_weight_read applies to the roofline; a fitted profile "
                "(costs.model.profile) measured its fixed prefill cost"
            )
        return self


SIM_ALIASES: tuple[str, ...] = ("mfu", "mbu", "transfer_setup_ms", "gpu_memory_utilization")


def move_sim_aliases(data: MutableMapping[str, Any], *, where: str = "") -> list[str]:
    """Move `sim.<alias>` keys of a raw mapping (a hypothesis or a variant) into `costs`;
    returns the moved dotted names (`sim.mfu → costs.mfu`). Setting one name both ways
    is an error, so an alias can never silently lose to the other spelling."""
    sim = data.get("sim")
    if not isinstance(sim, MutableMapping):
        return []
    moved = [key for key in SIM_ALIASES if key in sim]
    if not moved:
        return []
    costs = data.get("costs")
    if costs is None:
        costs = {}
    if not isinstance(costs, MutableMapping):
        return []  # the schema reports the bad `costs` value itself
    costs = dict(costs)
    notes = []
    for key in moved:
        if key in costs:
            raise ValueError(
                f"{where}sim.{key} and {where}costs.{key} are both set; "
                f"sim.{key} is an alias of costs.{key}: keep one"
            )
        costs[key] = sim[key]
        notes.append(f"{where}sim.{key} → {where}costs.{key}")
    data["sim"] = {k: v for k, v in sim.items() if k not in moved}
    data["costs"] = costs
    return notes
