"""What a run leaves behind when something goes wrong, on the simulator (issue 16):
a failed run never stands for its hypothesis (3), a truncated parquet falls back to the
JSONL parts (4), credentials given on the command line never reach a run directory or the
log (12)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from btb_lab.errors import UserError
from tests.helpers import cli, write_small

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "workload"
TRACE = "  generator:\n    kind: poisson\n    params: {requests: 60, rate_per_s: 4.0}"


@pytest.fixture
def lab(tmp_path: Path, monkeypatch) -> Path:
    """A folder with hypotheses/ and results/, as the CLI's defaults expect."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hypotheses").mkdir()
    return tmp_path


def good_run(lab: Path) -> Path:
    hyp = write_small(lab / "hypotheses")
    result = cli("run", hyp, "--no-progress")
    assert result.code == 0, result.output
    (run_dir,) = (lab / "results" / "HS").iterdir()
    return run_dir.resolve()


def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))


def reported_dir(result) -> Path:
    """The run directory `report ID` rendered (`DIR/report.md: WORD`)."""
    assert result.code == 0, result.output
    return Path(result.out.split(": ")[0]).parent.resolve()


# ------------------------------------------------------------- (3) a failed run shadows


def test_a_workload_that_fails_to_load_leaves_no_run_behind(lab: Path) -> None:
    good = good_run(lab)
    (lab / "hypotheses" / "bad.jsonl").write_bytes((FIXTURES / "mooncake_bad.jsonl").read_bytes())
    hyp = write_small(lab / "hypotheses", **{TRACE: "  trace: {path: bad.jsonl, format: mooncake}"})
    result = cli("run", hyp, "--no-progress")
    assert result.code == 2, result.output
    assert "bad.jsonl:3: field 'input_length': must be ≥ 0" in result.err
    assert sorted((lab / "results" / "HS").iterdir()) == [good]  # nothing new to shadow it
    assert reported_dir(cli("report", "HS")) == good
    logged = cli("log", "append", "HS")
    assert logged.code == 0, logged.output
    text = (lab / "hypotheses" / "LOG.md").read_text(encoding="utf-8")
    assert f"run={manifest(good)['run_id']}" in text
    # the good run's own verdict, never the failed run's "run incomplete" / "run failed"
    word = json.loads((good / "summary.json").read_text(encoding="utf-8"))["verdict"]["word"]
    assert f"**Verdict**: **{word}**" in text
    assert "incomplete run" not in text
    assert "run incomplete" not in text
    assert "run failed" not in text


def test_a_failure_after_the_run_started_is_recorded_and_skipped(lab: Path, monkeypatch) -> None:
    good = good_run(lab)
    import btb_lab.runner as runner

    real = runner._load_requests
    calls: list[int] = []

    def second_repeat_fails(loaded, seed, *cache):
        calls.append(seed)
        if len(calls) > 1:
            raise UserError("trace.jsonl:7: field 'timestamp': must be a finite number ≥ 0")
        return real(loaded, seed, *cache)

    monkeypatch.setattr(runner, "_load_requests", second_repeat_fails)
    result = cli("run", lab / "hypotheses" / "hs.yaml", "--no-progress", "--set", "repeats=2",
                 "--out", lab / "results" / "HS" / "zz-failed")  # fmt: skip
    assert result.code == 2, result.output
    assert "trace.jsonl:7: field 'timestamp'" in result.err
    failed = lab / "results" / "HS" / "zz-failed"
    stored = manifest(failed)
    assert stored["complete"] is False
    assert stored["error"] == "trace.jsonl:7: field 'timestamp': must be a finite number ≥ 0"
    assert [r["status"] for r in stored["runs"]] == ["ok", "ok"]  # repeat 0 kept
    assert "RUN FAILED" in (failed / "report.md").read_text(encoding="utf-8")
    again = cli("report", failed)
    assert again.code == 0, again.output
    assert "INCONCLUSIVE" in again.out
    summary = json.loads((failed / "summary.json").read_text(encoding="utf-8"))
    assert summary["verdict"]["reason"].startswith("run failed: trace.jsonl:7")
    assert reported_dir(cli("report", "HS")) == good


def test_smoke_runs_do_not_stand_for_their_hypothesis(lab: Path) -> None:
    good = good_run(lab)
    hyp = lab / "hypotheses" / "hs.yaml"
    for flags in (["--requests", "10"], ["--set", "seed=9"], ["--variants", "fast"]):
        result = cli("run", hyp, "--no-progress", *flags)
        assert result.code == 0, result.output
    assert len(list((lab / "results" / "HS").iterdir())) == 4
    assert reported_dir(cli("report", "HS")) == good
    listed = cli("list")
    assert listed.code == 0, listed.output
    row = next(line for line in listed.out.splitlines() if "HS" in line)
    assert good.name in row


def test_an_id_with_only_partial_runs_says_why(lab: Path) -> None:
    hyp = write_small(lab / "hypotheses")
    assert cli("run", hyp, "--no-progress", "--requests", "10").code == 0
    result = cli("report", "HS")
    assert result.code == 2, result.output
    assert "HS: no full run under results/" in result.err
    assert "--requests 10" in result.err


# -------------------------------------------------------- (4) a truncated requests.parquet


def test_a_truncated_parquet_falls_back_to_the_parts(lab: Path) -> None:
    run_dir = good_run(lab)
    summary = (run_dir / "summary.json").read_bytes()
    report = (run_dir / "report.md").read_bytes()
    parquet = run_dir / "requests.parquet"
    parquet.write_bytes(parquet.read_bytes()[: parquet.stat().st_size // 2])
    result = cli("report", run_dir)
    assert result.code == 0, result.output
    assert (run_dir / "summary.json").read_bytes() == summary
    assert (run_dir / "report.md").read_bytes() == report
    logged = cli("log", "append", run_dir, "--log", lab / "LOG.md")
    assert logged.code == 0, logged.output


@pytest.mark.parametrize("lost", ["everything", "one part"])
def test_records_lost_since_the_run_keep_the_report_as_it_was(lab: Path, lost: str) -> None:
    """With the parquet gone and the parts deleted or one of them emptied, a re-render
    would judge what is left (OK 0/0, INCONCLUSIVE): it is refused and nothing changes."""
    run_dir = good_run(lab)
    before = {name: (run_dir / name).read_bytes() for name in ("summary.json", "report.md")}
    (run_dir / "requests.parquet").unlink()
    parts = sorted((run_dir / "parts").glob("requests-*"))
    if lost == "everything":
        for part in parts:
            part.unlink()
    else:
        parts[0].write_bytes(b"")
    result = cli("report", run_dir)
    assert result.code == 2, result.output
    assert not result.traceback
    assert "request records but" in result.err
    assert "left as they were" in result.err
    assert {name: (run_dir / name).read_bytes() for name in before} == before


# ----------------------------------------------------------------- (12) credentials


def test_credentials_given_on_the_command_line_are_not_stored(lab: Path) -> None:
    hyp = write_small(lab / "hypotheses")
    secrets = ("hf_SECRET_123", "sk-SECRET-456", "pw-SECRET-789")
    result = cli(
        "run", hyp, "--no-progress", "--out", lab / "run",
        "--set", f"cluster.launch.env.C.HF_TOKEN={secrets[0]}",
        "--set", f"cluster.launch.extra_args.C=[--api-key, {secrets[1]}]",
        f"--set=cluster.launch.env.PS.DB_PASSWORD={secrets[2]}",
    )  # fmt: skip
    assert result.code == 0, result.output
    assert cli("log", "append", lab / "run", "--log", lab / "LOG.md").code == 0
    stored = [p for p in (lab / "run").rglob("*") if p.is_file()] + [lab / "LOG.md"]
    for path in stored:
        data = path.read_bytes()
        for secret in secrets:
            assert secret.encode() not in data, f"{secret} in {path}"
    argv = manifest(lab / "run")["cli"]["argv"]
    assert "cluster.launch.env.C.HF_TOKEN=***" in argv
    hypothesis = manifest(lab / "run")["hypothesis"]
    assert hypothesis["cluster"]["launch"]["env"]["C"]["HF_TOKEN"] == "***"
    assert hypothesis["workload"]["block_tokens"] == 512  # token counts are not secrets


# ------------------------------------------------------------------ concurrent appends


def test_two_log_appends_at_once_keep_both_entries(lab: Path, monkeypatch) -> None:
    import threading
    import time

    import btb_lab.report.log as log_module

    first = good_run(lab)
    hyp = write_small(lab / "hypotheses", "h2.yaml", **{"id: HS": "id: HS2"})
    assert cli("run", hyp, "--no-progress").code == 0
    (second,) = (lab / "results" / "HS2").iterdir()
    slow_write = log_module.write_atomic

    def write_slowly(path: Path, text: str) -> None:  # widen the read-modify-write window
        time.sleep(0.3)
        slow_write(path, text)

    monkeypatch.setattr(log_module, "write_atomic", write_slowly)
    log = lab / "LOG.md"
    threads = [
        threading.Thread(target=log_module.append_entry, args=(run, log)) for run in (first, second)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(hid for hid, _ in re_entries(log)) == ["HS", "HS2"]


def re_entries(log: Path) -> list[tuple[str, str]]:
    import re

    return re.findall(r"^<!-- btb-lab:entry (\S+) run=(\S+) -->$", log.read_text(), re.M)
