"""The burst audit: 2 on the shipped Mooncake conversation trace, burst size on Bursted."""

from __future__ import annotations

from pathlib import Path

import pytest

from btb_lab.records import Request
from btb_lab.workload.audit import burst_audit, prefix_fanout
from btb_lab.workload.formats import load_trace
from btb_lab.workload.generators import GenContext, generate

REPO = Path(__file__).resolve().parents[2]
CONVERSATION = REPO.parent / "shared" / "traces" / "mooncake_conversation.jsonl"


def test_conversation_trace_deep_fanout_is_two() -> None:
    if not CONVERSATION.exists():
        pytest.skip(f"shared Mooncake trace not found at {CONVERSATION}")
    trace = load_trace(CONVERSATION, "mooncake", block_tokens=512)
    audit = burst_audit(trace.requests)
    assert audit.deep.max_fanout == 2  # the seed's published audit
    assert audit.deep.events >= 1
    assert audit.shallow.max_fanout >= audit.deep.max_fanout


@pytest.mark.parametrize("burst_size", [25, 120])
def test_generated_bursted_fanout_equals_burst_size(burst_size: int) -> None:
    params = {
        "windows": 3,
        "burst_size": burst_size,
        "prefix_tokens": 16384,
        "decoys_per_window": 4,
        "background_rate_per_s": 1.0,
    }
    requests = generate("bursted", params, GenContext(seed=2))
    audit = burst_audit(requests)
    assert audit.deep.max_fanout == burst_size
    assert audit.shallow.max_fanout == burst_size
    assert audit.deep.events >= 3  # one per window at least
    assert audit.deep.largest_group is not None
    assert "-burst0" in audit.deep.largest_group


def _r(rid: str, t: float, hashes: tuple[int, ...], session: str | None = None) -> Request:
    return Request(rid, t, len(hashes) * 512, 1, block_hashes=hashes, session_id=session)


def test_window_depth_and_sessions() -> None:
    deep = tuple(range(16))
    requests = [
        _r("a", 0.0, deep),
        _r("b", 4.0, deep),
        _r("c", 10.0, deep),  # within 10 s of a: fan-out 3
        _r("d", 10.5, deep),  # a drops out: b, c, d → 3
        _r("e", 30.0, deep, "s1"),
        _r("f", 31.0, (*deep, 99), "s1"),  # same session: counts once
        _r("g", 50.0, tuple(range(15))),  # too shallow for the deep audit
    ]
    result = prefix_fanout(requests, depth_blocks=16, window_s=10.0)
    assert result.max_fanout == 3
    # anchored windows: [a, b, c] is an event; [d] alone and [e, f] (one session) are not
    assert result.events == 1
    unsessioned = [_r(r.request_id, r.arrival_s, r.block_hashes) for r in requests]
    assert prefix_fanout(unsessioned, depth_blocks=16, window_s=10.0).events == 2
    shallow = prefix_fanout(requests, depth_blocks=8, window_s=60.0)
    assert shallow.max_fanout == 6  # a–d, session s1 once, g shares 8 leading blocks
