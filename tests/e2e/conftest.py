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


_LOG_SIGNS = ("Traceback", " ERROR ", "Fatal", "Segmentation fault", "core dumped")
_LOG_LINES = 40


def _instance_log_tails(base: Path, since_s: float) -> str:
    """The last lines of every instance log under `base` written since `since_s` that
    reports an error: a vLLM engine that died says why only there, and CI keeps nothing
    but the test output."""
    parts = []
    for log in sorted(base.glob("**/instances/*.log")):
        if log.stat().st_mtime < since_s:
            continue
        lines = log.read_text(errors="replace").splitlines()
        first = next((i for i, line in enumerate(lines)
                      if any(sign in line for sign in _LOG_SIGNS)), None)  # fmt: skip
        if first is not None:
            tail = lines[max(first, len(lines) - _LOG_LINES) :]
            parts.append(f"== {log.relative_to(base)} (last {len(tail)} lines) ==\n"
                         + "\n".join(line[:400] for line in tail))  # fmt: skip
    return "\n".join(parts)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("vllm") is not None:
        base = item.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
        tails = _instance_log_tails(base, call.start - 1.0)
        if tails:
            report.sections.append(("vLLM instance logs with errors", tails))
