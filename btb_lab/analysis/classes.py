"""Request classes (WARM / MEDIUM / HEAVY or user-defined) from ordered, parsed rules.

Rules are data (field, operator, value), never evaluated Python: the first rule whose
conditions all hold names the class; records no rule matches keep the workload's label.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from btb_lab.config.hypothesis import NUMERIC_FIELDS, ClassRule, Condition

__all__ = ["NUMERIC_FIELDS", "STRING_FIELDS", "assign_classes", "condition_mask"]

STRING_FIELDS = frozenset({"route", "source"})

_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
}


def _field_values(frame: pd.DataFrame, field: str) -> pd.Series:
    if field == "cached_fraction":
        inp = frame["input_tokens"].astype(float)
        cached = frame["cached_tokens"].astype(float)
        frac = np.where(inp > 0, cached / inp.where(inp > 0, 1.0), 0.0)
        return pd.Series(frac, index=frame.index)
    if field == "uncached_tokens":
        return frame["input_tokens"].astype(float) - frame["cached_tokens"].astype(float)
    if field in NUMERIC_FIELDS:
        return frame[field].astype(float)
    return frame[field].astype(str)


def condition_mask(frame: pd.DataFrame, cond: Condition) -> pd.Series:
    """Rows where one condition holds."""
    values = _field_values(frame, cond.field)
    target: Any = cond.value
    target = float(target) if cond.field in NUMERIC_FIELDS else str(target)
    return pd.Series(_OPS[cond.op](values, target), index=frame.index).astype(bool)


def assign_classes(frame: pd.DataFrame, rules: Sequence[ClassRule]) -> pd.Series:
    """The class of every row: first matching rule, else the existing `class` column."""
    existing = frame["class"] if "class" in frame.columns else pd.Series(None, index=frame.index)
    result = pd.Series(existing, index=frame.index, dtype=object)
    if not rules:
        return result
    unassigned = pd.Series(True, index=frame.index)
    for rule in rules:
        mask = unassigned.copy()
        for cond in rule.when:
            mask &= condition_mask(frame, cond)
        result[mask] = rule.name
        unassigned &= ~mask
    return result
