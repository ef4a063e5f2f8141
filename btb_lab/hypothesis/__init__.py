"""Hypothesis files: the strict schema (`schema`) and the loader with line-numbered errors."""

from btb_lab.hypothesis.loader import (
    LoadedHypothesis,
    apply_overrides,
    load_hypothesis,
    resolve_variant,
)
from btb_lab.hypothesis.schema import Hypothesis

__all__ = [
    "Hypothesis",
    "LoadedHypothesis",
    "apply_overrides",
    "load_hypothesis",
    "resolve_variant",
]
