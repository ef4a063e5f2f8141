"""Profile fitting recovers known coefficients; profiles load, validate and price work."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from btb_lab.calibrate.fit import (
    DecodePoint,
    PrefillPoint,
    fit_decode,
    fit_prefill,
    nnls_small,
    split_holdout,
)
from btb_lab.errors import ValidationFailed
from btb_lab.hypothesis import load_hypothesis
from btb_lab.model.costmodel import build_cost_model
from btb_lab.model.profile import DecodeFit, EngineProfile, PrefillFit, ProfileCostModel
from tests.unit.test_runner_fake import HYPOTHESIS

TRUE_PREFILL = {"fixed_s": 0.02, "per_token_s": 4e-4, "per_token_context_s": 3e-8,
                "per_cached_token_s": 1e-5}  # fmt: skip
TRUE_DECODE = {"fixed_s": 0.003, "per_seq_s": 8e-4, "per_context_token_s": 5e-7}


def test_nnls_keeps_coefficients_non_negative() -> None:
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    b = np.array([1.0, -1.0, 0.0])  # least squares would make x1 negative
    x = nnls_small(a, b)
    assert (x >= 0).all()
    assert x[1] == 0.0
    assert x[0] == pytest.approx(0.5)


def test_holdout_split_is_deterministic_and_disjoint() -> None:
    fit, hold = split_holdout(12, every=4)
    assert hold == [1, 5, 9]
    assert sorted(fit + hold) == list(range(12))
    assert split_holdout(5, every=4) == ([0, 1, 2, 3, 4], [])  # too few points to hold out


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_fits_recover_known_costs(noise: float) -> None:
    rng = np.random.default_rng(1)
    truth = EngineProfile(name="t", prefill=PrefillFit(**TRUE_PREFILL),
                          decode=DecodeFit(**TRUE_DECODE))  # fmt: skip
    prefill = [
        PrefillPoint(n, c, truth.prefill_s(n, c) * (1 + noise * rng.standard_normal()))
        for n in (32, 64, 128, 256, 512, 1024, 1536, 1900) for c in (0, 512)
    ]  # fmt: skip
    decode = [
        DecodePoint(b, b * n, truth.decode_step_s(b, b * n) * (1 + noise * rng.standard_normal()))
        for b in (1, 2, 4, 8, 16) for n in (100, 600, 1500)
    ]  # fmt: skip
    p = fit_prefill(prefill)
    d = fit_decode(decode)
    tol = 1e-6 if noise == 0 else 0.25
    for key, value in TRUE_PREFILL.items():
        if key != "per_cached_token_s" or noise == 0:  # a small term: noise can hide it
            assert getattr(p, key) == pytest.approx(value, rel=tol), key
    for key, value in TRUE_DECODE.items():
        assert getattr(d, key) == pytest.approx(value, rel=tol), key
    assert p.quality is not None
    assert d.quality is not None
    assert p.quality.holdout_points == 4
    assert d.quality.holdout_points == 4
    # held-out points are predicted about as well as the noise allows
    assert p.quality.holdout_mape is not None
    assert p.quality.holdout_mape <= 3 * noise + 1e-6
    assert d.quality.holdout_mape is not None
    assert d.quality.holdout_mape <= 3 * noise + 1e-6


def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    EngineProfile(name="tiny", prefill=PrefillFit(**TRUE_PREFILL),
                  decode=DecodeFit(**TRUE_DECODE)).save(path)  # fmt: skip
    return path


def test_a_hypothesis_uses_a_profile_and_records_it(tmp_path: Path) -> None:
    profile_file(tmp_path)
    text = HYPOTHESIS.replace("repeats: 1", "repeats: 1\ncosts:\n  model: {profile: tiny.yaml}")
    path = tmp_path / "h.yaml"
    path.write_text(text)
    hyp = load_hypothesis(path).hypothesis
    costs = build_cost_model(hyp, tmp_path)
    assert isinstance(costs, ProfileCostModel)
    assert costs.prefill_s(0, 1000) == pytest.approx(0.02 + 0.4 + 3e-8 * 1000 * 500)
    facts = costs.facts()
    assert facts["costs.model"] == "profile"
    assert facts["costs.profile.path"] == "tiny.yaml"
    assert len(facts["costs.profile.sha256"]) == 64
    assert costs.per_instance[0].prefill_fixed_s == 0.02
    assert costs.per_instance[0].decode_seq_s == 8e-4
    # the roofline keeps its KV budget: memory still follows the presets
    assert costs.instances[0].kv_budget_tokens > 0


def test_a_missing_or_bad_profile_is_a_line_numbered_error(tmp_path: Path) -> None:
    text = HYPOTHESIS.replace("repeats: 1", "repeats: 1\ncosts:\n  model: {profile: none.yaml}")
    path = tmp_path / "h.yaml"
    path.write_text(text)
    with pytest.raises(ValidationFailed) as info:
        load_hypothesis(path)
    (problem,) = info.value.problems
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "none.yaml" in t)
    assert problem.startswith(f"{path}:{line}: costs.model.profile: ")
    assert "no such profile file" in problem
    (tmp_path / "none.yaml").write_text("name: x\nprefill: {fixed_s: -1, per_token_s: 0}\n")
    with pytest.raises(ValidationFailed) as info:
        load_hypothesis(path)
    assert "prefill.fixed_s" in info.value.problems[0]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("name: x\nname: y\n", "duplicate key"),
        ("name: x\nprefill: !!python/object:os.system {}\n", "not allowed"),
        ("name: x\x07\n", "unacceptable character"),
        ("name: x\nprefill: {fixed_s: .nan, per_token_s: 0}\n", "prefill.fixed_s"),
    ],
)
def test_a_profile_is_read_with_the_hypothesis_loaders_checks(
    tmp_path: Path, body: str, expected: str
) -> None:
    text = HYPOTHESIS.replace("repeats: 1", "repeats: 1\ncosts:\n  model: {profile: p.yaml}")
    path = tmp_path / "h.yaml"
    path.write_text(text)
    (tmp_path / "p.yaml").write_text(body)
    with pytest.raises(ValidationFailed) as info:
        load_hypothesis(path)
    (problem,) = info.value.problems
    assert problem.startswith(f"{path}:")
    assert f"{tmp_path / 'p.yaml'}:" in problem
    assert expected in problem
