"""Fitting an engine profile to measured points: small non-negative least squares per cost
(prefill, decode step, KV transfer), with points held out of the fit to report how well the
fitted model predicts points it has not seen.

The models are those of `btb_lab.model.profile`; each coefficient is a cost, so the fit is
constrained to non-negative values (with three or four terms, every subset of terms is
tried and the best non-negative solution kept: exact NNLS at this size).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from btb_lab.model.profile import DecodeFit, FitQuality, PrefillFit, TransferFit

__all__ = [
    "DecodePoint",
    "PrefillPoint",
    "TransferPoint",
    "fit_decode",
    "fit_prefill",
    "fit_transfer",
    "nnls_small",
    "split_holdout",
]


@dataclass(frozen=True)
class PrefillPoint:
    """Time to the first token of an isolated request: `tokens` new on top of `cached`."""

    tokens: int
    cached: int
    seconds: float


@dataclass(frozen=True)
class DecodePoint:
    """Mean decode step time with `batch` sequences holding `context_tokens` in all."""

    batch: int
    context_tokens: float
    seconds: float


@dataclass(frozen=True)
class TransferPoint:
    tokens: int
    seconds: float


def nnls_small(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x − b|| over x ≥ 0, by trying every subset of columns (a has ≤ 6)."""
    n = a.shape[1]
    best = np.zeros(n)
    best_res = float(np.sum(b**2))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = a[:, cols]
            x, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(x < 0):
                continue
            res = float(np.sum((sub @ x - b) ** 2))
            if res < best_res - 1e-18:
                best_res = res
                best = np.zeros(n)
                best[list(cols)] = x
    return best


def split_holdout(n: int, every: int = 4) -> tuple[list[int], list[int]]:
    """(fit, holdout) indices: every `every`-th point (from the second) is held out."""
    hold = [i for i in range(n) if every > 0 and i % every == 1 and n >= 2 * every]
    fit = [i for i in range(n) if i not in set(hold)]
    return fit, hold


def _quality(a: np.ndarray, b: np.ndarray, x: np.ndarray, fit: list[int], hold: list[int]
             ) -> FitQuality:  # fmt: skip
    pred = a @ x
    rel = np.abs(pred - b) / np.maximum(np.abs(b), 1e-12)
    return FitQuality(
        points=len(fit),
        holdout_points=len(hold),
        mape=float(rel[fit].mean()),
        holdout_mape=float(rel[hold].mean()) if hold else None,
        max_abs_error_s=float(np.abs(pred - b)[fit].max()),
    )


def _fit(a: np.ndarray, b: np.ndarray, holdout_every: int) -> tuple[np.ndarray, FitQuality]:
    fit, hold = split_holdout(len(b), holdout_every)
    # relative weighting: every point counts by its relative error, not its size in seconds
    w = 1.0 / np.maximum(np.abs(b), 1e-12)
    x = nnls_small(a[fit] * w[fit, None], b[fit] * w[fit])
    return x, _quality(a, b, x, fit, hold)


def fit_prefill(points: Sequence[PrefillPoint], *, holdout_every: int = 4) -> PrefillFit:
    """fixed + per_token · n + per_token_context · n (c + n/2) + per_cached_token · c."""
    n = np.array([p.tokens for p in points], dtype=float)
    c = np.array([p.cached for p in points], dtype=float)
    a = np.column_stack([np.ones_like(n), n, n * (c + n / 2), c])
    b = np.array([p.seconds for p in points], dtype=float)
    x, quality = _fit(a, b, holdout_every)
    return PrefillFit(
        fixed_s=float(x[0]), per_token_s=float(x[1]), per_token_context_s=float(x[2]),
        per_cached_token_s=float(x[3]), quality=quality,
    )  # fmt: skip


def fit_decode(points: Sequence[DecodePoint], *, holdout_every: int = 4) -> DecodeFit:
    """fixed + per_seq · batch + per_context_token · context."""
    bsz = np.array([p.batch for p in points], dtype=float)
    k = np.array([p.context_tokens for p in points], dtype=float)
    a = np.column_stack([np.ones_like(bsz), bsz, k])
    b = np.array([p.seconds for p in points], dtype=float)
    x, quality = _fit(a, b, holdout_every)
    return DecodeFit(
        fixed_s=float(x[0]), per_seq_s=float(x[1]), per_context_token_s=float(x[2]),
        quality=quality,
    )  # fmt: skip


def fit_transfer(points: Sequence[TransferPoint], *, holdout_every: int = 4) -> TransferFit:
    """fixed + per_token · n."""
    n = np.array([p.tokens for p in points], dtype=float)
    a = np.column_stack([np.ones_like(n), n])
    b = np.array([p.seconds for p in points], dtype=float)
    x, quality = _fit(a, b, holdout_every)
    return TransferFit(fixed_s=float(x[0]), per_token_s=float(x[1]), quality=quality)
