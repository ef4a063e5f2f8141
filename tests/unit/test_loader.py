"""Hypothesis loading: line-numbered problems, choices, semantic checks, overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from btb_lab.config import resolve_variant
from btb_lab.errors import ValidationFailed
from btb_lab.hypothesis import apply_overrides, load_hypothesis
from tests.unit.test_runner_fake import HYPOTHESIS


def load_text(tmp_path: Path, text: str, overrides=None):
    path = tmp_path / "h.yaml"
    path.write_text(text)
    return load_hypothesis(path, overrides)


def problems(tmp_path: Path, text: str, overrides=None) -> list[str]:
    with pytest.raises(ValidationFailed) as info:
        load_text(tmp_path, text, overrides)
    return info.value.problems


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_valid_file_loads(tmp_path: Path) -> None:
    loaded = load_text(tmp_path, HYPOTHESIS)
    assert loaded.hypothesis.id == "HT"
    assert loaded.base_dir == tmp_path.resolve()
    assert loaded.raw_text == HYPOTHESIS


def test_misspelled_key_names_file_line_and_path(tmp_path: Path) -> None:
    text = HYPOTHESIS.replace(
        "    router: {policy: round_robin}", "    routr: {policy: round_robin}"
    )
    found = problems(tmp_path, text)
    path = tmp_path / "h.yaml"
    expected = f"{path}:{line_of(text, 'routr')}: variants.fast.routr: unknown key 'routr'"
    assert any(p.startswith(expected) for p in found), found
    # the missing `router` is reported at the variant's own line
    assert any(
        f":{line_of(text, '  fast:')}: variants.fast.router: required field" in p for p in found
    )


def test_wrong_type_is_reported_with_line(tmp_path: Path) -> None:
    text = HYPOTHESIS.replace("repeats: 1", "repeats: many")
    (problem,) = problems(tmp_path, text)
    assert problem.startswith(f"{tmp_path / 'h.yaml'}:{line_of(text, 'repeats: many')}: repeats: ")
    assert "integer" in problem


def test_enum_choices_are_listed(tmp_path: Path) -> None:
    text = HYPOTHESIS.replace("repeats: 1", "repeats: 1\nsim:\n  kv_visibility: sometimes")
    (problem,) = problems(tmp_path, text)
    assert f":{line_of(text, 'kv_visibility')}: sim.kv_visibility:" in problem
    assert "'after_prefill' or 'at_admission'" in problem


def test_unknown_policy_lists_choices(tmp_path: Path) -> None:
    text = HYPOTHESIS.replace("policy: round_robin", "policy: round_robbin")
    (problem,) = problems(tmp_path, text)
    assert (
        f":{line_of(text, 'round_robbin')}: variants.fast.router.policy: unknown policy" in problem
    )
    assert "round_robin" in problem
    assert "cache_aware" in problem


def test_policy_params_are_validated(tmp_path: Path) -> None:
    text = HYPOTHESIS.replace(
        "router: {policy: round_robin}",
        "router:\n      policy: btb\n      params:\n        burst_count: zero",
    )
    found = problems(tmp_path, text)
    assert any(
        f":{line_of(text, 'burst_count')}: variants.fast.router.params.burst_count:" in p
        for p in found
    ), found


def test_missing_trace_is_reported(tmp_path: Path) -> None:
    text = HYPOTHESIS.replace(
        "  generator:\n    kind: poisson\n    params: {requests: 120, rate_per_s: 4.0}",
        "  trace:\n    path: traces/missing.jsonl\n    format: mooncake",
    )
    (problem,) = problems(tmp_path, text)
    assert (
        f":{line_of(text, 'missing.jsonl')}: workload.trace.path: trace file not found" in problem
    )
    assert str(tmp_path / "traces" / "missing.jsonl") in problem


def test_unknown_model_gpu_metric_and_class(tmp_path: Path) -> None:
    text = (
        HYPOTHESIS.replace("model: llama-3.3-70b", "model: llama-9")
        .replace("gpu: H100", "gpu: H999")
        .replace("metric: ttft_p90", "metric: ttft_p91\n  class: HUGE")
    )
    found = "\n".join(problems(tmp_path, text))
    assert "model: unknown model preset 'llama-9'" in found
    assert "qwen3-8b" in found
    assert "cluster.instances.0.gpu: unknown GPU preset 'H999'" in found
    assert "H200" in found
    assert "verdict.metric: unknown metric 'ttft_p91'" in found
    assert "ttft_p90" in found
    assert "verdict.class: unknown class 'HUGE'; choose one of: LONG, SHORT" in found


def test_variant_sim_override_is_validated(tmp_path: Path) -> None:
    text = HYPOTHESIS.replace(
        "router: {policy: round_robin}", "router: {policy: round_robin}\n    sim: {mfu: 7}"
    )
    (problem,) = problems(tmp_path, text)
    # sim.mfu is an alias of costs.mfu: reported under its new name, at its own line
    assert "variants.fast.costs.mfu:" in problem
    assert "less than or equal to 1" in problem
    assert f":{line_of(text, 'mfu: 7')}:" in problem


def test_yaml_syntax_error_has_line(tmp_path: Path) -> None:
    text = HYPOTHESIS.replace("claim: fast is faster than base", "claim: [unclosed")
    (problem,) = problems(tmp_path, text)
    assert problem.startswith(f"{tmp_path / 'h.yaml'}:")
    assert "YAML syntax error" in problem


def test_overrides_apply_before_validation(tmp_path: Path) -> None:
    loaded = load_text(
        tmp_path,
        HYPOTHESIS,
        {"model": "qwen3-8b", "cluster.instances.0.gpus": 8, "sim.kv_visibility": "at_admission"},
    )
    hyp = loaded.hypothesis
    assert hyp.model == "qwen3-8b"
    assert hyp.cluster.instances[0].gpus == 8
    assert hyp.sim.kv_visibility == "at_admission"
    bad = problems(tmp_path, HYPOTHESIS, {"variants.fast.router.params.burst_count": 3})
    assert "variants.fast.router.params.burst_count" in bad[0]


def test_apply_overrides_indexes_lists_and_copies() -> None:
    data = {"a": [{"b": 1}, {"b": 2}]}
    out = apply_overrides(data, {"a.1.b": 5, "c.d": "x"})
    assert out == {"a": [{"b": 1}, {"b": 5}], "c": {"d": "x"}}
    assert data == {"a": [{"b": 1}, {"b": 2}]}


def test_overrides_reach_keys_with_dots_in_them(tmp_path: Path) -> None:
    """A variant named `of_1.5` (H7's) is addressed as written; the longest key that
    exists wins, and a new key is still made segment by segment."""
    data = {"variants": {"of_1.5": {"router": {"policy": "x"}}, "of_1": {"5": {}}}}
    out = apply_overrides(data, {"variants.of_1.5.router.policy": "y", "a.b.c": 1})
    assert out["variants"]["of_1.5"]["router"]["policy"] == "y"
    assert out["variants"]["of_1"] == {"5": {}}
    assert out["a"] == {"b": {"c": 1}}
    text = HYPOTHESIS.replace("  fast:", "  fast.2:").replace("baseline: fast", "baseline: base")
    loaded = load_text(tmp_path, text, {"variants.fast.2.router.policy": "least_load"})
    assert loaded.hypothesis.variants["fast.2"].router.policy == "least_load"
    # a bad value there is blamed on the override, not on a line of the file
    origins = {"variants.fast.2.router.params.nope": "--set variants.fast.2.router.params.nope=1"}
    path = tmp_path / "h.yaml"
    with pytest.raises(ValidationFailed) as info:
        load_hypothesis(path, {"variants.fast.2.router.params.nope": 1}, origins)
    assert info.value.problems[0].startswith("--set variants.fast.2.router.params.nope=1: ")


def test_resolve_variant_merges_sim_overrides(tmp_path: Path) -> None:
    text = HYPOTHESIS.replace(
        "router: {policy: round_robin}", "router: {policy: round_robin}\n    sim: {mfu: 0.3}"
    )
    hyp = load_text(tmp_path, text).hypothesis
    assert resolve_variant(hyp, "fast").costs.mfu == 0.3
    assert resolve_variant(hyp, "base").costs.mfu == hyp.costs.mfu == 0.5
    assert hyp.aliases == ["variants.fast.sim.mfu → variants.fast.costs.mfu"]


def test_class_rule_values_are_checked(tmp_path: Path) -> None:
    text = HYPOTHESIS.replace('{field: input_tokens, op: ">=", value: 4000}',
                              '{field: input_tokens, op: ">=", value: lots}')  # fmt: skip
    (problem,) = problems(tmp_path, text)
    assert (
        f":{line_of(text, 'value: lots')}: classes.0.when.0.value: input_tokens compares" in problem
    )
    text = HYPOTHESIS.replace('{field: input_tokens, op: ">=", value: 4000}',
                              '{field: route, op: ">", value: PS}')  # fmt: skip
    (problem,) = problems(tmp_path, text)
    assert "classes.0.when.0.op: route is text: use '==' or '!='" in problem
