"""Routing policies, one module per family, all registered in POLICIES on import."""

from btb_lab.policies import (
    btb,
    btb_cache,
    btb_detect,
    cache_aware,
    lmetric,
    offload,
    session_affinity,
    simple,
)
from btb_lab.policies.base import POLICIES, build_policy

__all__ = [
    "POLICIES",
    "btb",
    "btb_cache",
    "btb_detect",
    "build_policy",
    "cache_aware",
    "lmetric",
    "offload",
    "session_affinity",
    "simple",
]
