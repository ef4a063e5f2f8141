"""The load driver's one retry: a request on a reused keep-alive connection the server
closed is sent again; one on a connection opened for it that the server drops is not
(the server may have taken it, and a second copy is load the workload does not have)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from btb_lab.cluster.driver import RunClock, StreamResult, stream_completion
from tests.helpers import raw_server, read_http_request

ANSWER = json.dumps({
    "choices": [{"text": "hi", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1},
}).encode()  # fmt: skip


@contextmanager
def answering(per_connection: int) -> Iterator[tuple[str, list[int]]]:
    """A server that answers the first `per_connection` requests of each connection and
    closes the connection after reading the next; yields its completions URL and the
    number of requests it read on each connection."""
    read: list[int] = []

    def handle(conn: socket.socket) -> None:
        index = len(read)
        read.append(0)
        while read_http_request(conn):
            read[index] += 1
            if read[index] > per_connection:
                return  # read it whole, then close without an answer
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(ANSWER)}\r\n\r\n".encode()
                + ANSWER
            )

    with raw_server(handle) as url:
        yield url + "/v1/completions", read


def _send(url: str, times: int) -> list[StreamResult]:
    async def main() -> list[StreamResult]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1)) as client:
            clock = RunClock()
            return [
                await stream_completion(client, url, {"prompt": [1, 2, 3]}, clock)
                for _ in range(times)
            ]

    return asyncio.run(main())


def test_a_fresh_connection_the_server_drops_is_not_retried() -> None:
    with answering(per_connection=0) as (url, read):
        (result,) = _send(url, 1)
    assert result.error == "RemoteProtocolError"
    assert result.retried is False
    assert read == [1]  # sent once: the server read it whole before it closed


def test_a_reused_connection_the_server_closed_is_retried_once() -> None:
    with answering(per_connection=1) as (url, read):
        first, second = _send(url, 2)
    assert (first.ok, first.retried) == (True, False)
    assert (second.ok, second.retried) == (True, True)
    assert read == [2, 1]  # the second request went again on a new connection
