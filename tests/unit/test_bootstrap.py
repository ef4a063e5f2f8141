"""The paired bootstrap's draws: exact in distribution against resampling rows by index,
whatever the window around the quantile; the normal approximation where it is used."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from btb_lab.analysis import bootstrap
from btb_lab.analysis.bootstrap import paired_draws
from btb_lab.analysis.metrics import latency_stat


def _by_index(base, var, sizes, samples, seed, stat):
    """The plain two-stage bootstrap: repeats, then rows, drawn by index."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    out = []
    for _ in range(samples):
        picks = rng.integers(0, len(sizes), len(sizes)) if len(sizes) >= 2 else range(len(sizes))
        rows = np.concatenate([offsets[r] + rng.integers(0, sizes[r], sizes[r]) for r in picks])
        b, v = stat(base[rows]), stat(var[rows])
        out.append((v - b) / b)
    out = np.array(out)
    return out[np.isfinite(out)]


def _split(column, sizes):
    return np.split(column[:, None], np.cumsum(sizes)[:-1])


@pytest.mark.parametrize("window", ["default", "none"])
def test_percentile_draws_match_the_exact_distribution(window, monkeypatch) -> None:
    # four requests, one failed in the variant: every resample's p90 change enumerated
    if window == "none":  # every resample goes through the exact refinement of the cells
        monkeypatch.setattr(bootstrap, "_WINDOW_SIGMAS", 0.0)
        monkeypatch.setattr(bootstrap, "_WINDOW_PAD", 0)
    base = np.array([1.0, 2.0, 3.0, 4.0])
    var = np.array([2.0, np.nan, 1.0, 5.0])
    exact: Counter[float] = Counter()
    for rows in itertools.product(range(4), repeat=4):
        b, v = latency_stat(base[list(rows)], "p90"), latency_stat(var[list(rows)], "p90")
        if np.isfinite(v):
            exact[round((v - b) / b, 12)] += 1
    samples = 20_000
    draws = paired_draws([base[:, None]], [var[:, None]], "latency", 90.0, samples=samples,
                         rng=np.random.default_rng(5))  # fmt: skip
    assert draws.method == "window"
    seen = Counter(round(float(x), 12) for x in draws.values)
    assert set(seen) <= set(exact)
    for value, count in exact.items():
        assert seen[value] / samples == pytest.approx(count / 4**4, abs=0.012)


@pytest.mark.parametrize(
    ("sizes", "q", "window"),
    [
        ([300], 50.0, "default"),
        ([300], 99.0, "default"),
        ([200, 250, 180], 90.0, "default"),
        ([200, 250, 180], 90.0, "none"),
    ],
)
def test_percentile_draws_agree_with_resampling_by_index(sizes, q, window, monkeypatch) -> None:
    if window == "none":
        monkeypatch.setattr(bootstrap, "_WINDOW_SIGMAS", 0.0)
        monkeypatch.setattr(bootstrap, "_WINDOW_PAD", 0)
    rng = np.random.default_rng(1)
    n = sum(sizes)
    base = rng.lognormal(0, 1, n)
    var = base * rng.lognormal(-0.1, 0.3, n)
    var[rng.random(n) < 0.1] = np.nan
    fast = paired_draws(_split(base, sizes), _split(var, sizes), "latency", q, samples=2000,
                        rng=np.random.default_rng(3)).values  # fmt: skip
    slow = _by_index(base, var, sizes, 2000, 4, lambda x: latency_stat(x, f"p{q:g}"))
    # two independent Monte Carlo samples of one distribution: quantiles agree to a small
    # share of its spread
    spread = np.percentile(slow, 97.5) - np.percentile(slow, 2.5)
    for level in (2.5, 50, 97.5):
        assert np.percentile(fast, level) == pytest.approx(
            np.percentile(slow, level), abs=0.08 * spread
        )


def test_ok_rate_cells_agree_with_resampling_by_index() -> None:
    rng = np.random.default_rng(2)
    sizes = [400, 300]
    base = (rng.random(700) < 0.95).astype(float)
    var = (rng.random(700) < 0.9).astype(float)
    var[:20] = np.nan  # never sent by the variant
    fast = paired_draws(_split(base, sizes), _split(var, sizes), "ok_rate", None, samples=4000,
                        rng=np.random.default_rng(3))  # fmt: skip
    assert fast.method == "cells"

    def rate(x):
        sent = x[~np.isnan(x)]
        return sent.mean()

    slow = _by_index(base, var, sizes, 4000, 4, rate)
    for level in (2.5, 50, 97.5):
        assert np.percentile(fast.values, level) == pytest.approx(
            np.percentile(slow, level), abs=0.006
        )


@pytest.mark.parametrize("sizes", [[5000], [2000, 1500, 1500]])
def test_normal_approximation_of_means_is_close_and_labelled(sizes) -> None:
    rng = np.random.default_rng(2)
    n = sum(sizes)
    base = rng.lognormal(0, 1, n)
    var = base * rng.lognormal(-0.1, 0.3, n)
    var[rng.random(n) < 0.05] = np.nan
    args = (_split(base, sizes), _split(var, sizes), "latency", None)
    rows = paired_draws(*args, samples=4000, rng=np.random.default_rng(1))
    normal = paired_draws(*args, samples=4000, rng=np.random.default_rng(1), exact_limit=0)
    assert rows.method == "rows"
    assert normal.method == "normal"
    for level in (2.5, 50, 97.5):
        assert np.percentile(normal.values, level) == pytest.approx(
            np.percentile(rows.values, level), abs=0.003
        )


def _flat_uniform_counts(picks: np.ndarray, n_rows: int, rng: np.random.Generator) -> np.ndarray:
    """The counting `_uniform_counts` replaced: one flat bincount over every resample."""
    samples, total = picks.size, int(picks.sum())
    if n_rows == 0 or total == 0:
        return np.zeros((samples, n_rows), dtype=np.int64)
    owner = np.repeat(np.arange(samples, dtype=np.int64), picks)
    flat = owner * n_rows + rng.integers(0, n_rows, total)
    return np.bincount(flat, minlength=samples * n_rows).astype(np.int32).reshape(samples, -1)


def test_uniform_counts_are_the_flat_counts_from_the_same_draws() -> None:
    """Counted a resample at a time (a third of the memory), the same counts, dtype and
    generator state after: every interval and verdict stays what it was."""
    g = np.random.default_rng(5)
    for _ in range(200):
        samples, n_rows = int(g.integers(1, 50)), int(g.integers(0, 40))
        picks = g.integers(0, 30, samples) * (g.random(samples) < 0.8)
        seed = int(g.integers(0, 1 << 30))
        mine, theirs = np.random.default_rng(seed), np.random.default_rng(seed)
        got = bootstrap._uniform_counts(picks, n_rows, mine)
        want = _flat_uniform_counts(picks, n_rows, theirs)
        assert got.dtype == want.dtype
        assert np.array_equal(got, want)
        assert mine.integers(1 << 40) == theirs.integers(1 << 40)


def test_a_repeat_drawn_k_times_is_k_draws_of_its_own_length() -> None:
    """A GPU resample that drew a repeat twice drew twice its time samples into one
    statistic: a longer draw, so a smaller imbalance than any one repeat shows, and an
    interval that is neither the point value's nor its spread's. Each draw now has the
    repeat's length: the mean stays the one-draw mean and the spread shrinks as 1/√k."""
    from btb_lab.analysis.bootstrap import _gpu_side

    unit = np.random.default_rng(0).uniform(0.05, 1.0, (6, 2))  # 6 samples of 2 instances
    draws = {k: _gpu_side([unit], np.full((20_000, 1), k), "imbalance",
                          np.random.default_rng(1)) for k in (1, 4)}  # fmt: skip
    assert abs(draws[4].mean() - draws[1].mean()) < 0.02
    assert draws[4].std() == pytest.approx(draws[1].std() / 2, rel=0.1)
