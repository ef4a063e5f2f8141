"""Fixtures shared by the real-vLLM tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.vllm_compare import calibrate_tiny_model


@pytest.fixture(scope="session")
def engine_profile() -> Path:
    """The tiny model's engine profile, fitted once per session. Every cluster fixture of
    the tier asks for it before launching, so the calibration instance runs alone."""
    return calibrate_tiny_model()
