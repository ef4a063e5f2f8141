"""Generators: seeded determinism and the shapes the seeds describe."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict

import numpy as np
import pytest

from btb_lab.errors import UserError
from btb_lab.records import Request
from btb_lab.workload.generators import GENERATORS, BurstedParams, GenContext, generate
from btb_lab.workload.summary import ideal_cached_tokens

SMALL_BURSTED = {
    "windows": 4,
    "burst_size": 40,
    "prefix_tokens": 8192,
    "decoys_per_window": 3,
    "decoy_repeats": 3,
    "background_rate_per_s": 0.5,
    "train_fraction": 0.25,
}


def _rows(requests: list[Request]) -> list[tuple[object, ...]]:
    return [
        (r.request_id, r.arrival_s, r.input_tokens, r.output_tokens, r.block_hashes, r.trace_id)
        for r in requests
    ]


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("bursted", SMALL_BURSTED),
        ("agentic", {"sessions": 20}),
        ("poisson", {"requests": 200}),
        ("gamma", {"requests": 200}),
    ],
)
def test_same_seed_same_requests_other_seed_differs(kind: str, params: dict[str, object]) -> None:
    first = generate(kind, params, GenContext(seed=11))
    again = generate(kind, params, GenContext(seed=11))
    other = generate(kind, params, GenContext(seed=12))
    assert _rows(first) == _rows(again)
    assert _rows(first) != _rows(other)
    assert all(len(r.block_hashes) == -(-r.input_tokens // r.block_tokens) for r in first)


def test_registry_names_and_unknown_param() -> None:
    assert list(GENERATORS) == ["agentic", "bursted", "gamma", "poisson", "seed_bursty"]
    for name in GENERATORS:
        model = GENERATORS.get(name).params_model
        assert all(f.description for f in model.model_fields.values()), name
    with pytest.raises(UserError, match="param 'burst_count': Extra inputs are not permitted"):
        generate("bursted", {"burst_count": 3}, GenContext(seed=0))


def test_bursted_defaults_are_the_seed_shape() -> None:
    params = BurstedParams()
    assert params.burst_size == 500
    assert params.prefix_tokens == 65536
    assert params.window_s == 60.0


def test_bursted_shape_bursts_decoys_windows() -> None:
    requests = generate("bursted", SMALL_BURSTED, GenContext(seed=5, block_tokens=512))
    by_group: dict[str, list[Request]] = defaultdict(list)
    for r in requests:
        by_group[r.group_id or ""].append(r)
    bursts = {g: rs for g, rs in by_group.items() if "-burst" in g}
    decoys = {g: rs for g, rs in by_group.items() if "-decoy" in g}
    assert len(bursts) == 4
    assert len(decoys) == 12
    for members in bursts.values():
        assert len(members) == 40
        assert len({r.block_hashes[:16] for r in members}) == 1  # 8192 / 512 shared blocks
        assert len({r.block_hashes[16:] for r in members}) == 40  # each has its own suffix
        assert all(r.input_tokens > 8192 for r in members)
        spread = max(r.arrival_s for r in members) - min(r.arrival_s for r in members)
        assert spread <= 8.0
        assert all(0 <= r.arrival_s <= 60 for r in members)
    for members in decoys.values():
        assert len(members) == 3
        assert members[0].input_tokens >= 8192
    windows = Counter(r.trace_id for r in requests)
    assert len(windows) == 4
    splits = Counter(w.split("-")[0] for w in windows)
    assert splits == {"train": 1, "test": 3}
    assert {r.source for r in requests} == {"synthetic"}


def test_bursted_split_takes_whole_windows() -> None:
    every = generate("bursted", SMALL_BURSTED, GenContext(seed=5))
    train = generate("bursted", SMALL_BURSTED | {"split": "train"}, GenContext(seed=5))
    test = generate("bursted", SMALL_BURSTED | {"split": "test"}, GenContext(seed=5))
    assert sorted(_rows(train) + _rows(test)) == sorted(_rows(every))
    assert {r.trace_id for r in train}.isdisjoint({r.trace_id for r in test})
    assert all(r.trace_id.startswith("train-") for r in train)


def test_bursted_real_windows_from_a_trace(tmp_path: object) -> None:
    from pathlib import Path

    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "workload"
    params = SMALL_BURSTED | {
        "windows": 1,
        "real_windows": 1,
        "real_trace": "mooncake_small.jsonl",
        "window_s": 2.0,
        "burst_spread_s": 1.0,
        "background_rate_per_s": 0.0,
        "decoys_per_window": 0,
    }
    requests = generate("bursted", params, GenContext(seed=1, base_dir=fixtures))
    art = [r for r in requests if r.source == "art"]
    assert art
    assert len({r.trace_id for r in art}) == 1
    assert {r.input_tokens for r in art} <= {1500, 1200, 600, 2048}


def _klass(request: Request, cached_tokens: int) -> str:
    if cached_tokens / request.input_tokens >= 0.5:
        return "WARM"
    return "HEAVY" if request.input_tokens >= 16384 else "MEDIUM"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_agentic_most_heavy_are_cold_first_turns(seed: int) -> None:
    requests = generate("agentic", {}, GenContext(seed=seed))
    cached = ideal_cached_tokens(requests)
    classes = [_klass(r, c) for r, c in zip(requests, cached, strict=True)]
    heavy = [(r, c) for r, c, k in zip(requests, cached, classes, strict=True) if k == "HEAVY"]
    counts = Counter(classes)
    assert set(counts) == {"WARM", "MEDIUM", "HEAVY"}
    assert min(counts.values()) >= 0.15 * len(requests)  # a real mix, as in the log
    first_turn_share = sum(r.turn == 1 for r, _ in heavy) / len(heavy)
    assert first_turn_share >= 0.85  # the log: 92% of HEAVY are turn 1
    assert np.median([c / r.input_tokens for r, c in heavy]) < 0.15  # HEAVY is cold


def test_agentic_turns_extend_previous_context() -> None:
    requests = generate("agentic", {"sessions": 30}, GenContext(seed=4, block_tokens=512))
    sessions: dict[str, list[Request]] = defaultdict(list)
    for r in requests:
        assert r.session_id is not None
        sessions[r.session_id].append(r)
    multi = [rs for rs in sessions.values() if len(rs) > 1]
    assert multi
    for turns in sessions.values():
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == list(range(1, len(turns) + 1))
        for prev, cur in itertools.pairwise(turns):
            assert cur.arrival_s >= prev.arrival_s
            assert cur.input_tokens > prev.input_tokens + prev.output_tokens
            full = prev.input_tokens // 512
            assert cur.block_hashes[:full] == prev.block_hashes[:full]
            if len(prev.block_hashes) > full:  # the partial tail block changed content
                assert cur.block_hashes[full] != prev.block_hashes[full]


def _cv(requests: list[Request]) -> float:
    gaps = np.diff([r.arrival_s for r in requests])
    return float(gaps.std() / gaps.mean())


def test_poisson_rate_and_gamma_burstiness() -> None:
    params = {"requests": 4000, "rate_per_s": 5.0}
    poisson = generate("poisson", params, GenContext(seed=9))
    gamma = generate("gamma", params | {"shape": 0.25}, GenContext(seed=9))
    span = poisson[-1].arrival_s - poisson[0].arrival_s
    assert len(poisson) / span == pytest.approx(5.0, rel=0.08)
    assert _cv(poisson) == pytest.approx(1.0, abs=0.1)
    assert _cv(gamma) == pytest.approx(2.0, rel=0.15)  # CV = 1/sqrt(shape)
    shared = sum(r.group_id is not None for r in poisson) / len(poisson)
    assert shared == pytest.approx(0.8, abs=0.03)
    groups = Counter(r.group_id for r in poisson if r.group_id)
    assert groups.most_common(1)[0][0] == "prefix0"  # Zipf: prefix 0 is the most popular


def test_agentic_turns_without_think_time_stay_in_order_past_turn_99() -> None:
    # every turn of a session at one time: sorted by id, turn 100 came before turn 11
    params = {"sessions": 1, "turns_mean": 100000, "max_turns": 120, "think_time_s_mean": 0,
              "growth_tokens_median": 10, "growth_sigma": 0, "output_tokens_median": 10,
              "output_sigma": 0, "first_turn_tokens_median": 100, "first_turn_sigma": 0,
              "large_addition_prob": 0}  # fmt: skip
    requests = generate("agentic", params, GenContext(seed=1))
    assert len(requests) > 100
    assert [r.turn for r in requests] == list(range(1, len(requests) + 1))
