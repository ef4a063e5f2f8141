"""A sweep's points as the default point runner runs them (`sweep.engine.run_point`): the
real simulator, a trace parsed once per process across points, plots drawn in the point's
own process."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from btb_lab import runner
from btb_lab.report import forked
from btb_lab.sweep import engine, run_sweep
from btb_lab.sweep.plan import PointTask
from btb_lab.workload import loader
from tests.golden.test_headlines import records_digest
from tests.helpers import CountingGenerators

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "workload"

BASE = """\
id: SWEEP-POINTS
title: sweep points over one trace
claim: test only
backend: sim
model: llama-3.3-70b
cluster:
  instances:
    - {role: C, count: 2, gpu: H100, gpus: 4}
workload:
  {workload}
  block_tokens: 512
variants:
  cache_aware:
    description: cache-aware routing
    router: {policy: cache_aware}
  btb:
    description: burst detection and warming
    router:
      policy: btb
      params: {burst_count: 2, burst_window_s: 1.0, prefix_tokens: 1024, replicas: 2}
baseline: cache_aware
repeats: 1
seed: 3
verdict:
  metric: ttft_p90
  direction: decrease
  min_effect: 0.05
"""

SWEEP = """\
name: points
base: base.yaml
axes:
  pace:
    slow: {workload.time_scale: 2.0}
    fast: {workload.time_scale: 0.25, variants.btb.router.params.replicas: 1}
table:
  metrics: [ttft_p90]
"""


@pytest.mark.parametrize(
    "workload",
    [
        "trace: {path: trace.jsonl, format: bursted-art}",
        "generator: {kind: poisson, params: {requests: 40, prefix_tokens: 1024}}",
    ],
    ids=["trace", "generator"],
)
def test_points_load_their_workload_once_and_replay_what_a_run_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workload: str
) -> None:
    shutil.copy(FIXTURES / "bursted_art_small.jsonl", tmp_path / "trace.jsonl")
    (tmp_path / "base.yaml").write_text(BASE.replace("{workload}", workload), encoding="utf-8")
    (tmp_path / "sweep.yaml").write_text(SWEEP, encoding="utf-8")
    made: list[str] = []
    parse = loader.load_trace

    def counted(path: Path, *args: Any, **kwargs: Any) -> Any:
        made.append("parse")
        return parse(path, *args, **kwargs)

    generators = CountingGenerators(loader.GENERATORS)
    monkeypatch.setattr(loader, "load_trace", counted)
    monkeypatch.setattr(loader, "GENERATORS", generators)
    outcome = run_sweep(tmp_path / "sweep.yaml", out=tmp_path / "out")
    assert len(outcome.ran) == 2
    assert not outcome.failed
    assert len(made) + len(generators.seeds) == 1  # both points, one process: made once
    assert engine._workloads == []  # the sweep let it go

    # each point stored exactly what a run of the base file with its overrides stores
    for point in outcome.points:
        alone = tmp_path / f"alone-{point.point_id}"
        runner.run_hypothesis(
            tmp_path / "base.yaml",
            runner.RunOptions(out=alone, overrides=dict(point.overrides), progress=False),
        )
        stored = tmp_path / "out" / "points" / point.point_id
        assert records_digest(stored) == records_digest(alone)
    assert len(made) + len(generators.seeds) == 3
    assert len({records_digest(tmp_path / f"alone-{p.point_id}") for p in outcome.points}) == 2


def test_a_point_draws_its_plots_in_its_own_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """No report child per point: the points already share the cores, and the point's
    process keeps matplotlib for its next point."""
    if not forked.fork_allowed():
        pytest.skip("no report child here anyway (one core, or other threads)")
    seen: list[tuple[bool, object]] = []

    def fake_run(path: Path, options: runner.RunOptions) -> None:
        seen.append((forked.fork_allowed(), options.workloads))

    monkeypatch.setattr(runner, "run_hypothesis", fake_run)
    monkeypatch.setattr(engine, "_workloads", [])  # this test's own, gone after it
    task = PointTask(point_id="p", labels={}, base_path="b.yaml", overrides={}, run_dir="r")
    engine.run_point(task)
    engine.run_point(task)
    assert [fork for fork, _ in seen] == [False, False]
    assert seen[0][1] is not None
    assert seen[0][1] is seen[1][1]  # one cache per process
    assert forked.fork_allowed()  # only inside the point
