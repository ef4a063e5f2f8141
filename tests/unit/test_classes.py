"""Class rules: first match wins, parsed conditions only, fallback to the workload label."""

from __future__ import annotations

import pandas as pd

from btb_lab.analysis.classes import assign_classes
from btb_lab.config.hypothesis import ClassRule, Condition


def test_first_matching_rule_names_the_class() -> None:
    frame = pd.DataFrame({
        "input_tokens": [1000, 40000, 40000, 500],
        "cached_tokens": [900, 0, 36000, 0],
        "turn": [2, 1, 3, 1],
        "route": ["COLO"] * 4,
        "source": ["trace"] * 4,
        "class": [None, None, None, "X"],
    })  # fmt: skip
    rules = [
        ClassRule(name="WARM", when=[Condition(field="cached_fraction", op=">=", value=0.5)]),
        ClassRule(name="HEAVY", when=[Condition(field="uncached_tokens", op=">", value=8000)]),
        ClassRule(name="MEDIUM", when=[Condition(field="input_tokens", op=">=", value=800)]),
    ]
    # row 3 (500 tokens, no rule) keeps the workload's label
    assert assign_classes(frame, rules).tolist() == ["WARM", "HEAVY", "WARM", "X"]


def test_string_fields_and_conjunction() -> None:
    frame = pd.DataFrame({
        "input_tokens": [10, 10, 10], "cached_tokens": [0, 0, 0], "turn": [1, 2, 2],
        "route": ["PS", "PS", "COLO"], "source": ["a", "a", "a"],
    })  # fmt: skip
    rules = [ClassRule(name="LATE_PS", when=[
        Condition(field="route", op="==", value="PS"), Condition(field="turn", op=">=", value=2),
    ]), ClassRule(name="REST")]  # fmt: skip
    assert assign_classes(frame, rules).tolist() == ["REST", "LATE_PS", "REST"]


def test_no_rules_keeps_existing_labels() -> None:
    frame = pd.DataFrame({"input_tokens": [1], "cached_tokens": [0], "class": ["HEAVY"]})
    assert assign_classes(frame, []).tolist() == ["HEAVY"]
