"""The cyclic collector kept off a run's workload: paused while it loads and simulates,
its requests frozen out of later collections for the rest of the run, and the
collector's state given back as it was afterwards (the caller's process goes on)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from btb_lab import collector, runner
from btb_lab.config.workload import WorkloadSpec
from btb_lab.sim.engine import Engine
from btb_lab.workload import formats, load_requests, loader
from tests.helpers import write_small

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "workload"


@pytest.fixture(autouse=True)
def _thawed() -> Iterator[None]:
    gc.unfreeze()
    assert gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable()


def test_paused_gives_back_the_state_it_found() -> None:
    with collector.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    with collector.paused():
        pass
    assert not gc.isenabled()  # a caller's own pause is not undone
    gc.enable()
    with pytest.raises(RuntimeError), collector.paused():
        raise RuntimeError
    assert gc.isenabled()


def test_freeze_holds_until_the_outermost_scope_ends() -> None:
    collector.freeze()
    assert gc.get_freeze_count() == 0  # outside a scope nothing would thaw it
    with collector.frozen():
        with collector.frozen(now=True):
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0
        collector.freeze()
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), collector.frozen(now=True):
        raise RuntimeError
    assert gc.get_freeze_count() == 0


def test_a_scope_that_froze_nothing_leaves_a_callers_freeze_alone() -> None:
    gc.freeze()
    before = gc.get_freeze_count()
    with collector.frozen():
        pass
    assert gc.get_freeze_count() == before


def test_loading_pauses_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    enabled_while_parsing: list[bool] = []
    parse = loader.load_trace

    def spy(*args: Any, **kwargs: Any) -> Any:
        enabled_while_parsing.append(gc.isenabled())
        return parse(*args, **kwargs)

    monkeypatch.setattr(loader, "load_trace", spy)
    spec = WorkloadSpec.model_validate({"trace": {"path": "mooncake_small.jsonl"}})
    assert len(load_requests(spec, base_dir=FIXTURES, seed=0)) == 4
    assert enabled_while_parsing == [False]
    assert gc.isenabled()


def test_a_trace_parses_with_the_collector_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`load_trace` itself (`trace convert`, `trace audit` and the loader all use it)."""
    enabled_while_parsing: list[bool] = []
    parse = formats.FORMATS.get("mooncake")

    def spy(*args: Any) -> Any:
        enabled_while_parsing.append(gc.isenabled())
        return parse(*args)

    monkeypatch.setattr(formats.FORMATS, "get", lambda name: spy)
    loaded = formats.load_trace(FIXTURES / "mooncake_small.jsonl", "mooncake")
    assert len(loaded.requests) == 4
    assert enabled_while_parsing == [False]
    assert gc.isenabled()


def test_a_run_simulates_on_frozen_requests_and_thaws_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    frozen_during: list[tuple[int, bool]] = []
    run = Engine._run

    def spy(self: Engine, requests: object) -> object:
        frozen_during.append((gc.get_freeze_count(), gc.isenabled()))
        return run(self, requests)  # type: ignore[arg-type]

    monkeypatch.setattr(Engine, "_run", spy)
    path = write_small(tmp_path)
    options = runner.RunOptions(out=tmp_path / "out", progress=False, jobs=1)
    outcome = runner.run_hypothesis(path, options)
    assert outcome.verdict is not None
    assert len(frozen_during) == 2  # both variants
    assert all(count > 0 and not enabled for count, enabled in frozen_during)
    assert gc.get_freeze_count() == 0
    assert gc.isenabled()


def test_a_pause_that_freezes_does_so_before_the_collector_is_back_on() -> None:
    """Everything made while paused waits in the youngest generation; frozen only after
    the collector is on, the first allocation would collect (scan) all of it once."""
    seen: list[int] = []

    def collections(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(collections)
    try:
        with collector.frozen():
            with collector.paused(then_freeze=True):
                made = [[i] for i in range(50_000)]
            assert gc.isenabled()
            assert gc.get_freeze_count() >= len(made)
            assert gc.get_count()[0] < 700  # the young generation's count starts over
            more = [[i] for i in range(600)]
        assert not seen
        with collector.paused(then_freeze=True):  # outside a scope: nothing frozen
            pass
        assert gc.get_freeze_count() == 0
    finally:
        gc.callbacks.remove(collections)
    assert len(more) == 600


def test_a_run_freezes_its_workload_before_any_collection_sees_it(tmp_path: Path) -> None:
    young: list[int] = []  # the young generation's size at each collection's start

    def collections(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            young.append(len(gc.get_objects(generation=0)))

    path = write_small(tmp_path, **{"requests: 60": "requests: 3000"})
    loaded = runner.plan_run(path, runner.RunOptions(progress=False)).loaded
    gc.callbacks.append(collections)
    try:
        with collector.frozen():
            requests = runner._load_requests(loaded, seed=0)
            assert gc.get_freeze_count() >= len(requests) == 3000
            _ = [[i] for i in range(5_000)]  # enough allocations to start a collection
    finally:
        gc.callbacks.remove(collections)
    assert young  # a collection ran, and it did not scan the workload
    assert max(young) < len(requests)
