"""Warming spend from `warm_copy` events: copies, speculative prefill at its deepest per
repeat / target / job, and the share spent on decoy jobs."""

from __future__ import annotations

import pandas as pd
import pytest

from btb_lab.analysis.speculation import warm_spend
from btb_lab.records import EVENT_COLUMNS


def records(rows: list[tuple[str, int, str, str | None]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["variant", "repeat", "request_id", "group_id"])


def warm_events(rows: list[tuple[str, int, str, str, float, float, float]]) -> pd.DataFrame:
    """(variant, repeat, request_id, target, tokens, start_s, end_s, label implied by
    tokens' sign: negative = rdma)."""
    out = []
    for variant, repeat, rid, target, tokens, start, end in rows:
        out.append({
            "variant": variant, "repeat": repeat, "time_s": start, "kind": "warm_copy",
            "instance": target, "peer": "", "request_id": rid, "value": abs(tokens),
            "end_s": end, "label": "rdma" if tokens < 0 else "prefill", "origin": "policy",
        })  # fmt: skip
    return pd.DataFrame(out, columns=list(EVENT_COLUMNS))


def test_chunks_count_at_their_deepest_and_decoys_are_small_jobs() -> None:
    burst = [("v", 0, f"b{i}", "burst") for i in range(20)]
    decoy = [("v", 0, f"d{i}", "decoy") for i in range(3)]
    recs = records([*burst, *decoy, ("v", 0, "lone", None)])
    events = warm_events([
        ("v", 0, "b1", "C1", 1024, 0.0, 0.1),  # first chunk of the burst on C1
        ("v", 0, "b2", "C1", 2048, 0.2, 0.4),  # the same prefill, deeper
        ("v", 0, "b2", "C2", 2048, 0.2, 0.4),
        ("v", 0, "d0", "C1", 1024, 1.0, 1.1),  # a decoy's first (and only) chunk
        ("v", 0, "lone", "C3", 512, 2.0, 2.05),  # no job: a one-request decoy
        ("v", 0, "b3", "C0", -4096, 0.5, 0.6),  # an RDMA copy
    ])  # fmt: skip
    spend = warm_spend(events, recs, ["v", "other"])
    v = spend["v"]
    assert (v.copies, v.copy_tokens, v.prefills) == (1, 4096, 5)
    assert v.prefill_tokens == 2048 + 2048 + 1024 + 512
    assert v.prefill_s == pytest.approx(0.2 + 0.2 + 0.1 + 0.05)
    assert v.decoy_prefill_tokens == 1024 + 512
    assert v.decoy_prefill_s == pytest.approx(0.15)
    assert spend["other"].prefills == 0


def test_repeats_are_charged_separately_and_job_size_is_per_repeat() -> None:
    recs = records([("v", 0, f"r{i}", "job") for i in range(12)] + [("v", 1, "r0", "job")])
    events = warm_events([("v", 0, "r0", "C1", 1000, 0, 1), ("v", 1, "r0", "C1", 1000, 0, 1)])
    v = warm_spend(events, recs, ["v"], decoy_max_requests=10)["v"]
    assert v.prefill_tokens == 2000  # the same job and target in two repeats: twice
    assert v.decoy_prefill_tokens == 1000  # 12 requests in repeat 0, 1 in repeat 1


def test_no_events_no_spend() -> None:
    empty = pd.DataFrame(columns=list(EVENT_COLUMNS))
    spend = warm_spend(empty, records([("v", 0, "a", None)]), ["v"])
    assert spend["v"].prefills == spend["v"].copies == 0
