"""The seed's synthetic Bursted-ART windows (`seed_bursty`): the exact shape of
SEED-SIMULATOR.md, seeded."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from btb_lab.workload import GenContext, generate


def windows(**params: object) -> list:
    return generate("seed_bursty", {"windows": 2, **params}, GenContext(seed=5, block_tokens=256))


def test_a_window_is_eight_bursts_of_500_plus_120_decoys() -> None:
    reqs = windows()
    assert len(reqs) == 2 * 4120
    by_window: dict[str, list] = defaultdict(list)
    for r in reqs:
        by_window[r.trace_id].append(r)
    assert sorted(by_window) == ["synthetic_00000", "synthetic_00001"]
    for rows in by_window.values():
        jobs: dict[str, list] = defaultdict(list)
        for r in rows:
            jobs[r.group_id].append(r)
        bursts = [g for g in jobs if ":burst:" in g]
        decoys = [g for g in jobs if ":decoy:" in g]
        assert (len(bursts), len(decoys)) == (8, 120)
        assert {len(jobs[g]) for g in bursts} == {500}
        assert {len(jobs[g]) for g in decoys} == {1}
        # every request: 256 shared prefix blocks + 1 own block, 65,792 tokens, 1 output token
        assert {(r.input_tokens, len(r.block_hashes), r.output_tokens) for r in rows} == {
            (65_792, 257, 1)
        }
        prefixes = {g: {r.block_hashes[:256] for r in jobs[g]} for g in jobs}
        assert all(len(p) == 1 for p in prefixes.values())  # one prefix per job
        assert len({next(iter(p)) for p in prefixes.values()}) == 128  # none shared across jobs
        assert len({r.block_hashes[256] for r in rows}) == 4120  # own suffix each
        # burst j starts at 20 + 40 j ± 2 s and spreads evenly over 60 s
        for j in range(8):
            arrivals = sorted(r.arrival_s for r in jobs[f"{rows[0].trace_id}:burst:{j}"])
            assert 18 + 40 * j <= arrivals[0] <= 22 + 40 * j
            assert arrivals[-1] - arrivals[0] == pytest.approx(60.0)
            gaps = {round(b - a, 9) for a, b in itertools.pairwise(arrivals)}
            assert gaps == {round(60 / 499, 9)}
        assert all(14 <= jobs[g][0].arrival_s <= 340 for g in decoys)
        assert [r.arrival_s for r in rows] == sorted(r.arrival_s for r in rows)
        assert {r.source for r in rows} == {"synthetic"}
        # a job's requests are independent, not one session's turns: the audit counted a
        # burst of 500 as one requester (fan-out 1), and a closed replay would queue it
        assert {r.session_id for r in rows} == {None}


def test_seeded_and_the_shape_is_a_parameter() -> None:
    a, b = windows(), windows()
    assert [(r.request_id, r.arrival_s, r.block_hashes) for r in a] == [
        (r.request_id, r.arrival_s, r.block_hashes) for r in b
    ]
    other = generate("seed_bursty", {"windows": 2}, GenContext(seed=6, block_tokens=256))
    assert [r.arrival_s for r in other] != [r.arrival_s for r in a]
    small = windows(bursts=2, burst_size=3, decoys=1, prefix_tokens=1024, output_tokens=4)
    assert len(small) == 2 * (2 * 3 + 1)
    assert {(r.input_tokens, len(r.block_hashes), r.output_tokens) for r in small} == {(1280, 5, 4)}
