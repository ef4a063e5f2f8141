"""What warming cost a variant, and how much of its speculative prefill went to decoys.

Reads the run's `warm_copy` events (the policy's decisions on the simulator, the router's
copies on a cluster) and the request records. A speculative prefill is charged once per
repeat, target instance and job (the `group_id` of the request that asked for it) at its
deepest: chunked prefill extends one prefill, and each chunk's event names the depth so
far. A job with at most `DECOY_MAX_REQUESTS` requests in its repeat is a decoy, a burst
that never came (Bursted-ART's decoy jobs have 3; its bursts hundreds).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from btb_lab.analysis.models import WarmSpend

__all__ = ["DECOY_MAX_REQUESTS", "warm_spend"]

DECOY_MAX_REQUESTS = 10


def warm_spend(
    events: pd.DataFrame,
    records: pd.DataFrame,
    variants: Sequence[str],
    *,
    decoy_max_requests: int = DECOY_MAX_REQUESTS,
) -> dict[str, WarmSpend]:
    """Per variant: RDMA copies and speculative prefills, tokens and seconds, and the
    prefill spent on decoy jobs."""
    out = {name: WarmSpend(decoy_max_requests=decoy_max_requests) for name in variants}
    if events.empty or "kind" not in events.columns:
        return out
    warm = events[events["kind"] == "warm_copy"]
    if warm.empty:
        return out
    jobs = records[["variant", "repeat", "request_id", "group_id"]].copy()
    jobs["job"] = jobs["group_id"].where(jobs["group_id"].notna(), jobs["request_id"])
    sizes = jobs.groupby(["variant", "repeat", "job"])["request_id"].transform("size")
    jobs["job_requests"] = sizes
    warm = warm.merge(
        jobs[["variant", "repeat", "request_id", "job", "job_requests"]],
        on=["variant", "repeat", "request_id"],
        how="left",
    )
    warm["job"] = warm["job"].fillna(warm["request_id"])
    warm["job_requests"] = warm["job_requests"].fillna(1).astype(int)
    warm["seconds"] = (warm["end_s"].astype(float) - warm["time_s"].astype(float)).fillna(0.0)
    for name, rows in warm.groupby("variant", sort=False):
        if str(name) not in out:
            continue
        copies = rows[rows["label"] == "rdma"]
        prefills = rows[rows["label"] == "prefill"]
        spend = out[str(name)]
        spend.copies = len(copies)
        spend.copy_tokens = int(copies["value"].sum())
        spend.prefills = len(prefills)
        if prefills.empty:
            continue
        deepest = prefills.groupby(["repeat", "instance", "job"], sort=False).agg(
            tokens=("value", "max"),
            seconds=("seconds", "max"),
            job_requests=("job_requests", "max"),
        )
        decoy = deepest["job_requests"].to_numpy() <= decoy_max_requests
        spend.prefill_tokens = int(deepest["tokens"].sum())
        spend.prefill_s = float(deepest["seconds"].sum())
        spend.decoy_prefill_tokens = int(deepest["tokens"].to_numpy()[decoy].sum())
        spend.decoy_prefill_s = float(np.asarray(deepest["seconds"].to_numpy())[decoy].sum())
    return out
