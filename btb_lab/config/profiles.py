"""Named fidelity profiles (`sim.profile`): one name for a whole set of simulator, cost and
routing assumptions, so a researcher can ask for another simulator's rules in one line.

A profile only supplies defaults: a setting written in the hypothesis (or a variant's
overrides, or `--set`) wins over it, and the resolved values are what the manifest and the
report's fidelity line record, beside the profile's name.

`infer-sim` is the BTB seed simulator's rule set (SEED-SIMULATOR.md), each rule a setting
of its own so an ablation can switch them one at a time. Several are not causal (KV
visible before its prefill ran, the same memory counted twice); btb-lab's defaults stay
causal and `causal` (the default profile) changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = ["PROFILES", "apply_profile"]

# profile -> block -> settings; `router` maps a policy name to default params for it
PROFILES: dict[str, dict[str, Any]] = {
    "causal": {},
    "infer-sim": {
        "sim": {
            "window_replay": "fresh",
            "kv_visibility": "at_admission",
            "admission": "all_that_fit",
            "kv_prefix_sharing": False,
            "prefix_cache_budget": "whole",
            "output_blocks_cached": True,
            "decode_steps": "output_tokens",
            "prompt_cache_hit": "whole_prompt",
            "router_view": "resident",
            "router_match_tiers": "hbm_ram",
            "warm_copy_blocks_target": True,
            "rdma_egress_shared": False,
            "host_ram_tier": True,
            "host_ram_bytes": None,
            "disk_tier": False,
            "max_batch": 256,
        },
        "costs": {
            "gpu_memory_utilization": 1.0,
            "transfer_setup_ms": 0.0,
            "mfu": 0.5,
            "mbu": 0.8,
        },
        "router": {
            "cache_aware": {"tie_break": "random"},
            "least_load": {},
            "btb": {"tie_break": "random", "recopy": True, "route_active": "holders"},
        },
    },
}
_POLICY_ALIASES = {"early_rdma": "btb"}


def apply_profile(data: MutableMapping[str, Any]) -> list[str]:
    """Lay `sim.profile`'s settings under a raw hypothesis mapping's own (in place);
    returns the dotted names the profile set. Unknown profiles are left for the schema to
    reject with the list of names."""
    sim = data.get("sim")
    if not isinstance(sim, Mapping):
        return []
    name = sim.get("profile", "causal")
    profile = PROFILES.get(name) if isinstance(name, str) else None
    if not profile:
        return []
    applied: list[str] = []
    for block in ("sim", "costs"):
        defaults = profile.get(block, {})
        current = data.get(block)
        if current is None:
            current = {}
        if not isinstance(current, Mapping):
            continue  # the schema reports the bad block itself
        merged = dict(current)
        for key, value in defaults.items():
            if key not in merged:
                merged[key] = value
                applied.append(f"{block}.{key}")
        data[block] = merged
    variants = data.get("variants")
    routers: dict[str, dict[str, Any]] = profile.get("router", {})
    if isinstance(variants, Mapping):
        out = {}
        for vname, variant in variants.items():
            router = variant.get("router") if isinstance(variant, Mapping) else None
            policy = router.get("policy") if isinstance(router, Mapping) else None
            params = router.get("params") if isinstance(router, Mapping) else None
            defaults = routers.get(_POLICY_ALIASES.get(policy, policy), {}) if isinstance(
                policy, str
            ) else {}  # fmt: skip
            if (
                isinstance(router, Mapping)
                and defaults
                and (params is None or isinstance(params, Mapping))
            ):
                merged = dict(params or {})
                for key, value in defaults.items():
                    if key not in merged:
                        merged[key] = value
                        applied.append(f"variants.{vname}.router.params.{key}")
                variant = {**variant, "router": {**router, "params": merged}}
            out[vname] = variant
        data["variants"] = out
    return applied
