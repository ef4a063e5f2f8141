"""The hypothesis log: idempotent appends, hand-written text kept, parsing for `log show`."""

from __future__ import annotations

import json
from pathlib import Path

from btb_lab.report.log import append_entry, parse_log
from tests.unit.test_runner_fake import fake_effects, run_fake

__all__ = ["fake_effects"]

HAND = """# Hypothesis log

## H1: Mooncake kv_both has significant runtime overhead

**Claim**: Enabling kv_both mode degrades TPOT.

**Verdict**: **REJECTED**. kv_both has zero runtime overhead.

Notes I wrote by hand after the run.
"""


def test_append_is_idempotent_and_keeps_hand_text(tmp_path: Path, fake_effects) -> None:
    fake_effects["fast"] = 0.5
    run_dir = run_fake(tmp_path).run_dir
    log = tmp_path / "LOG.md"
    log.write_text(HAND)
    append_entry(run_dir, log)
    once = log.read_text()
    assert once.startswith(HAND)
    assert "## HT: Test hypothesis" in once
    assert "**Verdict**: **VALIDATED**." in once
    assert "Report: [run/report.md](run/report.md)" in once
    append_entry(run_dir, log)
    assert log.read_text() == once
    # text added after the entry by hand survives a re-append of the same run
    log.write_text(once + "\nMore hand notes.\n")
    append_entry(run_dir, log)
    assert log.read_text() == once + "\nMore hand notes.\n"
    assert log.read_text().count("btb-lab:entry HT") == 1


def test_second_run_adds_an_entry_and_show_parses_all(tmp_path: Path, fake_effects) -> None:
    first = run_fake(tmp_path, out="a").run_dir
    second = run_fake(tmp_path, out="b", seed=5).run_dir
    log = tmp_path / "LOG.md"
    append_entry(first, log)
    append_entry(second, log)
    entries = parse_log(log.read_text())
    assert [e.hypothesis for e in entries] == ["HT", "HT"]
    assert all(e.run for e in entries)
    assert entries[0].run != entries[1].run
    hand = parse_log(HAND)
    assert (hand[0].hypothesis, hand[0].verdict, hand[0].run) == ("H1", "REJECTED", None)


def test_seed_verdict_line(tmp_path: Path, fake_effects) -> None:
    from btb_lab.runner import RunOptions, run_hypothesis
    from tests.unit.test_runner_fake import HYPOTHESIS

    path = tmp_path / "sv.yaml"
    path.write_text(HYPOTHESIS + "seed_verdict:\n  verdict: REJECTED\n  source: seed log H7\n"
                    "  summary: all within noise\n")  # fmt: skip
    outcome = run_hypothesis(path, RunOptions(backend="fake", out=tmp_path / "r", progress=False))
    log = tmp_path / "LOG.md"
    append_entry(outcome.run_dir, log)
    assert "**Seed verdict**: **REJECTED** (seed log H7): all within noise" in log.read_text()


def test_replace_puts_a_new_run_in_place_of_the_old_entry(tmp_path: Path, fake_effects) -> None:
    """`log append --replace`: one hypothesis re-run, its entry stays where it was; the
    other entries and hand-written text are untouched."""
    import re

    from tests.unit.test_runner_fake import FAKE, HYPOTHESIS, write_hypothesis

    first = run_fake(tmp_path, out="a").run_dir
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other = write_hypothesis(other_dir, HYPOTHESIS.replace("id: HT", "id: HO"))
    from btb_lab.runner import RunOptions, run_hypothesis

    second_id = run_hypothesis(
        other, RunOptions(backend=FAKE, out=tmp_path / "o", progress=False)
    ).run_dir
    log = tmp_path / "LOG.md"
    log.write_text(HAND)
    append_entry(first, log)
    append_entry(second_id, log)
    before = log.read_text()
    rerun = run_fake(tmp_path, out="b", seed=5).run_dir
    append_entry(rerun, log, replace=True)
    after = log.read_text()
    assert [e.hypothesis for e in parse_log(after)] == ["H1", "HT", "HO"]
    runs = re.findall(r"btb-lab:entry HT run=(\S+) -->", after)
    assert len(runs) == 1
    assert runs[0] != re.findall(r"btb-lab:entry HT run=(\S+) -->", before)[0]
    # the HO entry and the hand text are byte for byte as they were
    ho = before[before.index("<!-- btb-lab:entry HO") :]
    assert after.endswith(ho)
    assert after.startswith(HAND)
    # without --replace the same new run is appended as a second entry
    log.write_text(before)
    append_entry(rerun, log)
    assert [e.hypothesis for e in parse_log(log.read_text())] == ["H1", "HT", "HO", "HT"]


def test_replace_with_a_run_already_in_the_log_keeps_one_entry_where_the_first_was(
    tmp_path: Path, fake_effects
) -> None:
    """Runs A, B, C of one hypothesis appended, then `--replace` with B: B's entry alone
    remains, where A's was (before, B's own entry was updated and A and C stayed)."""
    import re

    runs = [run_fake(tmp_path, out=name, seed=seed).run_dir for name, seed in
            (("a", 1), ("b", 2), ("c", 3))]  # fmt: skip
    log = tmp_path / "LOG.md"
    log.write_text(HAND)
    for run in runs:
        append_entry(run, log)
    append_entry(runs[1], log, replace=True)
    after = log.read_text()
    assert [e.hypothesis for e in parse_log(after)] == ["H1", "HT"]
    b_id = json.loads((runs[1] / "manifest.json").read_text())["run_id"]
    assert re.findall(r"btb-lab:entry HT run=(\S+) -->", after) == [b_id]
    assert after.startswith(HAND)


def test_log_show_names_a_folder_given_as_the_log(tmp_path: Path) -> None:
    from tests.helpers import cli

    result = cli("log", "show", "--log", tmp_path)
    assert result.code == 2, result.output
    assert f"{tmp_path}: a folder, not a log file" in result.err
    assert "no such log file" in cli("log", "show", "--log", tmp_path / "LOG.md").err


def test_show_keeps_a_tool_entry_whose_heading_was_edited_and_says_incomplete() -> None:
    """`log show` dropped a tool entry whose `## ID: title` heading was reworded by hand
    (its verdict then had no row), and listed an incomplete run's verdict like a full one."""
    text = (
        "# Log\n\n"
        "<!-- btb-lab:entry HX run=R1 -->\n"
        "## HX — reworded by hand\n\n"
        "**Verdict**: **VALIDATED**. TTFT90 −19.0%.\n"
        "<!-- btb-lab:end HX run=R1 -->\n\n"
        "<!-- btb-lab:entry HY run=R2 -->\n"
        "## HY: stopped early\n\n"
        "**Verdict**: **REJECTED**. TTFT90 +3.0%. (incomplete run)\n"
        "<!-- btb-lab:end HY run=R2 -->\n"
    )
    entries = parse_log(text)
    assert [(e.hypothesis, e.verdict, e.run) for e in entries] == [
        ("HX", "VALIDATED", "R1"),
        ("HY", "REJECTED (incomplete run)", "R2"),
    ]
    assert entries[0].title == "(heading edited)"
