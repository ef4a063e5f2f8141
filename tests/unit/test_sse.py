"""Server-sent events are read line by line at `\\n` only: a model's text may contain
U+0085, U+2028 or U+2029, which JSON leaves unescaped and `str.splitlines` (httpx's
`aiter_lines`) splits at, cutting a chunk in two."""

from __future__ import annotations

import asyncio
import json

import httpx

from btb_lab.calibrate.measure import StreamStamps, stream_stamps
from btb_lab.cluster.driver import RunClock, StreamResult, sse_data, stream_completion

TEXTS = ["a\x85b", "c\u2028d", "e\u2029f", "é€😀"]


def _body() -> bytes:
    events = [
        "data: " + json.dumps({"choices": [{"text": t, "index": 0}]}, ensure_ascii=False)
        for t in TEXTS
    ]
    events.append(
        "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 5,
                                                        "completion_tokens": 4}})
    )  # fmt: skip
    events.append("data: [DONE]")
    return ("\n\n".join(events) + "\n\n").encode()


class _Chunked(httpx.AsyncByteStream):
    """The body in 7-byte pieces, so lines and multi-byte characters span pieces."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        for i in range(0, len(self.body), 7):
            yield self.body[i : i + 7]


def _client() -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_Chunked(_body()),
                              headers={"content-type": "text/event-stream"})  # fmt: skip

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def test_sse_data_keeps_unicode_separators_inside_a_chunk() -> None:
    async def read() -> list[str]:
        async with _client() as client, client.stream("POST", "http://x/v1/completions") as r:
            return [d async for d in sse_data(r)]

    data = asyncio.run(read())
    assert data[-1] == "[DONE]"
    texts = [json.loads(d)["choices"][0]["text"] for d in data[:-2]]
    assert texts == TEXTS


def test_httpx_lines_would_cut_these_chunks() -> None:
    """Why sse_data exists: the library's line reader splits inside the JSON strings."""
    from httpx._decoders import LineDecoder

    assert len(LineDecoder().decode(_body().decode())) > len(TEXTS) * 2 + 4


def test_driver_and_calibration_read_every_token_of_such_a_stream() -> None:
    async def both() -> tuple[StreamResult, StreamStamps]:
        async with _client() as client:
            result = await stream_completion(
                client, "http://x/v1/completions", {"prompt": [1, 2, 3], "stream": True},
                RunClock(),
            )  # fmt: skip
            stamps = await stream_stamps(client, "http://x/v1/completions", {}, RunClock())
        return result, stamps

    result, stamps = asyncio.run(both())
    assert result.ok, result
    assert result.chunks == len(TEXTS)
    assert stamps.error is None
    assert len(stamps.chunk_s) == len(TEXTS)
