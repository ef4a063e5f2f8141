"""Repeats that replayed an earlier one exactly: found, so they count once.

A plain trace replayed on the deterministic simulator gives every repeat the same records;
counted as new evidence, each copy would narrow the interval (4 copies: by half) and could
turn INCONCLUSIVE into VALIDATED with nothing learnt.
"""

from __future__ import annotations

import hashlib
from typing import cast

import pandas as pd

__all__ = ["distinct_repeats", "same_repeats_text"]


def distinct_repeats(
    records: pd.DataFrame, util: pd.DataFrame
) -> tuple[pd.DataFrame, pd.DataFrame, dict[int, int]]:
    """The records and samples of the repeats that differ from every earlier one, and
    {later repeat: the earlier one it equals}. A plain trace replayed on the deterministic
    simulator gives every repeat the same records; counted as new evidence, each copy
    would narrow the interval (4 copies: by half) and could turn INCONCLUSIVE into
    VALIDATED with nothing learnt."""
    if records.empty or records["repeat"].nunique() < 2:
        return records, util, {}
    # two repeats ran alike when every typed column but the repeat agrees, row by row
    # (object columns hold dicts or None: `extra`, `error`)
    columns = [c for c in records.columns if c != "repeat" and records[c].dtype != object]
    first: dict[bytes, int] = {}
    same: dict[int, int] = {}
    for label, rows in records.groupby("repeat", sort=True):
        repeat = int(cast("int", label))
        hashed = pd.util.hash_pandas_object(rows[columns], index=False).to_numpy()
        key = hashlib.blake2b(hashed.tobytes(), digest_size=16).digest()
        if key in first:
            same[repeat] = first[key]
        else:
            first[key] = repeat
    if not same:
        return records, util, {}
    kept = list(first.values())
    if not util.empty and "repeat" in util.columns:
        util = util[util["repeat"].isin(kept)]
    return records[records["repeat"].isin(kept)], util, same


def same_repeats_text(same: dict[int, int]) -> str:
    pairs = ", ".join(f"{later + 1} = {earlier + 1}" for later, earlier in same.items())
    return (
        f"repeats that replayed an earlier one exactly count once (repeat {pairs}): a "
        "trace replayed as it is gives the simulator nothing new; workload.variation "
        "(arrival_jitter_s, resample_windows) makes repeats that measure workload variance"
    )
