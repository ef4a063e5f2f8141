"""`trace fetch` against recorded datasets-server responses: paging, resume, offline."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from btb_lab.errors import UserError
from btb_lab.workload.fetch import count_complete_rows, fetch_rows
from btb_lab.workload.formats import load_trace

RECORDED = json.loads(
    (
        Path(__file__).resolve().parents[1] / "fixtures" / "workload" / "hf_rows_bursted_art.json"
    ).read_text()
)


class Recorded:
    """Serves the recorded pages and remembers what was asked."""

    def __init__(self) -> None:
        self.calls: list[dict[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        params = dict(request.url.params)
        self.calls.append(params)
        assert request.url.path == "/rows"
        assert params["dataset"] == RECORDED["dataset"]
        offset, length = int(params["offset"]), int(params["length"])
        page = json.loads(json.dumps(RECORDED["pages"][str(offset - offset % 2)]))
        page["rows"] = [r for r in page["rows"] if offset <= r["row_idx"] < offset + length]
        return httpx.Response(200, json=page)


def _client(handler: Recorded) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler))


def test_pages_all_rows_into_a_loadable_trace(tmp_path: Path) -> None:
    out = tmp_path / "bursted.jsonl"
    handler = Recorded()
    progress: list[tuple[int, int | None]] = []
    result = fetch_rows(
        RECORDED["dataset"], out, client=_client(handler), page_rows=2,
        on_progress=lambda done, total: progress.append((done, total)),
    )  # fmt: skip
    assert [c["offset"] for c in handler.calls] == ["0", "2", "4"]
    assert {c["config"] for c in handler.calls} == {"default"}
    assert (result.fetched_rows, result.total_rows) == (5, 5)
    assert progress[-1] == (5, 5)
    trace = load_trace(out, "bursted-art")
    assert [r.request_id for r in trace.requests] == ["r0", "r1", "r2", "r3", "r4"]


def test_rows_and_offset_limit_the_range(tmp_path: Path) -> None:
    out = tmp_path / "part.jsonl"
    handler = Recorded()
    result = fetch_rows(
        RECORDED["dataset"], out, client=_client(handler), rows=2, offset=1, page_rows=2
    )
    assert result.fetched_rows == 2
    assert [json.loads(line)["request_id"] for line in out.read_text().splitlines()] == [
        "r1", "r2",
    ]  # fmt: skip


def test_resume_continues_after_complete_rows(tmp_path: Path) -> None:
    out = tmp_path / "resume.jsonl"
    fetch_rows(RECORDED["dataset"], out, client=_client(Recorded()), rows=3, page_rows=2)
    with out.open("a") as handle:  # an interrupted write leaves a torn line behind
        handle.write('{"arrival_s": 3.0, "trace_')
    handler = Recorded()
    result = fetch_rows(RECORDED["dataset"], out, client=_client(handler), page_rows=2)
    assert result.existing_rows == 3
    assert result.fetched_rows == 2
    # the file's last row checked against the source, then paging after it
    assert [(c["offset"], c["length"]) for c in handler.calls[:2]] == [("2", "1"), ("3", "2")]
    assert count_complete_rows(out) == 5
    ids = [json.loads(line)["request_id"] for line in out.read_text().splitlines()]
    assert ids == ["r0", "r1", "r2", "r3", "r4"]


def test_offline_error_is_one_clear_line(tmp_path: Path) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Name or service not known", request=request)

    client = httpx.Client(transport=httpx.MockTransport(refuse))
    with pytest.raises(UserError) as info:
        fetch_rows("shreybirmiwal/Bursted-ART", tmp_path / "x.jsonl", client=client)
    message = str(info.value)
    assert "\n" not in message
    assert "cannot reach https://datasets-server.huggingface.co" in message
    assert "offline" in message


def test_http_error_names_dataset(tmp_path: Path) -> None:
    def missing(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": "The dataset does not exist."})

    client = httpx.Client(transport=httpx.MockTransport(missing))
    with pytest.raises(UserError, match=r"answered 404 for nobody/none .*does not exist"):
        fetch_rows("nobody/none", tmp_path / "x.jsonl", client=client)


def _offline() -> httpx.Client:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Name or service not known", request=request)

    return httpx.Client(transport=httpx.MockTransport(refuse))


def test_a_failed_fetch_leaves_an_existing_file_as_it_was(tmp_path: Path) -> None:
    # the torn last line was cut before the first request: offline, the file lost its end
    out = tmp_path / "resume.jsonl"
    out.write_text('{"arrival_s": 0.0}\n{"arrival_s": 1.0, "tra', encoding="utf-8")
    before = out.read_bytes()
    with pytest.raises(UserError, match="offline"):
        fetch_rows(RECORDED["dataset"], out, client=_offline())
    assert out.read_bytes() == before
    with pytest.raises(UserError, match="offline"):  # nor is a new one left empty
        fetch_rows(RECORDED["dataset"], tmp_path / "new.jsonl", client=_offline())
    assert not (tmp_path / "new.jsonl").exists()


@pytest.mark.parametrize(
    "content",
    [b"PAR1\x00\x01binary\x00PAR1", b"PAR1\n\x00binary\nPAR1", b"line one\nnotes, no newline"],
)
def test_a_file_that_is_not_an_earlier_fetch_is_refused_untouched(
    tmp_path: Path, content: bytes
) -> None:
    out = tmp_path / "trace.parquet"
    out.write_bytes(content)
    with pytest.raises(UserError, match=r"exists and (is not rows of JSON|holds no complete)"):
        fetch_rows(RECORDED["dataset"], out, client=_client(Recorded()))
    assert out.read_bytes() == content


def test_a_resume_from_another_source_is_refused_untouched(tmp_path: Path) -> None:
    # rows 0-2 fetched; resuming with --offset 1 would append rows 4.. after row 2
    out = tmp_path / "resume.jsonl"
    fetch_rows(RECORDED["dataset"], out, client=_client(Recorded()), rows=3, page_rows=2)
    before = out.read_bytes()
    with pytest.raises(UserError, match=r"its last row is not row 3 of .* another fetch"):
        fetch_rows(RECORDED["dataset"], out, client=_client(Recorded()), offset=1)
    other = tmp_path / "other.jsonl"  # rows of something else entirely
    other.write_text('{"timestamp": 0, "input_length": 5}\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"its last row is not row 0 of"):
        fetch_rows(RECORDED["dataset"], other, client=_client(Recorded()))
    assert out.read_bytes() == before
    # the same options resume, and a file already holding every asked row asks nothing
    assert fetch_rows(RECORDED["dataset"], out, client=_client(Recorded())).fetched_rows == 2
    handler = Recorded()
    assert fetch_rows(RECORDED["dataset"], out, client=_client(handler), rows=5).fetched_rows == 0
    assert handler.calls == []
