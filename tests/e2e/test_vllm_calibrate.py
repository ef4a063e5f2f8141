"""Real vLLM on CPUs (make test-vllm): `btb-lab calibrate` fits the tiny model's engine
profile on a real vLLM CPU server, and the fitted model predicts the profile points it was
not fitted on. (The profile is fitted once per session, in tests/e2e/conftest.py; the
sim-vs-real comparisons that use it are in the cluster tests.)"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

# Held-out points: every fourth point of each curve. A vLLM CPU decode step of the tiny
# model is 6-30 ms, so a scheduler hiccup of a few ms on this shared 2-core machine is a
# large fraction: one calibration here measured a batch-1 step at 15 ms between neighbours
# of 8 ms, and held out 10% (prefill) and 22% (decode) mean error. 35% leaves room for that
# noise and still fails a wrong shape (without the per-token term the longest prompts'
# prefill is missed by ~3x; without the per-sequence term batch 16's step by ~3x).
HOLDOUT_MAPE_MAX = 0.35


def test_profile_predicts_points_held_out_of_the_fit(engine_profile: Path) -> None:
    from btb_lab.model.profile import load_profile

    profile, _ = load_profile(engine_profile)
    for part in (profile.prefill, profile.decode):
        quality = part.quality
        assert quality is not None
        assert quality.holdout_points >= 2
        assert quality.holdout_mape is not None
        assert quality.holdout_mape <= HOLDOUT_MAPE_MAX, (type(part).__name__, quality)
    # a longer uncached prompt costs more, and a cached prefix less than computing it
    assert profile.prefill_s(1536) > profile.prefill_s(128)
    assert profile.prefill_s(256, cached_tokens=1024) < profile.prefill_s(1280)


def test_profile_says_what_it_was_measured_on(engine_profile: Path) -> None:
    from btb_lab.model.profile import load_profile

    profile, _ = load_profile(engine_profile)
    on = profile.measured_on
    assert on["engine"].startswith("vllm")
    assert on["model"]["num_hidden_layers"] == 2
    assert on["block_tokens"] == 64  # cpu-smoke's workload block size
    assert on["settings"]["device"] == "cpu"
    assert len(profile.points) >= 20
