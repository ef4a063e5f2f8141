"""Hypothesis files: the loader with line-numbered errors (`loader`). The schema itself is
`btb_lab.config.hypothesis`; variants resolve with `btb_lab.config.resolve_variant`."""

from btb_lab.hypothesis.loader import LoadedHypothesis, apply_overrides, load_hypothesis

__all__ = ["LoadedHypothesis", "apply_overrides", "load_hypothesis"]
