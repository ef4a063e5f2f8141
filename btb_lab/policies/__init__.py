"""Routing policies, one module per family, all registered in POLICIES."""

from btb_lab.policies.base import POLICIES, build_policy

__all__ = ["POLICIES", "build_policy"]
