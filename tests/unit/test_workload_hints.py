"""Job-kind hints in the bursted generator and in Bursted-ART traces: carried honestly
(decoys too), drawn from a stream of their own, and kept through a trace round trip."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from btb_lab.errors import UserError
from btb_lab.records import BURST_JOB_KINDS, Request
from btb_lab.workload.formats import load_trace
from btb_lab.workload.generators import GenContext, generate
from btb_lab.workload.writer import write_bursted_art

PARAMS = {
    "windows": 12,
    "burst_size": 20,
    "prefix_tokens": 4096,
    "decoys_per_window": 4,
    "decoy_repeats": 3,
    "background_rate_per_s": 0.2,
}


def bursted(seed: int = 3, **extra: object) -> list[Request]:
    return generate("bursted", {**PARAMS, **extra}, GenContext(seed=seed))


def kinds_by_group(requests: list[Request]) -> dict[str, set[str | None]]:
    out: dict[str, set[str | None]] = defaultdict(set)
    for r in requests:
        out[r.group_id or r.request_id].add(r.job_kind)
    return out


def test_no_hints_by_default() -> None:
    assert {r.job_kind for r in bursted()} == {None}


def test_hints_do_not_change_the_requests() -> None:
    """The hint stream is separate: every other field is the same with or without hints."""
    plain, hinted = bursted(), bursted(hinted_bursts=0.7, hinted_decoys=0.4)
    strip = [(r.request_id, r.arrival_s, r.input_tokens, r.output_tokens, r.block_hashes,
              r.group_id, r.trace_id) for r in plain]  # fmt: skip
    assert strip == [(r.request_id, r.arrival_s, r.input_tokens, r.output_tokens,
                      r.block_hashes, r.group_id, r.trace_id) for r in hinted]  # fmt: skip
    assert {r.job_kind for r in hinted} > {None}


def test_every_job_carries_one_kind_and_shares_follow_the_params() -> None:
    requests = bursted(hinted_bursts=1.0, hinted_decoys=0.5)
    groups = kinds_by_group(requests)
    bursts = {g: k for g, k in groups.items() if "-burst" in g}
    decoys = {g: k for g, k in groups.items() if "-decoy" in g}
    background = {g: k for g, k in groups.items() if g.startswith("system")}
    assert all(len(k) == 1 for k in groups.values())  # one kind (or none) per job
    assert all(k <= set(BURST_JOB_KINDS) for k in bursts.values())  # every burst hinted
    decoy_kinds = [next(iter(k)) for k in decoys.values()]
    assert len(decoy_kinds) == 48
    hinted = sum(k is not None for k in decoy_kinds)
    assert hinted == 26  # about half of 48 (this seed)
    assert {k for k in decoy_kinds if k is not None} <= set(BURST_JOB_KINDS)
    assert all(k == {None} for k in background.values())


def test_hints_are_seeded() -> None:
    a = [r.job_kind for r in bursted(seed=5, hinted_bursts=0.5, hinted_decoys=0.5)]
    b = [r.job_kind for r in bursted(seed=5, hinted_bursts=0.5, hinted_decoys=0.5)]
    c = [r.job_kind for r in bursted(seed=6, hinted_bursts=0.5, hinted_decoys=0.5)]
    assert a == b
    assert a != c


@pytest.mark.parametrize("field", ["hinted_bursts", "hinted_decoys"])
def test_hint_shares_are_validated(field: str) -> None:
    with pytest.raises(UserError, match=field):
        bursted(**{field: 1.5})


def test_job_kind_round_trips_through_a_bursted_art_trace(tmp_path: Path) -> None:
    requests = bursted(hinted_bursts=1.0, hinted_decoys=1.0)
    path = tmp_path / "hinted.jsonl"
    write_bursted_art(requests, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["metadata"].get("job_kind") for r in rows} == {None, *BURST_JOB_KINDS}
    loaded = load_trace(path, "bursted-art").requests
    assert [(r.request_id, r.job_kind) for r in loaded] == [
        (r.request_id, r.job_kind) for r in requests
    ]


def test_a_bad_job_kind_in_a_trace_names_the_field(tmp_path: Path) -> None:
    row = {"arrival_s": 0.0, "trace_id": "w", "source": "synthetic", "request_id": "r1",
           "input_length": 10, "output_length": 2, "hash_ids": ["a"],
           "metadata": {"job_kind": 7}}  # fmt: skip
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(UserError, match=r"metadata\.job_kind"):
        load_trace(path, "bursted-art")


def test_burst_sizes_cycle_over_the_runs_bursts() -> None:
    requests = bursted(burst_sizes=[5, 30, 12], bursts_per_window=2, windows=3)
    sizes: dict[str, int] = defaultdict(int)
    for r in requests:
        if r.group_id and "-burst" in r.group_id:
            sizes[r.group_id] += 1
    by_window = sorted(sizes.items(), key=lambda kv: (kv[0].split("-w")[1], kv[0]))
    assert [n for _, n in by_window] == [5, 30, 12, 5, 30, 12]


def test_burst_sizes_unset_is_burst_size_and_validated() -> None:
    assert _burst_rows(bursted()) == _burst_rows(bursted(burst_sizes=[20]))
    with pytest.raises(UserError, match="decoy_repeats"):
        bursted(burst_sizes=[3, 40])  # a 3-request burst is no bigger than a decoy
    with pytest.raises(UserError, match="burst_sizes"):
        bursted(burst_sizes=[])


def _burst_rows(requests: list[Request]) -> list[tuple[object, ...]]:
    return [(r.request_id, r.arrival_s, r.input_tokens, r.block_hashes) for r in requests]
