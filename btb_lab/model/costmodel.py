"""The cost model both worlds use: built once per variant from the hypothesis's model,
topology and `costs:` block, handed to the simulator's engine (which advances its clock by
these costs) and to the policies of either backend (through the `CostModel` protocol of
`btb_lab.policies.base`, which this class satisfies structurally).

`RooflineCostModel` is the roofline: compute-bound prefill at MFU (the linear layers, and
with `costs.prefill_attention` attention over the context too), decode steps that read
the active weights once and every context token's KV at MBU × HBM bandwidth, KV moved over
each tier's bandwidth plus a fixed transfer setup latency. A fitted profile
(`model.profile`) adds a fixed cost per prefill, prefill attention over the context, a
cost per cached prefix token and a cost per running sequence per decode step; the formulas
here (`InstanceCosts.prefill_s`, `kv_move_s`) are the ones the engine charges, so a policy
pricing work with this model prices what the simulator will do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from btb_lab.model.hardware import InstanceSpec, build_instances, resolve_model
from btb_lab.model.roofline import attention_pair_s, prefill_s, tier_bandwidth

if TYPE_CHECKING:
    from btb_lab.config.costs import CostSettings
    from btb_lab.config.hypothesis import Hypothesis

__all__ = ["InstanceCosts", "RooflineCostModel", "build_cost_model"]


@dataclass(frozen=True, slots=True)
class InstanceCosts:
    """Per-token and per-step costs of one instance, in seconds (the engine's closed forms
    are built from these)."""

    prefill_token_s: float  # one uncached prompt token: 2 × active params / (FLOP/s × MFU)
    decode_step_s: float  # fixed part of a decode step: active weight bytes / (HBM × MBU)
    decode_context_token_s: float  # per context token per step: KV bytes / (HBM × MBU)
    ram_token_s: float  # loading one token of KV from host RAM
    disk_token_s: float  # loading one token of KV from disk
    # Terms a fitted profile adds (model.profile); zero on the roofline.
    prefill_fixed_s: float = 0.0  # per prefill
    prefill_context_token_s: float = 0.0  # per (new token × context token): attention
    prefill_cached_token_s: float = 0.0  # per cached prompt token brought into use
    decode_seq_s: float = 0.0  # per running sequence per decode step
    # The least a prefill takes (costs.prefill_weight_read: one read of the weights).
    prefill_floor_s: float = 0.0

    @property
    def prefill_terms(self) -> bool:
        """Whether a prefill costs more than its per-token compute (a fitted profile)."""
        return bool(
            self.prefill_fixed_s
            or self.prefill_context_token_s
            or self.prefill_cached_token_s
            or self.prefill_floor_s
        )

    def prefill_s(self, new_tokens: float, cached_tokens: float = 0) -> float:
        """One prefill of `new_tokens` on top of `cached_tokens` already in use: the fixed
        cost, compute per new token, attention of each new token over the context before
        it (`cached_tokens + new_tokens / 2` on average), and bringing the cached prefix
        into use; no less than `prefill_floor_s` (a mixed batch pays that once a step
        instead, `steps.py`). With only the per-token term (the roofline) the sum is that
        term, to the bit."""
        work_s = (
            self.prefill_fixed_s
            + new_tokens * self.prefill_token_s
            + self.prefill_context_token_s * new_tokens * (cached_tokens + new_tokens / 2)
            + self.prefill_cached_token_s * cached_tokens
        )
        if work_s < self.prefill_floor_s:
            return self.prefill_floor_s
        return work_s


class RooflineCostModel:
    """Costs of every instance of one variant's cluster (index order = instance order)."""

    name = "roofline"

    def __init__(self, instances: list[InstanceSpec], settings: CostSettings) -> None:
        self.instances = instances
        self.settings = settings
        self.transfer_setup_s = settings.transfer_setup_ms / 1e3
        self.per_instance = [self._instance_costs(spec) for spec in instances]

    def _instance_costs(self, spec: InstanceSpec) -> InstanceCosts:
        kvb = spec.kv_bytes_per_token
        bw = spec.hbm_bw * self.settings.mbu
        weights_s = spec.model.active_weight_bytes / bw
        return InstanceCosts(
            prefill_token_s=prefill_s(spec, 1, self.settings.mfu),
            decode_step_s=weights_s,
            decode_context_token_s=kvb / bw,
            ram_token_s=kvb / spec.ram_bw,
            disk_token_s=kvb / spec.disk_bw,
            prefill_context_token_s=(
                attention_pair_s(spec, self.settings.mfu)
                if self.settings.prefill_attention
                else 0.0
            ),
            prefill_floor_s=weights_s if self.settings.prefill_weight_read else 0.0,
        )

    # CostModel (policies) -----------------------------------------------------------------
    def prefill_s(self, instance: int, tokens: int, cached_tokens: int = 0) -> float:
        """Prefilling `tokens` uncached prompt tokens on `instance` after `cached_tokens`
        of cached prefix (`InstanceCosts.prefill_s`, as the engine charges it)."""
        return self.per_instance[instance].prefill_s(tokens, cached_tokens)

    def transfer_s(self, tokens: int, source: int, target: int) -> float:
        """Setup latency + moving the KV of `tokens` (`kv_move_s`)."""
        return self.transfer_setup_s + self.kv_move_s(tokens, source, target)

    def load_s(self, instance: int, tokens: int, tier: str) -> float:
        """Making `tokens` of KV resident on `instance` from `tier` (hbm, ram, rdma, disk)."""
        spec = self.instances[instance]
        return tokens * spec.kv_bytes_per_token / tier_bandwidth(spec, tier)

    # engine --------------------------------------------------------------------------------
    def kv_move_s(self, tokens: int, source: int, target: int) -> float:
        """Moving the KV of `tokens` from `source` to `target` once the transfer is set up:
        the target's KV bytes over the slower RDMA link."""
        kvb = self.instances[target].kv_bytes_per_token
        return tokens * kvb / self.link_bw(source, target)

    def link_bw(self, source: int, target: int) -> float:
        """Bytes/s of a KV copy from `source` to `target`: the slower RDMA link."""
        return min(self.instances[source].rdma_bw, self.instances[target].rdma_bw)

    def facts(self) -> dict[str, Any]:
        """What shapes these costs, for manifests and reports; `costs.calibrated` and
        `costs.not_calibrated` say which costs were fitted to something, and to what
        (none, on the roofline)."""
        facts: dict[str, Any] = {f"costs.{k}": v for k, v in self.settings.model_dump().items()}
        facts["costs.calibrated"] = self.calibrated()
        facts["costs.not_calibrated"] = self.not_calibrated()
        return facts

    def calibrated(self) -> list[str]:
        """The costs fitted to measurements or published figures, each with its source."""
        return []

    def not_calibrated(self) -> list[str]:
        """The costs that come from presets, each with where it comes from."""
        s = self.settings
        prefill = f"prefill: roofline (2 × active params / (GPU FLOP/s × costs.mfu {s.mfu:g})"
        if s.prefill_attention:
            prefill += " per token + 4 × layers × query width per new × context token"
        prefill += ")"
        if s.prefill_weight_read:
            prefill += ", at least one read of the weights at HBM bandwidth × costs.mbu"
        decode = (
            "decode step: roofline (weights + context KV read at HBM bandwidth × costs.mbu "
            f"{s.mbu:g})"
        )
        return [prefill, decode, *self._preset_costs()]

    def _preset_costs(self) -> list[str]:
        """The costs no fitted profile replaces (KV moves, lower tiers, capacity); the KV
        transfer comes first, so a profile that measured transfers can drop it."""
        s = self.settings
        transfer = (
            "KV transfer between instances: RDMA link bandwidth preset + "
            f"costs.transfer_setup_ms {s.transfer_setup_ms:g}"
        )
        capacity = (
            "KV capacity and memory: HBM preset less the weights, × "
            f"costs.gpu_memory_utilization {s.gpu_memory_utilization:g}"
        )
        return [transfer, "KV loads from host RAM and disk: preset bandwidths", capacity]


def build_cost_model(hypothesis: Hypothesis, base_dir: Path | None = None) -> RooflineCostModel:
    """The cost model of a (variant-resolved) hypothesis: its model, topology and costs.
    A profile path is relative to `base_dir` (the hypothesis file's folder)."""
    instances = build_instances(
        resolve_model(hypothesis.model),
        hypothesis.cluster,
        gpu_memory_utilization=hypothesis.costs.gpu_memory_utilization,
    )
    chosen = hypothesis.costs.model
    if chosen == "roofline":
        return RooflineCostModel(instances, hypothesis.costs)
    from btb_lab.model.profile import ProfileCostModel, load_profile

    path = Path(chosen.profile)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    profile, sha = load_profile(path)
    return ProfileCostModel(instances, hypothesis.costs, profile, path=chosen.profile, sha256=sha)
