"""Trace loaders on small fixture files, including malformed rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from btb_lab.errors import UserError
from btb_lab.workload.formats import FORMATS, detect_format, load_trace
from btb_lab.workload.hashing import block_id, stable_hash63

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "workload"


def test_registry_lists_the_three_formats() -> None:
    assert list(FORMATS) == ["art-chat", "bursted-art", "mooncake"]
    with pytest.raises(UserError, match="choose one of: art-chat, bursted-art, mooncake"):
        FORMATS.get("sharegpt")


def test_mooncake_small() -> None:
    trace = load_trace(FIXTURES / "mooncake_small.jsonl", "mooncake", block_tokens=512)
    assert [r.arrival_s for r in trace.requests] == [0.0, 1.0, 1.5, 4.0]
    first = trace.requests[0]
    assert (first.input_tokens, first.output_tokens, first.block_hashes) == (1500, 10, (0, 1, 2))
    assert first.block_tokens == 512
    assert len({r.request_id for r in trace.requests}) == 4
    assert trace.bad_rows == []


@pytest.mark.parametrize(
    ("line", "field", "text"),
    [(3, "input_length", "must be ≥ 0")],
)
def test_mooncake_error_names_file_line_field(line: int, field: str, text: str) -> None:
    path = FIXTURES / "mooncake_bad.jsonl"
    with pytest.raises(UserError) as info:
        load_trace(path, "mooncake")
    assert str(info.value) == f"{path}:{line}: field '{field}': {text}"


def test_mooncake_skip_bad_rows_counts_every_problem() -> None:
    path = FIXTURES / "mooncake_bad.jsonl"
    trace = load_trace(path, "mooncake", skip_bad_rows=True)
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.1, 0.3, 0.7]
    assert len(trace.bad_rows) == 5
    joined = "\n".join(trace.bad_rows)
    assert f"{path}:3: field 'input_length': must be ≥ 0" in joined
    assert f"{path}:6: field 'output_length': missing" in joined
    assert f"{path}:7: field 'timestamp': 50 is earlier than line 4's 300 (file order" in joined
    assert f"{path}:8: field 'hash_ids': 3 ids but input_length 600" in joined
    assert f"{path}:9: not valid JSON" in joined


def test_bursted_art_small_keeps_windows_sources_sessions() -> None:
    trace = load_trace(FIXTURES / "bursted_art_small.jsonl", "bursted-art")
    by_id = {r.request_id: r for r in trace.requests}
    assert by_id["a3"].trace_id == "test-w001"
    assert by_id["a3"].source == "synthetic"
    assert by_id["b2"].source == "art"
    assert by_id["b2"].session_id == "s1"
    assert by_id["b2"].turn == 2
    assert by_id["a1"].group_id == "burst0"
    # string ids map to stable 63-bit ints; shared strings share ints
    assert by_id["a1"].block_hashes[:2] == by_id["a2"].block_hashes[:2]
    assert by_id["a1"].block_hashes[0] == stable_hash63("p0")
    assert by_id["a1"].block_hashes[2] != by_id["a2"].block_hashes[2]
    assert all(0 <= h < 2**63 for r in trace.requests for h in r.block_hashes)


def test_bursted_art_malformed_rows() -> None:
    path = FIXTURES / "bursted_art_bad.jsonl"
    with pytest.raises(UserError, match=rf"^{path}:2: field 'source': must be one of art"):
        load_trace(path, "bursted-art")
    trace = load_trace(path, "bursted-art", skip_bad_rows=True)
    assert [r.request_id for r in trace.requests] == ["a1", "b1"]
    assert len(trace.bad_rows) == 3
    assert (
        f"{path}:4: field 'arrival_s': turn 1 of session 's1' is out of order"
        in (trace.bad_rows[1])
    )
    assert trace.bad_rows[2] == f"{path}:5: field 'request_id': 'a1' repeats line 1"


def test_art_chat_jsonl_and_parquet_agree(tmp_path: Path) -> None:
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = FIXTURES / "art_chat_small.jsonl"
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    parquet = tmp_path / "art.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    from_jsonl = load_trace(jsonl, "art-chat").requests
    from_parquet = load_trace(parquet, "art-chat").requests
    assert from_jsonl == from_parquet
    assert [r.arrival_s for r in from_jsonl] == [0.0, 0.25, 0.9]
    assert from_jsonl[1].group_id == "sysA"
    assert from_jsonl[1].block_hashes == (11, 12, 13)  # integer ids stay as they are


def test_art_chat_parquet_error_names_row(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"timestamp_ms": 0, "request_id": "a", "system_prompt_hash": "s", "input_length": 10,
         "output_length": 1, "hash_ids": [1]},
        {"timestamp_ms": 5, "request_id": "b", "system_prompt_hash": "s", "input_length": -1,
         "output_length": 1, "hash_ids": [1]},
    ]  # fmt: skip
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(UserError, match=rf"{path}:2: field 'input_length': must be ≥ 0"):
        load_trace(path, "art-chat")


def test_rows_after_a_timestamp_far_ahead_name_that_row(tmp_path: Path) -> None:
    """One timestamp far ahead makes every later row "earlier"; with skip_bad_rows they
    were skipped as "earlier than the previous row's", which hid the row to mend."""
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": t, "input_length": 10, "output_length": 1, "hash_ids": [i]}
            for i, t in enumerate([0, 100, 1e12, 200, 300])]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    trace = load_trace(path, "mooncake", skip_bad_rows=True)
    assert trace.bad_rows == [
        f"{path}:{line}: field 'timestamp': {t} is earlier than line 3's 1e+12 (file order "
        "is arrival order)"
        for line, t in ((4, 200), (5, 300))
    ]


def test_art_chat_malformed_rows() -> None:
    path = FIXTURES / "art_chat_bad.jsonl"
    trace = load_trace(path, "art-chat", skip_bad_rows=True)
    assert [r.request_id for r in trace.requests] == ["c1", "c2"]
    assert trace.bad_rows == [
        (
            f"{path}:3: field 'timestamp_ms': 200 is earlier than line 2's 250 (file order "
            "is arrival order)"
        ),
        f"{path}:4: field 'request_id': 'c2' repeats line 2",
    ]


def test_missing_file_and_format_detection(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="trace file not found"):
        load_trace(tmp_path / "nope.jsonl", "mooncake")
    assert detect_format(FIXTURES / "mooncake_small.jsonl") == "mooncake"
    assert detect_format(FIXTURES / "bursted_art_small.jsonl") == "bursted-art"
    assert detect_format(FIXTURES / "art_chat_small.jsonl") == "art-chat"


def test_block_id_is_stable_and_keeps_ints() -> None:
    assert block_id(42) == 42
    # a fixed value: blake2b is the same in every process, unlike hash()
    assert block_id("p0") == stable_hash63("p0") == 972384627539537908
    assert block_id("p0") != block_id("p1")
