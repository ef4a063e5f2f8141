"""What a run leaves out of its input is said: malformed rows skipped under
`skip_bad_rows`, and a workload shorter than `workload.requests` asked, on the terminal
(stderr), in the manifest and in the report, and in `--dry-run`'s plan; and why requests
failed, in the summary and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from tests.helpers import cli, write_small

TRACE = "  trace: {path: t.jsonl, format: mooncake, skip_bad_rows: true}\n  block_tokens: 512"
GENERATOR = "  generator:\n    kind: poisson\n    params: {requests: 60, rate_per_s: 4.0}"


def _write(folder: Path) -> Path:
    rows = [
        json.dumps({"timestamp": 10 * i, "input_length": 600, "output_length": 10,
                    "hash_ids": [i, i + 1000]})
        for i in range(1, 26)
    ]  # fmt: skip
    rows[3:3] = ["garbage", json.dumps({"timestamp": 35, "input_length": 600,
                                        "output_length": 10, "hash_ids": "x"})]  # fmt: skip
    (folder / "t.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return write_small(folder, "h.yaml", **{GENERATOR: TRACE})


def test_skipped_rows_and_a_short_workload_are_said_everywhere(tmp_path: Path) -> None:
    hyp = _write(tmp_path)
    result = cli("run", hyp, "--out", tmp_path / "run", "--requests", "40", "--no-progress")
    assert result.code == 0, result.output
    skipped = "t.jsonl: 2 malformed rows skipped (skip_bad_rows), first: "
    short = "workload.requests is 40 but the workload has 25: all 25 replayed"
    assert f"note: {skipped}" in result.err
    assert f"{tmp_path / 't.jsonl'}:4:" in result.err  # the first one, where it is
    assert "(and 1 more)" in result.err
    assert f"note: {short}" in result.err
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text(encoding="utf-8"))
    assert len(manifest["notes"]) == 2
    assert manifest["notes"][0].startswith(skipped)
    assert manifest["notes"][1] == short
    report = (tmp_path / "run" / "report.md").read_text(encoding="utf-8")
    assert f"- Note: {short}" in report
    assert f"- Note: {skipped}" in report


def test_dry_run_counts_the_requests_it_would_replay(tmp_path: Path) -> None:
    hyp = _write(tmp_path)
    result = cli("run", hyp, "--dry-run", "--requests", "1000")
    assert result.code == 0, result.output
    assert "workload: 25 requests per run" in result.out
    assert "note: workload.requests is 1,000 but the workload has 25" in result.out


def test_a_clean_run_has_no_notes(tmp_path: Path) -> None:
    hyp = _write(tmp_path)
    (tmp_path / "t.jsonl").write_text(
        "".join(line + "\n" for line in (tmp_path / "t.jsonl").read_text().splitlines()
                if line.startswith("{") and '"x"' not in line),
        encoding="utf-8",
    )  # fmt: skip
    result = cli("run", hyp, "--out", tmp_path / "run", "--no-progress")
    assert result.code == 0, result.output
    assert "note:" not in result.output
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["notes"] == []
    assert "Note:" not in (tmp_path / "run" / "report.md").read_text(encoding="utf-8")


def test_the_report_says_why_requests_failed(tmp_path: Path) -> None:
    """Prompts larger than any instance's KV memory fail; the Result block names the
    cause once, with the range of the sizes, not once per prompt size."""
    hyp = _write(tmp_path)
    sizes = [1_000_000] * 5 + [2_000_000] * 3 + [3_000_000] * 2 + [4_000_000] + [600] * 9
    (tmp_path / "t.jsonl").write_text(
        "".join(json.dumps({"timestamp": 10 * i, "input_length": n, "output_length": 10,
                            "hash_ids": [i]}) + "\n" for i, n in enumerate(sizes, 1)),
        encoding="utf-8",
    )  # fmt: skip
    result = cli("run", hyp, "--out", tmp_path / "run", "--no-progress",
                 "--set", "cluster.instances.0.count=1", "--variants", "base")  # fmt: skip
    assert result.code == 0, result.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text(encoding="utf-8"))
    failures = summary["variants"]["base"]["failures"]
    ((error, n),) = failures.items()
    assert n == 11
    assert error.startswith("needs 1000010–4000010 KV tokens; C0 holds ")
    report = (tmp_path / "run" / "report.md").read_text(encoding="utf-8")
    (line,) = [x for x in report.splitlines() if x.startswith("Failed: ")]
    assert line == f'Failed: 11 × "{error}"'
    assert "other errors" not in line
    (cache,) = [x for x in report.splitlines() if x.startswith("Cache hit: ")]
    assert cache.endswith("(the 11 failed requests' prompts count as uncached)")
    assert "OK=9/20" in report


def test_the_report_gives_each_variants_verdict(tmp_path: Path) -> None:
    """With several variants the headline verdict is one of them; every variant's own
    verdict (a failed guard of another included) is listed under it, and with one variant
    nothing is repeated."""
    extra = (
        "  fast:\n    router: {policy: round_robin}\n  aware:\n    router: {policy: cache_aware}\n"
    )
    hyp = write_small(tmp_path, **{"  fast:\n    router: {policy: round_robin}\n": extra})
    result = cli("run", hyp, "--out", tmp_path / "run", "--no-progress")
    assert result.code == 0, result.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text(encoding="utf-8"))
    report = (tmp_path / "run" / "report.md").read_text(encoding="utf-8")
    assert "Each variant against the baseline:" in report
    for name in ("fast", "aware"):
        v = summary["verdict"]["variants"][name]
        assert f"- `{name}`: **{v['word']}**. {v['reason']}." in report
    single = write_small(tmp_path, name="one.yaml")
    result = cli("run", single, "--out", tmp_path / "one", "--no-progress")
    assert result.code == 0, result.output
    assert "Each variant" not in (tmp_path / "one" / "report.md").read_text(encoding="utf-8")


def test_the_stored_records_carry_the_classes_the_report_shows(tmp_path: Path) -> None:
    # the `class` column held only the workload's own label: empty for most traces, and
    # a reader grouping requests.parquet by class got one empty group
    result = cli("run", write_small(tmp_path), "--out", tmp_path / "run", "--no-progress")
    assert result.code == 0, result.output
    frame = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    expected = frame["input_tokens"].map(lambda n: "LONG" if n >= 4000 else "SHORT")
    assert frame["class"].tolist() == expected.tolist()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text(encoding="utf-8"))
    for variant, rows in frame.groupby("variant"):
        counts = rows["class"].value_counts().to_dict()
        shown = summary["variants"][variant]["classes"]
        assert counts == {name: shown[name]["n"] for name in counts}


def test_the_report_says_which_options_changed_the_files_settings(tmp_path: Path) -> None:
    # the decision rule showed the overridden metric with nothing saying the file had
    # another; a log entry of such a run read as the file's
    result = cli("run", write_small(tmp_path), "--out", tmp_path / "run", "--no-progress",
                 "--set", "verdict.metric=ttft_p50", "--requests", "40")  # fmt: skip
    assert result.code == 0, result.output
    report = (tmp_path / "run" / "report.md").read_text(encoding="utf-8")
    assert (
        "- Run with options that change the file's settings: --set verdict.metric=ttft_p50; "
        "--requests 40\n" in report
    )
    plain = cli("run", write_small(tmp_path), "--out", tmp_path / "plain", "--no-progress")
    assert plain.code == 0, plain.output
    assert "options that change" not in (tmp_path / "plain" / "report.md").read_text()
