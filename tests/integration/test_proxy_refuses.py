"""What `router serve`'s proxy refuses and survives (issue 16, item 9), against fake vLLM
servers: malformed requests get 400 with a message (never a 500 and a server-side
traceback), an oversized body gets 413 before it is parsed, and an instance that refuses
connections is routed around — also under session affinity — with its failures counted."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any, ClassVar

import httpx
import pytest

from btb_lab.cluster.backend import make_client
from btb_lab.cluster.fake_server import FakeConfig, FakeVLLM, serve_in_thread
from btb_lab.cluster.launcher import Endpoint
from btb_lab.cluster.proxy import (
    MAX_HELD_EVENT_BYTES,
    _events_end,
    build_proxy_app,
    make_router,
)
from btb_lab.policies import build_policy
from btb_lab.policies.base import Decision, NoParams, Policy
from btb_lab.records import Request
from tests.helpers import raw_server, read_http_request


class Scripted(Policy):
    """Routes every request where the test says and remembers what it was asked."""

    name: ClassVar[str] = "scripted-proxy"
    Params = NoParams

    def __init__(self, decision: Decision) -> None:
        super().__init__(NoParams())
        self.decision = decision
        self.views: list[int] = []

    def route(self, request: Request, view: Any) -> Decision:
        self.views.append(len(view.instances))
        return self.decision


class ZeroCosts:
    def prefill_s(self, instance: int, tokens: int) -> float:
        return 0.0

    def transfer_s(self, tokens: int, source: int, target: int) -> float:
        return 0.0


def dead_url() -> str:
    """A local port nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def upstreams() -> Iterator[list[Endpoint]]:
    """Endpoint 0 is dead, endpoint 1 a fake vLLM server."""
    app = FakeVLLM(FakeConfig(name="live", engine_id="engine-1", token_delay_s=0.0))
    with ExitStack() as stack:
        url = stack.enter_context(serve_in_thread(app))
        yield [Endpoint(0, "C0", "C", dead_url()), Endpoint(1, "C1", "C", url)]


def serve(endpoints: list[Endpoint], policy: Any, **options: Any) -> Any:
    router = make_router(
        endpoints, policy, ZeroCosts(),
        client=make_client(request_timeout_s=10, connect_timeout_s=2, max_connections=8),
        model="fake-model",
    )  # fmt: skip
    return serve_in_thread(build_proxy_app(router, block_tokens=16, **options))


BODY = {"model": "fake-model", "prompt": list(range(40)), "max_tokens": 2, "stream": True}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "request body is not valid JSON"),
        (b"", "request body is not valid JSON"),
        (b"[1, 2, 3]", "request body must be a JSON object"),
        (b"{}", "'prompt' is required"),
        (b'{"prompt": 5}', "'prompt' must be a string or a list of token ids"),
        (b'{"prompt": [1, "a"]}', "'prompt' must be a string or a list of token ids"),
        (b'{"prompt": [1], "max_tokens": "abc"}', "'max_tokens' must be an integer ≥ 1"),
        (b'{"prompt": [1], "max_tokens": NaN}', "'max_tokens' must be an integer ≥ 1"),
        (b'{"prompt": [1], "user": [1]}', "'user' must be a string"),
    ],
)
def test_malformed_requests_get_400_with_a_message(
    upstreams: list[Endpoint], raw: bytes, message: str
) -> None:
    with serve(upstreams, Scripted(Decision(instance=1, route="X"))) as url, httpx.Client() as c:
        resp = c.post(url + "/v1/completions", content=raw,
                      headers={"content-type": "application/json"})  # fmt: skip
        assert resp.status_code == 400, resp.text
        assert message in resp.json()["error"]
        assert c.get(url + "/health").status_code == 200  # still serving


def test_an_oversized_body_gets_413_before_it_is_parsed(upstreams: list[Endpoint]) -> None:
    big = b'{"prompt": [' + b"1, " * (7 * 2**20) + b'1], "max_tokens": 1}'  # ~21 MB
    assert len(big) > 16 * 2**20

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap is counted while reading
        for i in range(0, len(big), 2**20):
            yield big[i : i + 2**20]

    policy = Scripted(Decision(instance=1, route="X"))
    with serve(upstreams, policy) as url, httpx.Client(timeout=60) as c:
        declared = c.post(url + "/v1/completions", content=big)
        assert declared.status_code == 413
        streamed = c.post(url + "/v1/completions", content=chunks())
        assert streamed.status_code == 413
        assert "over 16,777,216 bytes" in streamed.json()["error"]
    assert policy.views == []  # neither was routed


def test_a_dead_upstream_is_routed_around_and_counted(upstreams: list[Endpoint]) -> None:
    policy = Scripted(Decision(instance=0, route="PICK"))  # always the dead one
    with serve(upstreams, policy) as url, httpx.Client(timeout=30) as c:
        statuses = []
        for _ in range(6):
            resp = c.post(url + "/v1/completions", json=BODY)
            statuses.append((resp.status_code, resp.headers.get("x-btb-instance")))
        health = c.get(url + "/router/state").json()["health"]
    assert statuses == [(200, "C1")] * 6
    assert health["instances"][0] == {"name": "C0", "healthy": False, "failures": 1}
    assert health["instances"][1]["failures"] == 0
    assert health["failovers"] == 6


def test_session_affinity_to_a_dead_upstream_is_broken(upstreams: list[Endpoint]) -> None:
    policy = build_policy("session_affinity", {})
    with serve(upstreams, policy) as url, httpx.Client(timeout=30) as c:
        codes = [
            c.post(url + "/v1/completions", json={**BODY, "user": "session-1"}).status_code
            for _ in range(4)
        ]
    assert codes == [200] * 4


def test_a_dead_upstream_is_tried_again_after_a_while(upstreams: list[Endpoint]) -> None:
    now = [0.0]
    policy = Scripted(Decision(instance=0, route="PICK"))
    with (
        serve(upstreams, policy, retry_after_s=5.0, clock=lambda: now[0]) as url,
        httpx.Client(timeout=30) as c,
    ):
        c.post(url + "/v1/completions", json=BODY)
        c.post(url + "/v1/completions", json=BODY)  # within 5 s: not tried
        now[0] = 6.0
        c.post(url + "/v1/completions", json=BODY)  # tried again, refused again
        health = c.get(url + "/router/state").json()["health"]
    assert health["instances"][0]["failures"] == 2


def test_no_healthy_upstream_is_a_502_with_the_reason() -> None:
    endpoints = [Endpoint(0, "C0", "C", dead_url()), Endpoint(1, "C1", "C", dead_url())]
    with serve(endpoints, Scripted(Decision(instance=0, route="X"))) as url, httpx.Client() as c:
        resp = c.post(url + "/v1/completions", json=BODY)
    assert resp.status_code == 502
    assert resp.json()["error"] == "no healthy upstream"
    assert [i["failures"] for i in resp.json()["health"]["instances"]] == [1, 1]


def test_router_state_counts_the_proxys_routes(upstreams: list[Endpoint]) -> None:
    """/router/state's stats never moved: the proxy routed without counting."""
    policy = Scripted(Decision(instance=1, route="PICK", prefill_instance=0))
    with serve(upstreams, policy) as url, httpx.Client(timeout=30) as c:
        for _ in range(3):
            assert c.post(url + "/v1/completions", json=BODY).status_code == 200
        state = c.get(url + "/router/state").json()
    assert state["stats"]["routes"] == {"PICK": 3}
    assert state["stats"]["per_instance"] == {"C1": 3}
    assert state["health"]["offloads_not_split"] == 3  # run on C1, the decode instance


def cut_stream(conn: socket.socket) -> None:
    """Answer 200 with one SSE event and half of the next of a chunked stream, then
    close mid-stream."""
    sent = b'data: {"choices": [{"text": "a", "index": 0}]}\n\ndata: {"choi'
    read_http_request(conn)  # the whole request: closing with some unread is a reset
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        + f"{len(sent):x}\r\n".encode() + sent + b"\r\n"
    )  # fmt: skip


def test_an_upstream_cut_mid_stream_ends_it_with_an_error_event(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The status went out already: the client got a 200 stream cut short and the proxy
    logged a traceback; now the stream ends with an error event the client can read."""
    with raw_server(cut_stream) as upstream:
        endpoints = [Endpoint(0, "C0", "C", upstream)]
        with serve(endpoints, Scripted(Decision(instance=0, route="X"))) as url, \
                httpx.Client(timeout=30) as c:  # fmt: skip
            resp = c.post(url + "/v1/completions", json=BODY)
            health = c.get(url + "/router/state").json()["health"]
    assert resp.status_code == 200
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    # the half event is not relayed: every event the client reads is whole
    assert len(events) == 2
    assert json.loads(events[1])["error"]["message"] == "upstream C0: RemoteProtocolError"
    assert health["dropped_streams"] == 1
    assert health["instances"][0]["failures"] == 1
    assert "Traceback" not in capfd.readouterr().err


def cut_json(conn: socket.socket) -> None:
    """Answer 200 with half of a JSON body in a chunked stream, then close."""
    read_http_request(conn)
    half = b'{"choices": [{"text": "a'
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(half):x}\r\n".encode() + half + b"\r\n"
    )


def test_an_upstream_cut_mid_body_is_no_whole_answer() -> None:
    """Any other body than an event stream is cut for the client too (the proxy had
    ended it cleanly: a 200 with half a JSON document)."""
    with raw_server(cut_json) as upstream:
        endpoints = [Endpoint(0, "C0", "C", upstream)]
        with serve(endpoints, Scripted(Decision(instance=0, route="X"))) as url, \
                httpx.Client(timeout=30) as c:  # fmt: skip
            with pytest.raises(httpx.HTTPError):
                c.post(url + "/v1/completions", json={**BODY, "stream": False})
            health = c.get(url + "/router/state").json()["health"]
    assert health["dropped_streams"] == 1


@pytest.mark.parametrize(
    ("data", "end"),
    [
        (b"data: a\n\n", 9),
        (b"data: a\n\ndata: b", 9),
        (b"data: a\r\n\r\ndata: b", 11),
        (b"data: a\r\rdata: b", 9),
        (b"data: a", 0),
        (b"x" * (MAX_HELD_EVENT_BYTES + 1), MAX_HELD_EVENT_BYTES + 1),
    ],
)
def test_events_end_at_a_blank_line_in_any_line_ending(data: bytes, end: int) -> None:
    assert _events_end(data) == end
