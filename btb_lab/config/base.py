"""The strict pydantic base every configuration model derives from."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["ParamsModel", "StrictModel"]


class StrictModel(BaseModel):
    """Unknown keys are errors, so a misspelled YAML key never becomes a silent default;
    `.inf` and `.nan` are refused in every float field, so a value that validates can
    never turn every run into a failure or a verdict into noise."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False
    )


class ParamsModel(StrictModel):
    """The parameters of one policy or workload generator: its validator is built when first
    used, not at import, since there are many such models and one hypothesis uses a few
    (building them all cost `validate` some 2.5% of its time)."""

    model_config = ConfigDict(defer_build=True)
