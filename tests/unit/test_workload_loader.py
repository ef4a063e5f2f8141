"""load_requests: ordering, offset/requests, time_scale semantics, skipped rows, validation."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from btb_lab.config.workload import WorkloadSpec
from btb_lab.errors import UserError
from btb_lab.workload import load_requests, validate_workload_spec
from tests.helpers import CountingGenerators

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "workload"


def _spec(**kwargs: object) -> WorkloadSpec:
    return WorkloadSpec.model_validate(kwargs)


def test_mooncake_time_scale_multiplies_gaps() -> None:
    trace = {"path": "mooncake_small.jsonl", "format": "mooncake"}
    plain = load_requests(_spec(trace=trace), base_dir=FIXTURES, seed=0)
    calm = load_requests(_spec(trace=trace, time_scale=10), base_dir=FIXTURES, seed=0)
    dense = load_requests(_spec(trace=trace, time_scale=0.5), base_dir=FIXTURES, seed=0)
    assert [r.arrival_s for r in plain] == [0.0, 1.0, 1.5, 4.0]
    assert [r.arrival_s for r in calm] == [0.0, 10.0, 15.0, 40.0]
    assert [r.arrival_s for r in dense] == [0.0, 0.5, 0.75, 2.0]
    assert plain.skipped_rows == 0


def test_offset_requests_and_rebase_to_first_selected() -> None:
    spec = _spec(trace={"path": "mooncake_small.jsonl"}, offset=1, requests=2, time_scale=2)
    requests = load_requests(spec, base_dir=FIXTURES, seed=0)
    assert [r.input_tokens for r in requests] == [1200, 600]
    # the window is re-based to its first selected request (1.0 s), then gaps doubled
    assert [r.arrival_s for r in requests] == [0.0, 1.0]


def test_block_tokens_set_on_each_request() -> None:
    spec = _spec(trace={"path": "mooncake_small.jsonl"}, block_tokens=256)
    requests = load_requests(spec, base_dir=FIXTURES, seed=0)
    assert {r.block_tokens for r in requests} == {256}
    gen = {"kind": "poisson", "params": {"requests": 20, "prefix_tokens": 1024}}
    generated = load_requests(_spec(generator=gen, block_tokens=256), base_dir=FIXTURES, seed=0)
    assert {r.block_tokens for r in generated} == {256}
    assert all(len(r.block_hashes) == -(-r.input_tokens // 256) for r in generated)


def test_block_size_too_large_for_hash_count_is_an_error() -> None:
    spec = _spec(trace={"path": "mooncake_small.jsonl"}, block_tokens=1024)
    with pytest.raises(UserError, match=r":1: field 'hash_ids': 3 ids but input_length 1500"):
        load_requests(spec, base_dir=FIXTURES, seed=0)


def test_windows_rebased_and_laid_end_to_end() -> None:
    spec = _spec(
        trace={"path": "bursted_art_small.jsonl", "format": "bursted-art"},
        time_scale=2,
        window_gap_s=5,
    )
    requests = load_requests(spec, base_dir=FIXTURES, seed=0)
    # window test-w001 appears first in the file: arrivals 100, 100.5, 101 → 0, 1, 2
    # window train-art000 follows after a 5 s gap: arrivals 5, 9 → 7, 15
    assert [(r.request_id, r.arrival_s) for r in requests] == [
        ("a1", 0.0), ("a2", 1.0), ("a3", 2.0), ("b1", 7.0), ("b2", 15.0),
    ]  # fmt: skip
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)


def test_skip_bad_rows_reports_count() -> None:
    spec = _spec(trace={"path": "mooncake_bad.jsonl", "skip_bad_rows": True})
    requests = load_requests(spec, base_dir=FIXTURES, seed=0)
    assert len(requests) == 4
    assert requests.skipped_rows == 5
    assert requests.skipped[0].endswith("mooncake_bad.jsonl:3: field 'input_length': must be ≥ 0")
    with pytest.raises(UserError, match=r"mooncake_bad\.jsonl:3: field 'input_length'"):
        load_requests(_spec(trace={"path": "mooncake_bad.jsonl"}), base_dir=FIXTURES, seed=0)


def test_generator_time_scale_and_seed() -> None:
    gen = {"kind": "poisson", "params": {"requests": 50, "rate_per_s": 2.0}}
    base = load_requests(_spec(generator=gen), base_dir=FIXTURES, seed=3)
    scaled = load_requests(_spec(generator=gen, time_scale=4), base_dir=FIXTURES, seed=3)
    assert [r.arrival_s * 4 for r in base] == pytest.approx([r.arrival_s for r in scaled])
    assert base[0].arrival_s == 0.0


def test_validate_workload_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="unknown trace format 'csv'; choose one of"):
        validate_workload_spec(_spec(trace={"path": "x", "format": "csv"}), tmp_path)
    with pytest.raises(UserError, match=r"^workload\.trace\.path: trace file not found"):
        validate_workload_spec(_spec(trace={"path": "missing.jsonl"}), tmp_path)
    with pytest.raises(
        UserError, match=r"^workload\.generator\.kind: unknown workload generator 'zipf'"
    ):
        validate_workload_spec(_spec(generator={"kind": "zipf"}), tmp_path)
    with pytest.raises(
        UserError,
        match=r"workload\.generator\.params\.burst_sise: Extra inputs are not permitted \(valid",
    ):
        validate_workload_spec(
            _spec(generator={"kind": "bursted", "params": {"burst_sise": 3}}), tmp_path
        )
    with pytest.raises(
        UserError, match=r"workload\.generator\.params\.burst_size: Input should be greater"
    ):
        validate_workload_spec(
            _spec(generator={"kind": "bursted", "params": {"burst_size": 0}}), tmp_path
        )
    shutil.copy(FIXTURES / "mooncake_small.jsonl", tmp_path / "t.jsonl")
    validate_workload_spec(_spec(trace={"path": "t.jsonl"}), tmp_path)  # no error


def test_shared_trace_loads_when_present() -> None:
    trace = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
    path = trace / "mooncake_synthetic.jsonl"
    if not path.exists():
        pytest.skip(f"shared traces not found at {trace}")
    spec = _spec(trace={"path": str(path)}, requests=100, time_scale=10)
    requests = load_requests(spec, base_dir=Path("."), seed=0)
    assert len(requests) == 100
    assert requests[0].arrival_s == 0.0


def test_a_trace_cache_parses_once_and_hands_out_fresh_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repeats of one run share the parsed file (`WorkloadCache`): each load gives what a
    fresh parse gives, jitter and time scale included, and moving one load's arrivals (as
    the loader and the variation do in place) leaves the next load untouched."""
    from btb_lab.workload import loader

    trace = tmp_path / "trace.jsonl"
    shutil.copy(FIXTURES / "bursted_art_small.jsonl", trace)
    parses: list[Path] = []
    parse = loader.load_trace

    def counted(path: Path, *args: object, **kwargs: object) -> object:
        parses.append(path)
        return parse(path, *args, **kwargs)  # type: ignore[arg-type]

    spec = _spec(
        trace={"path": str(trace), "format": "bursted-art"}, time_scale=3,
        variation={"arrival_jitter_s": 0.25, "resample_windows": True},
    )  # fmt: skip
    fresh = [load_requests(spec, base_dir=tmp_path, seed=seed) for seed in (1, 2, 1)]
    monkeypatch.setattr(loader, "load_trace", counted)
    cache = loader.WorkloadCache()
    cached = [load_requests(spec, base_dir=tmp_path, seed=seed, cache=cache) for seed in (1, 2, 1)]
    assert cached == fresh
    assert cached[0] != cached[1]  # the seeds' jitter, not the first load's moved arrivals
    assert len(parses) == 1
    shared = {id(r.block_hashes) for r in cached[0]} & {id(r.block_hashes) for r in cached[2]}
    assert shared  # the block-id tuples are the parsed ones, not copies
    assert not {id(r) for r in cached[0]} & {id(r) for r in cached[2]}

    trace.write_text(trace.read_text() + trace.read_text().splitlines()[0] + "\n")
    with pytest.raises(UserError):  # the changed file is parsed again (a repeated id)
        load_requests(spec, base_dir=tmp_path, seed=1, cache=cache)
    assert len(parses) == 2
    trace.unlink()
    with pytest.raises(UserError, match=r"trace\.jsonl"):  # the loader's own message
        load_requests(spec, base_dir=tmp_path, seed=1, cache=cache)


def test_a_workload_cache_generates_once_per_generator_params_and_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sweep's points share their process's `WorkloadCache`: a generated workload is made
    once for the same generator, params, seed and block size, and every load gives what a
    fresh one gives (the variation applied to fresh requests); a generator that reads a
    file makes its workload every time."""
    from btb_lab.workload import loader

    gen = {"kind": "poisson", "params": {"requests": 30, "prefix_tokens": 1024}}
    spec = _spec(generator=gen, block_tokens=256, variation={"arrival_jitter_s": 0.25})
    longer = _spec(
        generator={**gen, "params": {"requests": 30, "prefix_tokens": 2048}}, block_tokens=256
    )
    fresh = [load_requests(spec, base_dir=FIXTURES, seed=seed) for seed in (1, 1, 2)]
    counting = CountingGenerators(loader.GENERATORS)
    monkeypatch.setattr(loader, "GENERATORS", counting)
    cache = loader.WorkloadCache()
    cached = [load_requests(spec, base_dir=FIXTURES, seed=seed, cache=cache) for seed in (1, 1, 2)]
    assert cached == fresh
    assert counting.seeds == [1, 2]
    assert not {id(r) for r in cached[0]} & {id(r) for r in cached[1]}
    assert load_requests(longer, base_dir=FIXTURES, seed=2, cache=cache) == load_requests(
        longer, base_dir=FIXTURES, seed=2
    )
    assert counting.seeds == [1, 2, 2, 2]  # other params: made again (and fresh, uncached)

    reads = {"windows": 1, "real_windows": 1, "real_trace": "mooncake_small.jsonl"}
    from_file = _spec(generator={"kind": "bursted", "params": reads}, block_tokens=512)
    for _ in range(2):
        load_requests(from_file, base_dir=FIXTURES, seed=3, cache=cache)
    assert counting.seeds[-2:] == [3, 3]
