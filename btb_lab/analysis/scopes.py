"""Which requests a metric or a verdict covers: warmup / cooldown exclusion and pools.

Both are read off workload fields every backend stamps the same way — the target send
time (`arrival_s`) and the request's `source` — so a simulator run and a real run of one
hypothesis exclude the same requests and pool them alike, and every variant of a repeat
keeps the same requests (pairing is preserved).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from btb_lab.analysis.models import Exclusion
from btb_lab.config.hypothesis import Exclude

__all__ = [
    "apply_exclusion",
    "common_arrivals",
    "in_pool",
    "measured_window",
    "rows_where",
    "variant_rows",
]


def _window_mask(rows: pd.DataFrame, rule: Exclude) -> np.ndarray:
    arrival = rows["arrival_s"].to_numpy(dtype=float)
    keep = np.ones(len(rows), dtype=bool)
    if len(rows) == 0:
        return keep
    if rule.first_s or rule.last_s:
        start, end = float(np.nanmin(arrival)), float(np.nanmax(arrival))
        keep &= (arrival >= start + rule.first_s) & (arrival <= end - rule.last_s)
    if rule.first_requests or rule.last_requests:
        order = np.lexsort((rows["request_id"].astype(str).to_numpy(), arrival))
        rank = np.empty(len(rows), dtype=np.int64)
        rank[order] = np.arange(len(rows))
        keep &= (rank >= rule.first_requests) & (rank < len(rows) - rule.last_requests)
    return keep


def measured_window(rows: pd.DataFrame, rule: Exclude | None) -> tuple[float, float] | None:
    """(first, last) arrival time of the requests one repeat keeps; None without a rule."""
    if rule is None or not rule.active or len(rows) == 0:
        return None
    kept = rows["arrival_s"].to_numpy(dtype=float)[_window_mask(rows, rule)]
    if kept.size == 0:
        return (np.inf, -np.inf)
    return float(kept.min()), float(kept.max())


def apply_exclusion(
    records: pd.DataFrame, util: pd.DataFrame, rule: Exclude | None
) -> tuple[pd.DataFrame, pd.DataFrame, Exclusion | None]:
    """Records and utilization samples inside each repeat's measured window, and what was
    left out. Requests are kept by arrival time (or rank); utilization samples by whether
    their time falls between the first and last kept arrival of their variant × repeat."""
    if rule is None or not rule.active or records.empty:
        return records, util, None
    keep = np.zeros(len(records), dtype=bool)
    windows: dict[tuple[str, int], tuple[float, float]] = {}
    groups: dict[Any, Any] = records.groupby(["variant", "repeat"], sort=False).indices
    for (variant, repeat), where in groups.items():
        rows = records.iloc[where]
        mask = _window_mask(rows, rule)
        keep[where] = mask
        kept = rows["arrival_s"].to_numpy(dtype=float)[mask]
        windows[(str(variant), int(repeat))] = (
            (float(kept.min()), float(kept.max())) if kept.size else (np.inf, -np.inf)
        )
    kept_records = records[keep]
    excluded = records[~keep]
    if not util.empty:
        lo = np.array([windows.get((str(v), int(r)), (np.inf, -np.inf))[0]
                       for v, r in zip(util["variant"], util["repeat"], strict=True)])  # fmt: skip
        hi = np.array([windows.get((str(v), int(r)), (np.inf, -np.inf))[1]
                       for v, r in zip(util["variant"], util["repeat"], strict=True)])  # fmt: skip
        t = util["time_s"].to_numpy(dtype=float)
        util = util[(t >= lo) & (t <= hi)]

    def counts(frame: pd.DataFrame) -> dict[str, int]:
        return {str(k): int(v) for k, v in frame.groupby("variant", sort=False).size().items()}

    summary = Exclusion(
        first_s=rule.first_s, last_s=rule.last_s, first_requests=rule.first_requests,
        last_requests=rule.last_requests, excluded=counts(excluded), kept=counts(kept_records),
    )  # fmt: skip
    return kept_records, util, summary


def common_arrivals(
    records: pd.DataFrame, util: pd.DataFrame, variants: list[str]
) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, int] | None, bool]:
    """The records of `variants` cut, in each repeat, to the requests that arrived before
    the first one some variant did not record (every variant recorded all of those), their
    GPU samples to the time all of them covered; then the requests each variant recorded
    before the cut (None if no request was cut) and whether samples were cut.

    In a run stopped part-way a variant holds only the workload's first requests: beside
    another's whole workload its figures would measure how far the run got, not the
    variant. Nor are the requests it happened to record enough: a record is written when
    its request ends, so those still waiting when the run stopped, its slowest, would be
    missing from the comparison. Which requests are compared follows arrival only."""
    rows = records[records["variant"].isin(variants)]
    recorded: dict[str, int] | None = None
    if not rows.empty:
        key = ["repeat", "request_id"]
        every = rows.groupby(key, sort=False)["variant"].transform("nunique") == len(variants)
        if not bool(every.all()):
            counts = rows["variant"].value_counts()
            recorded = {v: int(counts.get(v, 0)) for v in variants}
            lacking = rows.loc[~every.to_numpy(), ["repeat", "arrival_s"]]
            first_lacking = lacking.groupby("repeat")["arrival_s"].min()
            limit = rows["repeat"].map(first_lacking).to_numpy(dtype=float)
            before = ~(rows["arrival_s"].to_numpy(dtype=float) >= limit)  # NaN: none lacking
            rows = rows[every.to_numpy() & before]
    samples, samples_cut = util, False
    if not util.empty and {"variant", "repeat", "time_s"} <= set(util.columns):
        samples = util[util["variant"].isin(variants)]
        ends = samples.groupby(["repeat", "variant"], sort=False)["time_s"].max().unstack()
        all_sampled = ends.shape[1] == len(variants)  # else a variant has none: none kept
        end_s: pd.Series = ends.min(axis=1) if all_sampled else ends.iloc[:, 0] * np.nan
        limit = samples["repeat"].map(end_s).to_numpy(dtype=float)
        inside = samples["time_s"].to_numpy(dtype=float) <= limit  # NaN limit: none kept
        if not inside.all():
            samples, samples_cut = samples[inside], True
    return rows, samples, recorded, samples_cut


def in_pool(records: pd.DataFrame, pool: str | None) -> pd.DataFrame:
    """The records of one pool (requests whose `source` is `pool`), or all of them."""
    if pool is None:
        return records
    return records[records["source"].astype(str) == pool]


def variant_rows(
    records: pd.DataFrame, variant: str, columns: list[str], repeat: int | None = None
) -> pd.DataFrame:
    """One variant's records (of one repeat, when given), only those of `columns` the
    frame has: a mask over the whole frame would copy all ~30 columns of a million-row
    run for the few a statistic reads."""
    mask = (records["variant"] == variant).to_numpy()
    if repeat is not None:
        mask = mask & (records["repeat"] == repeat).to_numpy()
    return records.loc[mask, [c for c in dict.fromkeys(columns) if c in records.columns]]


def rows_where(frame: pd.DataFrame, mask: Any) -> pd.DataFrame:
    """`frame[mask]`, or `frame` itself when the mask keeps every row (one repeat, every
    request ok): selecting all of a million rows would copy them for nothing. Callers
    only read the result."""
    keep = np.asarray(mask, dtype=bool)
    return frame if keep.all() else frame[keep]
