"""Calibration's measuring against an in-process server whose answers are known: what a
server reports about its cache and its tokens is checked, not assumed (found by probing
`btb-lab calibrate` against a fake server, 2026-12-07)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from btb_lab.calibrate.measure import (
    ProfileDesign,
    StreamStamps,
    measure_decode,
    measure_prefill,
    stream_stamps,
)
from btb_lab.cluster.driver import RunClock
from tests.helpers import cli

URL = "http://server/v1/completions"


class _Events(httpx.AsyncByteStream):
    def __init__(self, events: list[object], gap_s: float) -> None:
        self.events, self.gap_s = events, gap_s

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            if self.gap_s:
                await asyncio.sleep(self.gap_s)
            yield f"data: {json.dumps(event)}\n\n".encode()
        yield b"data: [DONE]\n\n"


class Server:
    """A prefix cache of `block`-token blocks, and `tokens(asked)` tokens generated, an
    event each, `gap_s` apart (0: all at once, as through a buffering proxy)."""

    def __init__(self, block: int = 16, gap_s: float = 0.002, short: int = 0) -> None:
        self.block, self.gap_s, self.short = block, gap_s, short
        self.cached: set[tuple[int, ...]] = set()

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompt = body["prompt"]
        hit = 0
        for end in range(self.block, len(prompt) + 1, self.block):
            key = tuple(prompt[:end])
            if key in self.cached:
                hit = end
            self.cached.add(key)
        made = max(1, body["max_tokens"] - self.short)
        events: list[object] = [{"choices": [{"text": "x", "index": 0}]} for _ in range(made)]
        events.append({"choices": [], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": made,
            "prompt_tokens_details": {"cached_tokens": hit}}})  # fmt: skip
        return httpx.Response(200, stream=_Events(events, self.gap_s),
                              headers={"content-type": "text/event-stream"})  # fmt: skip

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle))


DESIGN = ProfileDesign(max_context=256, max_batch=2, block_tokens=16, repeats=1)


def prefill(server: Server, seed: int, design: ProfileDesign = DESIGN) -> list:
    async def go() -> list:
        async with server.client() as client:
            return await measure_prefill(client, URL, "m", design, vocab=1000, seed=seed)

    return asyncio.run(go())


def decode(server: Server, design: ProfileDesign = DESIGN) -> list:
    async def go() -> list:
        async with server.client() as client:
            return await measure_decode(client, URL, "m", design, vocab=1000, seed=0)

    return asyncio.run(go())


def test_a_second_calibration_with_the_same_seed_is_refused_not_fitted() -> None:
    """The same seed sends the same prompts: the server answered them from its cache and
    the fit read 0 µs a token with a good-looking MAPE."""
    server = Server()
    prefill(server, seed=3)
    with pytest.raises(RuntimeError, match=r"these prompts reached it before .*--seed 3"):
        prefill(server, seed=3)
    assert prefill(server, seed=4)  # other prompts: measured


def test_the_cached_part_is_what_the_server_says_it_cached() -> None:
    """A server caching 64-token blocks holds 64 of a 96-token prefix: the point was
    recorded as 96 cached, and the fit blamed the cached tokens for the 32 computed."""
    points = prefill(Server(block=64), seed=0)
    cached = {(p.tokens + p.cached, p.cached) for p in points if p.cached}
    assert cached
    assert all(c % 64 == 0 for _, c in cached)
    design_cached = {c for _, c in DESIGN.prefill_points() if c}
    assert {c for _, c in cached} != design_cached  # 48 and 112 were asked; 0 or 64 served
    totals = {n + c for n, c in DESIGN.prefill_points() if c}
    assert {t for t, _ in cached} <= totals  # the same prompts, split where the server did


@pytest.mark.parametrize(
    ("server", "expected"),
    [
        (Server(short=28), "the server generated 4 tokens where 32 were asked"),
        (Server(gap_s=0.0), "the tokens arrived together"),
    ],
)
def test_a_decode_stream_that_cannot_time_steps_is_refused(server: Server, expected: str) -> None:
    with pytest.raises(RuntimeError, match=expected):
        decode(server)


def test_a_good_decode_stream_is_measured() -> None:
    points = decode(Server())
    assert points
    assert all(p.seconds >= 0.0015 for p in points)


def _stamps(events: list[object] | None, status: int = 200) -> StreamStamps:
    def handle(request: httpx.Request) -> httpx.Response:
        if events is None:  # a plain JSON answer, no stream
            return httpx.Response(status, json={"choices": [{"text": "x"}]})
        return httpx.Response(status, stream=_Events(events, 0.0))

    async def go() -> StreamStamps:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            return await stream_stamps(client, URL, {}, RunClock())

    return asyncio.run(go())


def test_stream_events_that_are_not_tokens_are_named_errors() -> None:
    # a list event was an AttributeError traceback; no events read "failed: None"
    assert _stamps([[1, 2, 3]]).error == "BadResponse: a stream event is a JSON list"
    assert _stamps(None).error == (
        "no token streamed (the answer held no server-sent completion events)"
    )
    said = _stamps([{"error": {"message": "out of memory"}}]).error
    assert said is not None
    assert said.startswith("the server sent an error: ")


def test_a_profile_value_of_true_is_refused(tmp_path: Path) -> None:
    from btb_lab.errors import UserError
    from btb_lab.model.profile import load_profile

    shipped = Path(__file__).resolve().parents[2] / "hypotheses" / "profiles" / "seed-elastic.yaml"
    text = shipped.read_text(encoding="utf-8")
    assert "per_seq_s:" in text
    lines = [
        line.split(":")[0] + ": true" if line.strip().startswith("per_seq_s:") else line
        for line in text.splitlines()
    ]
    bad = tmp_path / "p.yaml"
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"decode.per_seq_s: .*a number, not true or false"):
        load_profile(bad)


def test_a_folder_as_out_is_refused_before_measuring(tmp_path: Path) -> None:
    # it was found after every point was measured, as "<out>.tmp: Is a directory"
    result = cli("calibrate", "--endpoint", "http://127.0.0.1:9", "--model", "m",
                 "--out", tmp_path)  # fmt: skip
    assert result.code == 2, result.output
    assert f"--out {tmp_path}: a folder" in result.output


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"prefill": {"fixed_s": 1e300}}, "prefill.fixed_s: Input should be less than"),
        ({"points": [{"kind": "prefill", "tokens": -9, "cached": 0, "seconds": 0.1}]},
         "points: Value error, point 0: tokens -9 is not a finite count or time"),
        ({"decode": {"quality": {"points": 3, "mape": -3.0, "max_abs_error_s": 0.0}}},
         "decode.quality.mape: Input should be greater than or equal to 0"),
    ],
)  # fmt: skip
def test_implausible_profile_values_are_refused(
    tmp_path: Path, change: dict, expected: str
) -> None:
    """1e300 s passed validate and failed mid-run with no file or line; a point of -9
    tokens was counted as measured; a negative MAPE was shown as the fit's quality."""
    import yaml

    from btb_lab.errors import UserError
    from btb_lab.model.profile import load_profile

    shipped = Path(__file__).resolve().parents[2] / "hypotheses" / "profiles" / "seed-elastic.yaml"
    data = yaml.safe_load(shipped.read_text(encoding="utf-8"))
    for key, value in change.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    bad = tmp_path / "p.yaml"
    bad.write_text(yaml.safe_dump(data), encoding="utf-8")
    with pytest.raises(UserError, match=expected):
        load_profile(bad)


def test_a_whole_calibration_records_its_seed_and_what_it_could_not_measure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from btb_lab.calibrate.run import CalibrationTarget, calibrate

    server = Server()
    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(
        transport=httpx.MockTransport(server.handle), **kw))  # fmt: skip
    target = CalibrationTarget(
        base_url="http://server", model="m", max_context=256, max_batch=1, block_tokens=16,
        vocab_size=1000, settings={},
    )  # fmt: skip
    first = calibrate(target, name="p", repeats=1)
    second = calibrate(target, name="p", repeats=1)  # a fresh seed: not the cached prompts
    assert first.measured_on["seed"] != second.measured_on["seed"]
    assert "Not measured: decode.per_seq_s: one batch size measured" in (first.description or "")
    assert first.decode.per_seq_s == 0.0
