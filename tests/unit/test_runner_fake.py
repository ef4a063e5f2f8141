"""A fake backend for the spine's tests, plus runner tests that use it.

The fake routes round-robin and stamps times from a seeded generator, with a per-variant
TTFT multiplier set by the test, so verdicts on its output are known in advance."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from btb_lab.backends import BackendResult, RunContext
from btb_lab.records import Request, RequestRecord, UtilSample
from btb_lab.runner import BACKENDS, RunInterrupted, RunOptions, derive_seed, run_hypothesis

FAKE = "fake"
# variant name -> TTFT multiplier; missing variants run at 1.0
EFFECTS: dict[str, float] = {}
# raise KeyboardInterrupt after writing this many records of this variant
INTERRUPT: dict[str, int] = {}
# variants whose run crashes with this exception after writing a few records
CRASH: dict[str, Exception] = {}
# variants whose every request fails as against a server that is down (no tokens at all)
UNREACHABLE: set[str] = set()
SEEN: list[tuple[str, int, int, tuple[tuple[str, float], ...]]] = []
CLOSED: list[str] = []  # one entry per FakeBackend.close() call


class FakeBackend:
    name = FAKE

    def run_variant(self, ctx: RunContext, requests: list[Request]) -> BackendResult:
        rng = random.Random(ctx.seed)
        n_inst = sum(g.count for g in ctx.hypothesis.cluster.instances)
        SEEN.append(
            (
                ctx.variant_name,
                ctx.repeat,
                ctx.seed,
                tuple((r.request_id, r.arrival_s) for r in requests),
            )
        )
        factor = EFFECTS.get(ctx.variant_name, 1.0)
        stop = INTERRUPT.get(ctx.variant_name)
        batch: list[RequestRecord] = []
        for i, req in enumerate(requests):
            if stop is not None and i == stop:
                ctx.sink.write(batch)
                raise KeyboardInterrupt
            if ctx.variant_name in CRASH and i == 5:
                ctx.sink.write(batch)
                raise CRASH[ctx.variant_name]
            ttft = (0.2 + rng.expovariate(2.0)) * factor
            tpot = 0.02 + rng.random() * 0.01
            finish = req.arrival_s + ttft + tpot * max(req.output_tokens - 1, 0)
            down = ctx.variant_name in UNREACHABLE
            batch.append(RequestRecord(
                variant=ctx.variant_name, repeat=ctx.repeat, request_id=req.request_id,
                trace_id=req.trace_id, source=req.source, session_id=req.session_id,
                instance=f"C{i % n_inst}", route="COLO", arrival_s=req.arrival_s,
                sent_s=req.arrival_s, first_token_s=None if down else req.arrival_s + ttft,
                finish_s=None if down else finish, input_tokens=req.input_tokens,
                output_tokens=req.output_tokens,
                cached_tokens=req.input_tokens // 2 if i % 2 else 0, turn=req.turn,
                ok=not down, error="ConnectError" if down else None,
            ))  # fmt: skip
            if len(batch) >= 16:
                ctx.sink.write(batch)
                batch = []
            ctx.progress(i + 1, len(requests))
        ctx.sink.write(batch)
        util = [
            UtilSample(time_s=float(t), instance=f"C{k}", device="sim",
                       utilization=0.2 + 0.1 * k * factor)
            for t in range(5) for k in range(n_inst)
        ]  # fmt: skip
        return BackendResult(
            utilization=util, fidelity={"fake.noise": "exp", "fake.factor": factor}
        )

    def close(self) -> None:
        CLOSED.append(FAKE)


if FAKE not in BACKENDS:
    BACKENDS.add(FAKE, FakeBackend)

HYPOTHESIS = """\
id: HT
title: Test hypothesis
claim: fast is faster than base
prior_evidence: none
backend: sim
model: llama-3.3-70b
cluster:
  instances:
    - {role: C, count: 2, gpu: H100, gpus: 4}
workload:
  generator:
    kind: poisson
    params: {requests: 120, rate_per_s: 4.0}
classes:
  - name: LONG
    when:
      - {field: input_tokens, op: ">=", value: 4000}
  - name: SHORT
variants:
  base:
    router: {policy: least_load}
  fast:
    router: {policy: round_robin}
baseline: base
repeats: 1
seed: 3
verdict:
  metric: ttft_p90
  direction: decrease
  min_effect: 0.05
  guards:
    - {metric: ok_rate, max_worse: 0.01}
  bootstrap_samples: 200
  min_ok_requests: 20
"""


def write_hypothesis(folder: Path, text: str = HYPOTHESIS) -> Path:
    path = folder / "ht.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def fake_effects():
    EFFECTS.clear()
    INTERRUPT.clear()
    SEEN.clear()
    CLOSED.clear()
    CRASH.clear()
    UNREACHABLE.clear()
    yield EFFECTS
    CRASH.clear()
    UNREACHABLE.clear()
    EFFECTS.clear()
    INTERRUPT.clear()
    SEEN.clear()


def run_fake(folder: Path, out: str = "run", **kwargs) -> object:
    path = write_hypothesis(folder)
    options = RunOptions(backend=FAKE, out=folder / out, progress=False, **kwargs)
    return run_hypothesis(path, options)


def test_run_writes_results_and_validates_a_clear_win(tmp_path: Path, fake_effects) -> None:
    fake_effects["fast"] = 0.5
    outcome = run_fake(tmp_path)
    run_dir = outcome.run_dir
    assert CLOSED == [FAKE]  # the backend is closed once, after the last variant
    for name in ("manifest.json", "requests.parquet", "utilization.parquet", "summary.json",
                 "report.md", "plots/latency_cdf.png", "events.parquet"):  # fmt: skip
        assert (run_dir / name).is_file(), name
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["complete"] is True
    assert manifest["backend"] == FAKE
    assert manifest["fidelity"]["fast"]["fake.factor"] == 0.5
    assert {r["status"] for r in manifest["runs"]} == {"ok"}
    assert manifest["versions"]["btb-lab"]
    records = pd.read_parquet(run_dir / "requests.parquet")
    assert len(records) == 240
    assert set(records["variant"]) == {"base", "fast"}
    summary = json.loads((run_dir / "summary.json").read_text())  # the file, as users read it
    assert summary["verdict"]["word"] == "VALIDATED"
    assert summary["variants"]["fast"]["all"]["n"] == 120
    assert set(summary["variants"]["fast"]["classes"]) == {"LONG", "SHORT"}
    ratio = (
        summary["variants"]["fast"]["all"]["ttft_p90"]
        / summary["variants"]["base"]["all"]["ttft_p90"]
    )
    assert 0.3 < ratio < 0.8


def test_same_seed_same_numbers_and_shared_requests(tmp_path: Path, fake_effects) -> None:
    a = run_fake(tmp_path, out="a", repeats=2)
    b = run_fake(tmp_path, out="b", repeats=2)
    assert a.summary.variants == b.summary.variants
    assert a.summary.verdict == b.summary.verdict
    # per repeat, both variants saw identical requests; repeats differ from each other
    by_key = {(v, r): ids for v, r, _, ids in SEEN[:4]}
    assert by_key[("base", 0)] == by_key[("fast", 0)]
    assert by_key[("base", 1)] == by_key[("fast", 1)]
    assert by_key[("base", 0)] != by_key[("base", 1)]  # generator reseeded per repeat
    seeds = [s for _, _, s, _ in SEEN[:4]]
    assert len(set(seeds)) == 4
    assert seeds[0] == derive_seed(3, "variant", 0, "base")


def test_cli_seed_changes_numbers(tmp_path: Path, fake_effects) -> None:
    a = run_fake(tmp_path, out="a")
    b = run_fake(tmp_path, out="b", seed=99)
    assert a.summary.variants["base"].all != b.summary.variants["base"].all


def test_variants_filter_keeps_baseline(tmp_path: Path, fake_effects) -> None:
    outcome = run_fake(tmp_path, variants=["fast"])
    assert list(outcome.summary.variants) == ["base", "fast"]


def test_dry_run_plans_without_writing(tmp_path: Path, fake_effects) -> None:
    outcome = run_fake(tmp_path, dry_run=True, repeats=3, requests=50)
    text = "\n".join(outcome.plan.describe())
    assert "repeats: 3" in text
    assert "50 requests" in text
    assert "runs: 6" in text
    assert not (tmp_path / "run").exists()
    assert SEEN == []


def test_interrupt_keeps_finished_records(tmp_path: Path, fake_effects) -> None:
    INTERRUPT["fast"] = 40
    with pytest.raises(RunInterrupted) as info:
        run_fake(tmp_path)
    run_dir = info.value.run_dir
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["complete"] is False
    assert manifest["interrupted"] is True
    records = pd.read_parquet(run_dir / "requests.parquet")
    assert (records["variant"] == "base").sum() == 120
    assert (records["variant"] == "fast").sum() == 40  # every record written before Ctrl-C
    report = (run_dir / "report.md").read_text()
    assert "INCOMPLETE RUN" in report
    assert "**INCONCLUSIVE**" in report
    # the tables set the variants side by side on the requests both recorded, as the
    # verdict does, and say so
    cover = "the tables and latency plots cover the 40 requests that arrived before the first"
    assert f"{cover} one a variant lacks (base 120, fast 40 recorded)" in report
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [summary["variants"][v]["all"]["n"] for v in ("base", "fast")] == [40, 40]
    assert CLOSED == [FAKE]  # resources held across variants are released on Ctrl-C too


@pytest.mark.parametrize("after", [1, 0])
def test_a_stop_right_after_the_first_manifest_marks_the_run_interrupted(
    tmp_path: Path, fake_effects, monkeypatch, after: int
) -> None:
    """The stop lands while the run directory is being set up: just after its first
    manifest.json (while the disk-space reserve is written; a sweep's worker meets this
    when SIGTERM reaches it as a point starts) or during that first save. A manifest on
    disk never stays "running"; without one, no directory is left behind."""
    import btb_lab.runner as runner
    from btb_lab.interrupts import Terminated

    save = runner.Manifest.save
    calls = [0]

    def stopped(self, run_dir: Path) -> None:
        calls[0] += 1
        if calls[0] == 1:
            if after:
                save(self, run_dir)
            raise Terminated(15)
        save(self, run_dir)

    monkeypatch.setattr(runner.Manifest, "save", stopped)
    with pytest.raises(KeyboardInterrupt) as info:
        run_fake(tmp_path)
    assert getattr(info.value, "signum", None) == 15
    assert SEEN == []  # no variant started
    run_dir = tmp_path / "run"
    if not after:
        assert not run_dir.exists()
        return
    assert isinstance(info.value, RunInterrupted)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["interrupted"], manifest["complete"]) == (True, False)
    assert not (run_dir / runner.SPACE_RESERVE).exists()
    assert "INCOMPLETE RUN" in (run_dir / "report.md").read_text()


def test_a_stop_during_the_last_manifest_save_is_recorded(
    tmp_path: Path, fake_effects, monkeypatch
) -> None:
    """Every record is stored when the stop lands on the manifest's last save: the
    manifest is saved once more, saying the run was interrupted, not left "running"."""
    import btb_lab.runner as runner
    from btb_lab.interrupts import Terminated

    save = runner.Manifest.save
    stops = [0]

    def stopped(self, run_dir: Path) -> None:
        if self.finished is not None and not stops[0]:
            stops[0] += 1
            raise Terminated(15)
        save(self, run_dir)

    monkeypatch.setattr(runner.Manifest, "save", stopped)
    with pytest.raises(RunInterrupted) as info:
        run_fake(tmp_path)
    assert info.value.signum == 15
    manifest = json.loads((info.value.run_dir / "manifest.json").read_text())
    assert manifest["interrupted"] is True
    assert manifest["finished"] is not None
    assert len(pd.read_parquet(info.value.run_dir / "requests.parquet")) == 240


def test_a_stop_after_every_variant_run_ended_leaves_a_complete_run(
    tmp_path: Path, fake_effects, monkeypatch
) -> None:
    """Ctrl-C while the records are converted to parquet: every record is in the parts,
    so the run is complete and its verdict stands (in the report written on the way out
    and in every later `btb-lab report`), though the stop is recorded."""
    import btb_lab.runner as runner
    from btb_lab.report.render import build_report

    EFFECTS["fast"] = 0.5

    def stopped(run_dir: Path, *args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "finalize_parquet", stopped)
    with pytest.raises(RunInterrupted) as info:
        run_fake(tmp_path)
    run_dir = info.value.run_dir
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["interrupted"], manifest["complete"]) == (True, True)
    assert not (run_dir / "requests.parquet").exists()  # the parts hold the records
    report = (run_dir / "report.md").read_text()
    assert "INCOMPLETE RUN" not in report
    assert "**VALIDATED**" in report
    assert build_report(run_dir).verdict.word == "VALIDATED"
    assert runner.Manifest.load(run_dir).partial_reasons() == []


def test_a_stop_between_a_runs_last_record_and_its_status_marks_it_interrupted(
    tmp_path: Path, fake_effects, monkeypatch
) -> None:
    """The stop lands after the backend returned, while the variant's utilization and
    events are written: its entry says "interrupted", never "running"."""
    import btb_lab.runner as runner

    write = runner.write_events_part

    def stopped(run_dir: Path, variant: str, *args: Any, **kwargs: Any) -> None:
        if variant == "fast":
            raise KeyboardInterrupt
        write(run_dir, variant, *args, **kwargs)

    monkeypatch.setattr(runner, "write_events_part", stopped)
    with pytest.raises(RunInterrupted) as info:
        run_fake(tmp_path)
    manifest = json.loads((info.value.run_dir / "manifest.json").read_text())
    assert [(r["variant"], r["status"]) for r in manifest["runs"]] == [
        ("base", "ok"), ("fast", "interrupted")
    ]  # fmt: skip
    assert (manifest["interrupted"], manifest["complete"]) == (True, False)


def test_a_crashed_run_keeps_its_traceback_and_the_report_links_it(
    tmp_path: Path, fake_effects
) -> None:
    """An engine bug is not a user error: the run is recorded as failed (INCONCLUSIVE)
    with its traceback in the run directory, and the other variants still run."""
    CRASH["fast"] = AssertionError("invariant broke: reserved KV above budget")
    outcome = run_fake(tmp_path)
    run_dir = outcome.run_dir
    manifest = json.loads((run_dir / "manifest.json").read_text())
    fast = next(r for r in manifest["runs"] if r["variant"] == "fast")
    base = next(r for r in manifest["runs"] if r["variant"] == "base")
    assert (fast["status"], base["status"]) == ("failed", "ok")
    assert fast["error"] == "AssertionError: invariant broke: reserved KV above budget"
    trace = (run_dir / fast["error_file"]).read_text()
    assert "Traceback (most recent call last)" in trace
    assert "run_variant" in trace
    assert outcome.verdict.word == "INCONCLUSIVE"
    report = (run_dir / "report.md").read_text()
    assert f"(traceback: [{fast['error_file']}]({fast['error_file']}))" in report
    assert "invariant broke" in report


def test_a_run_whose_every_request_failed_still_gets_its_report(
    tmp_path: Path, fake_effects
) -> None:
    """Servers that went down fail every request (no first token, no finish): the run
    still ends with a report, its timeline spanning the arrivals, and INCONCLUSIVE."""
    UNREACHABLE.update({"base", "fast"})
    outcome = run_fake(tmp_path)
    run_dir = outcome.run_dir
    assert outcome.verdict.word == "INCONCLUSIVE"
    report = (run_dir / "report.md").read_text()
    assert "OK=0/120" in report
    assert (run_dir / "plots" / "timeline.png").stat().st_size > 0


def _plots(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_dir / "plots").glob("*.png"))}


def test_a_run_draws_its_plots_in_a_warm_child_with_the_same_bytes(
    tmp_path: Path, fake_effects, monkeypatch: pytest.MonkeyPatch
) -> None:
    from btb_lab.report import forked

    monkeypatch.setattr(forked, "fork_allowed", lambda: False)
    alone = run_fake(tmp_path, out="alone")
    taken: list[object] = []
    take = forked.take_warm

    def counted() -> object:
        worker = take()
        taken.append(worker)
        return worker

    monkeypatch.setattr(forked, "fork_allowed", lambda: True)
    monkeypatch.setattr(forked, "take_warm", counted)
    warm = run_fake(tmp_path, out="warm")
    assert len(taken) == 1
    assert isinstance(taken[0], forked.Warm)
    assert _plots(warm.run_dir) == _plots(alone.run_dir)
    assert len(_plots(alone.run_dir)) >= 3
    assert warm.summary.verdict == alone.summary.verdict
    with pytest.raises(ChildProcessError):  # every child was reaped
        os.waitpid(-1, os.WNOHANG)
    # interrupted, the child still draws, and is reaped
    INTERRUPT["fast"] = 40
    with pytest.raises(RunInterrupted) as info:
        run_fake(tmp_path, out="stopped")
    assert (info.value.run_dir / "plots" / "latency_cdf.png").is_file()
    assert isinstance(taken[1], forked.Warm)
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)


def test_the_plots_are_sent_to_the_warm_child_before_the_records_are_stored(
    tmp_path: Path, fake_effects, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plots need no statistics: once every record is in the parts, the child draws
    them from the parts while the parent converts them to parquet and computes the
    verdict (bootstrap, metrics), and the report waits for both."""
    from btb_lab import runner
    from btb_lab.analysis import summary
    from btb_lab.report import forked, render

    order: list[str] = []
    send, analyze, store = forked.Warm.send, summary.analyze_stored, runner.finalize_parquet

    def sent(self: forked.Warm, fn: object, *args: object, **kwargs: object) -> bool:
        order.append(f"{getattr(fn, '__name__', fn)} sent")
        return send(self, fn, *args, **kwargs)

    def analyzed(stored: summary.StoredRun) -> summary.AnalyzedRun:
        order.append("analysis")
        return analyze(stored)

    def stored(*args: Any, **kwargs: Any) -> Any:
        order.append("records stored")
        return store(*args, **kwargs)

    monkeypatch.setattr(forked, "fork_allowed", lambda: True)
    monkeypatch.setattr(forked.Warm, "send", sent)
    monkeypatch.setattr(render, "analyze_stored", analyzed)
    monkeypatch.setattr(runner, "finalize_parquet", stored)
    run = run_fake(tmp_path, out="warm")
    assert order == ["plots_from_parts sent", "records stored", "analysis"]
    assert len(_plots(run.run_dir)) >= 3
    with pytest.raises(ChildProcessError):  # the child was reaped
        os.waitpid(-1, os.WNOHANG)


def _no_drawing(run_dir: Path, variant_order: list[str]) -> list[tuple[str, str]]:
    raise RuntimeError("the child could not draw")


def test_plots_a_child_failed_to_draw_from_the_parts_are_drawn_by_the_run(
    tmp_path: Path, fake_effects, monkeypatch: pytest.MonkeyPatch
) -> None:
    from btb_lab.report import forked, render

    monkeypatch.setattr(forked, "fork_allowed", lambda: False)
    alone = run_fake(tmp_path, out="alone")
    monkeypatch.setattr(forked, "fork_allowed", lambda: True)
    monkeypatch.setattr(render, "plots_from_parts", _no_drawing)
    fallen_back = run_fake(tmp_path, out="fallen-back")
    assert _plots(fallen_back.run_dir) == _plots(alone.run_dir)
    assert len(_plots(alone.run_dir)) >= 3
    with pytest.raises(ChildProcessError):  # the child was reaped
        os.waitpid(-1, os.WNOHANG)


def test_warm_child_answers_once_and_exits_unused(monkeypatch: pytest.MonkeyPatch) -> None:
    from btb_lab.report import forked

    monkeypatch.setattr(forked, "fork_allowed", lambda: True)
    worker = forked.warm(lambda: None)
    assert worker is not None
    assert worker.call(divmod, 17, 5) == [3, 2]
    apart = forked.warm(lambda: None)
    assert apart is not None
    assert apart.send(divmod, 9, 4)
    assert divmod(1, 1) == (1, 0)  # the parent goes on meanwhile
    assert apart.result() == [2, 1]
    unused = forked.warm(lambda: None)
    assert unused is not None
    unused.close()  # never called: stopped and reaped
    failing = forked.warm(lambda: None)
    assert failing is not None
    assert failing.call(lambda: 1) is None  # a lambda cannot be sent: the parent draws
    refused = forked.warm(lambda: None)
    assert refused is not None
    assert not refused.send(lambda: 1)
    assert refused.result() is None
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)
    with forked.prewarmed(lambda: None) as held:
        assert forked.take_warm() is held
        assert forked.take_warm() is None  # handed out once
    assert forked.take_warm() is None
