"""The strict pydantic base every configuration model derives from."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["StrictModel"]


class StrictModel(BaseModel):
    """Unknown keys are errors, so a misspelled YAML key never becomes a silent default;
    `.inf` and `.nan` are refused in every float field, so a value that validates can
    never turn every run into a failure or a verdict into noise."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False
    )
