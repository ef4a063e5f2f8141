"""The strict pydantic base every configuration model derives from."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

__all__ = ["ParamsModel", "StrictModel", "numbers_only"]


class StrictModel(BaseModel):
    """Unknown keys are errors, so a misspelled YAML key never becomes a silent default;
    `.inf` and `.nan` are refused in every float field, so a value that validates can
    never turn every run into a failure or a verdict into noise."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        """`seed: true` is a slip, not seed 1: pydantic's lax mode reads a boolean as an
        integer, which the trace loader already refuses for its numbers."""
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and numbers_only(field.annotation):
                raise ValueError("Input should be a number, not true or false")
        return value


class ParamsModel(StrictModel):
    """The parameters of one policy or workload generator: its validator is built when first
    used, not at import, since there are many such models and one hypothesis uses a few
    (building them all cost `validate` some 2.5% of its time)."""

    model_config = ConfigDict(defer_build=True)


def numbers_only(annotation: Any) -> bool:
    """Whether a field takes numbers and no booleans (`int`, `float | None`, ...)."""
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = set(typing.get_args(annotation)) - {type(None)}
        return bool(args) and args <= {int, float}
    return False
