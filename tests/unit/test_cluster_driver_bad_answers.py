"""A server's answers of the wrong shape fail their request with a named error; they
never lose its record (found by probing the cluster backend against misbehaving
servers, 2026-12-07: a JSON list as a stream event raised inside the request's task, the
driver swallowed it, and the run read complete with those requests missing)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from btb_lab.cluster.driver import LoadDriver, RunClock, StreamResult, stream_completion
from btb_lab.records import Request, RequestRecord

URL = "http://server/v1/completions"


def _answer(events: list[object]) -> StreamResult:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body.encode(),
                              headers={"content-type": "text/event-stream"})  # fmt: skip

    async def go() -> StreamResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            return await stream_completion(client, URL, {"stream": True}, RunClock())

    return asyncio.run(go())


TOKEN = {"choices": [{"text": "x", "index": 0}]}


@pytest.mark.parametrize(
    ("events", "detail"),
    [
        ([TOKEN, [1, 2, 3]], "[1, 2, 3]"),
        ([TOKEN, "x"], '"x"'),
        ([{"choices": ["x"]}], "a choice is a JSON str, not an object"),
    ],
)
def test_an_event_of_the_wrong_shape_fails_the_request(events: list[object], detail: str) -> None:
    result = _answer(events)
    assert not result.ok
    assert result.error == "BadResponse:TypeError"
    assert result.detail == detail


def test_usage_counts_that_are_not_counts_are_not_taken() -> None:
    usage = {"prompt_tokens": "many", "completion_tokens": 2.5,
             "prompt_tokens_details": {"cached_tokens": -4}}  # fmt: skip
    result = _answer([TOKEN, TOKEN, {"choices": [], "usage": usage}])
    assert result.ok
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (
        None, None, None,
    )  # fmt: skip


class _Sink:
    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def write(self, records: list[RequestRecord]) -> None:
        self.records += records


def test_a_request_whose_handling_raised_fails_the_run_instead_of_vanishing() -> None:
    async def dispatch(request: Request, target_s: float) -> RequestRecord:
        if request.request_id == "r1":
            raise AttributeError("'list' object has no attribute 'get'")
        return RequestRecord(variant="v", repeat=0, request_id=request.request_id,
                             trace_id=None, source="t", session_id=None, instance="C0",
                             route="R", arrival_s=target_s, sent_s=target_s,
                             first_token_s=target_s, finish_s=target_s, input_tokens=1,
                             output_tokens=1, ok=True)  # fmt: skip

    sink = _Sink()
    requests = [Request(f"r{i}", 0.001 * i, 1, 1, (i,), 16) for i in range(3)]
    with pytest.raises(AttributeError, match="has no attribute 'get'"):
        asyncio.run(LoadDriver(dispatch, sink, RunClock()).run(requests))  # type: ignore[arg-type]
    assert sorted(r.request_id for r in sink.records) == ["r0", "r2"]  # the others are kept
