"""Bad input found by probing the command line as a user would (2026-12-06): each was a
traceback, an exit code other than 2, or a silent wrong answer before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import SMALL, cli, write_small


def refused(result, *expected: str) -> None:
    assert result.code == 2, result.output
    assert not result.traceback, result.output
    for text in expected:
        assert text in result.output, result.output


# ------------------------------------------------------------- dates YAML cannot build


def test_a_value_that_reads_as_an_impossible_date_is_named_with_its_line(
    tmp_path: Path,
) -> None:
    # PyYAML builds 2026-02-30 with datetime, whose ValueError escaped as a traceback
    path = write_small(tmp_path, **{"claim: round robin is no worse than least load": (
        "claim: 2026-02-30\nnotes:\n  - 2001-12-14t21:59:43.10-25:00")})  # fmt: skip
    line = SMALL.splitlines().index("claim: round robin is no worse than least load") + 1
    result = cli("validate", path)
    refused(
        result,
        f"{path}:{line}: claim: '2026-02-30' reads as a date or time but is not one "
        "(day is out of range for month)",
        f"{path}:{line + 2}: notes.0: '2001-12-14t21:59:43.10-25:00' reads as a date",
    )


def test_an_impossible_date_in_a_set_is_blamed_on_the_set(tmp_path: Path) -> None:
    result = cli("run", write_small(tmp_path), "--dry-run", "--set", "claim=2026-13-45")
    refused(result, "--set claim=2026-13-45: '2026-13-45' reads as a date or time")


def test_a_real_date_still_reads_as_a_date(tmp_path: Path) -> None:
    # the check refuses only what datetime cannot build; a real date reaches the model,
    # which says the field wants text
    path = write_small(tmp_path, **{"claim: round robin is no worse than least load": (
        "claim: 2026-02-28")})  # fmt: skip
    refused(cli("validate", path), "claim: Input should be a valid string")


@pytest.mark.parametrize("where", ["generate", "list"])
def test_an_impossible_date_elsewhere_is_no_traceback(tmp_path: Path, where: str) -> None:
    if where == "generate":
        result = cli("trace", "generate", "poisson", "-o", tmp_path / "g.jsonl",
                     "-p", "requests=2026-13-45")  # fmt: skip
        refused(result, "2026-13-45")
    else:
        write_small(tmp_path, **{"seed: 3": "seed: 3\nnotes: 2026-02-30"})
        result = cli("list", "--hypotheses", tmp_path)
        assert result.code == 0, result.output
        assert "(unreadable YAML)" in result.output


# --------------------------------------------- a stored run that lost samples or events


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("run")
    out = folder / "out"
    result = cli("run", write_small(folder), "--out", out, "--no-progress")
    assert result.code == 0, result.output
    return out


@pytest.mark.parametrize(("name", "what"), [("utilization.parquet", "utilization samples"),
                                            ("events.parquet", "events")])  # fmt: skip
@pytest.mark.parametrize("damage", ["deleted", "corrupt"])
def test_a_report_refuses_a_run_that_lost_what_its_manifest_counts(
    small_run: Path, tmp_path: Path, name: str, what: str, damage: str
) -> None:
    # the GPU metrics were undefined (a verdict on gpu_std became INCONCLUSIVE) and the
    # warm copies unseen, silently, and report.md was overwritten
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    shutil.rmtree(run / "parts")
    report = (run / "report.md").read_bytes()
    if damage == "deleted":
        (run / name).unlink()
    else:
        (run / name).write_text("bad\n", encoding="utf-8")
    refused(cli("report", run), "the manifest counts", f"{what} but 0 can be read ({name}")
    assert (run / "report.md").read_bytes() == report


def test_a_run_with_its_parquet_files_reports_as_before(small_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    shutil.rmtree(run / "parts")
    manifest = json.loads((run / "manifest.json").read_text(encoding="utf-8"))
    assert all(r["samples"] > 0 and r["events"] > 0 for r in manifest["runs"])
    assert cli("report", run).code == 0
