"""The async load driver: replays requests at their arrival times against OpenAI-compatible
`/v1/completions` endpoints with httpx streaming, stamps raw times (target send, actual
send, first token, every chunk, finish), turns timeouts and HTTP errors into failed
records instead of crashes, writes every record to the sink as it finishes, and reports
its own scheduling lag.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from btb_lab import collector
from btb_lab.interrupts import Terminated, cancel_on_terminate
from btb_lab.records import Request, RequestRecord
from btb_lab.workload.sessions import SessionGate

if TYPE_CHECKING:
    import httpx

    from btb_lab.backends import RecordSink

__all__ = [
    "ClientPool",
    "DriverStats",
    "LoadDriver",
    "RunClock",
    "StreamResult",
    "completion_payload",
    "error_name",
    "event_loop_name",
    "lag_percentiles_ms",
    "run_async",
    "sse_data",
    "stream_completion",
    "token_count",
]


def event_loop_name() -> str:
    """uvloop (a dependency of btb-lab on POSIX), else asyncio's own loop."""
    import importlib.util

    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


T = TypeVar("T")


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run the driver's coroutine on the fastest available loop. Objects alive before
    the run are frozen out of the cyclic GC so its pauses do not show up as send lag."""
    import gc

    factory = None
    if event_loop_name() == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    thresholds = gc.get_threshold()
    # Young collections stay small and frequent; full passes over the growing set of
    # finished records (each a stall of tens of milliseconds) become rare.
    gc.set_threshold(thresholds[0], thresholds[1], 1000)
    tasks: list[asyncio.Task[Any]] = []

    async def run_main() -> T:
        task = asyncio.current_task()
        if task is not None:
            tasks.append(task)
        return await main

    try:
        with (
            collector.frozen(now=True),
            asyncio.Runner(loop_factory=factory) as runner,
            cancel_on_terminate(lambda: tasks[0] if tasks else None) as signals,
        ):
            try:
                result = runner.run(run_main())
            except asyncio.CancelledError:
                if signals:  # SIGTERM cancelled the run: stop as for Ctrl-C
                    raise Terminated(signals[0]) from None
                raise
            if signals:  # the run caught the cancellation and returned: stop all the same
                raise Terminated(signals[0])
            return result
    finally:
        gc.set_threshold(*thresholds)


class RunClock:
    """Seconds on the records' time base: workload time of the first request at start.
    `perf_counter` is monotonic and high-resolution; only differences are ever used."""

    def __init__(self, base_s: float = 0.0) -> None:
        self.base_s = base_s
        self._t0 = time.perf_counter()

    def restart(self, base_s: float) -> None:
        self.base_s = base_s
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return self.base_s + (time.perf_counter() - self._t0)


class ClientPool:
    """Several small httpx clients used as one. httpcore scans its whole connection pool
    on every request, so one client with a thousand connections costs O(n²); shards of
    `per_shard` connections, each request on the least busy shard, keep it O(n)."""

    def __init__(
        self,
        factory: Callable[[int], httpx.AsyncClient],
        *,
        max_connections: int,
        per_shard: int = 16,
    ) -> None:
        shards = max(1, -(-max_connections // per_shard))
        self.clients = [factory(min(per_shard, max_connections)) for _ in range(shards)]
        self.busy = [0] * shards

    def lease(self) -> int:
        """Index of the least busy shard, marked busy until `release`."""
        busy = self.busy
        idx = busy.index(min(busy))
        busy[idx] += 1
        return idx

    def release(self, idx: int) -> None:
        self.busy[idx] -= 1

    async def get(self, url: str) -> httpx.Response:
        idx = self.lease()
        try:
            return await self.clients[idx].get(url)
        finally:
            self.release(idx)

    async def stream_completion(
        self,
        url: str,
        payload: dict[str, Any],
        clock: RunClock,
        *,
        timeout_s: float | None = None,
        on_first_token: Callable[[], None] | None = None,
    ) -> StreamResult:
        idx = self.lease()
        try:
            return await stream_completion(
                self.clients[idx], url, payload, clock,
                timeout_s=timeout_s, on_first_token=on_first_token,
            )  # fmt: skip
        finally:
            self.release(idx)

    async def warm(self, base_urls: Sequence[str], shards: int = 32) -> None:
        """Open one keep-alive connection per URL on each of the first `shards` shards
        (the ones `lease` hands out first) before the run, so the first requests do not
        pay TCP setup and show it as send lag. Failures are ignored."""

        async def one(client: httpx.AsyncClient, url: str) -> None:
            with contextlib.suppress(Exception):
                await client.get(url + "/health")

        await asyncio.gather(*(one(c, u) for c in self.clients[:shards] for u in base_urls))

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()

    async def __aenter__(self) -> ClientPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def completion_payload(
    model: str,
    prompt: Sequence[int] | str,
    max_tokens: int,
    *,
    stream: bool = True,
    kv_transfer_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `/v1/completions` body: token-id prompt, exact output length (ignore_eos) and,
    when streaming, a final usage chunk so cached tokens can be read."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt) if not isinstance(prompt, str) else prompt,
        "max_tokens": max(1, int(max_tokens)),
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


@dataclass(slots=True)
class StreamResult:
    """Raw stamps of one HTTP completion (times on the RunClock's base)."""

    sent_s: float
    first_token_s: float | None = None
    last_chunk_s: float | None = None
    finish_s: float | None = None
    chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    ok: bool = False
    error: str | None = None
    status: int | None = None
    body: dict[str, Any] = field(default_factory=dict)  # non-streaming response JSON
    retried: bool = False  # a stale keep-alive connection was replaced once
    new_connection: bool = False  # sent on a connection opened for it (httpcore's trace)
    text: str = ""  # the generated text (first choice)
    detail: str | None = None  # the server's own error message, when it sent one


async def sse_data(resp: httpx.Response) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent event stream, `[DONE]` included.

    Lines end at `\\n` only. httpx's `aiter_lines` splits like `str.splitlines`, also at
    U+0085, U+2028 and the other Unicode separators, which JSON leaves unescaped inside a
    string: a random-weight model's output contains them, and the chunk arrived cut in two.
    """
    tail = b""
    async for part in resp.aiter_bytes():
        lines = (tail + part).split(b"\n")
        tail = lines.pop()
        for raw in lines:
            if raw.startswith(b"data:"):
                yield raw[5:].decode("utf-8", errors="replace").strip()
    if tail.startswith(b"data:"):
        yield tail[5:].decode("utf-8", errors="replace").strip()


def _error_message(data: Any) -> str | None:
    """The message of an OpenAI-style error body ({"error": {"message": …}} or
    {"message": …}), cut to a readable length."""
    if isinstance(data, dict):
        err = data.get("error", data)
        msg = err.get("message") if isinstance(err, dict) else err
        if msg is not None:
            return str(msg)[:500]
    return None


def error_name(exc: BaseException) -> str:
    """Short, stable error label: the exception class (ReadTimeout, ConnectError, …)."""
    import httpx

    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP{exc.response.status_code}"
    return type(exc).__name__


def token_count(value: Any) -> int | None:
    """A token count the server reported, or None when it is not one (a string, a
    negative or fractional number): never trusted into a record as it came."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value) if value >= 0 and float(value).is_integer() else None


def _read_usage(result: StreamResult, usage: Any) -> None:
    if not isinstance(usage, dict) or not usage:
        return
    result.prompt_tokens = token_count(usage.get("prompt_tokens"))
    result.completion_tokens = token_count(usage.get("completion_tokens"))
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details, dict):
        result.cached_tokens = token_count(details.get("cached_tokens"))


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    clock: RunClock,
    *,
    timeout_s: float | None = None,
    on_first_token: Callable[[], None] | None = None,
) -> StreamResult:
    """POST one completion and stamp it. Never raises for transport or HTTP problems:
    they come back as `ok=False, error=<name>` with the server's message in `detail`
    (cancellation still propagates); an error event inside the stream, or a choice that
    finished with reason "error", fails the request too. A pooled keep-alive connection
    the server closed just before reuse is retried once: no response arrived, so the
    server most likely never took the request. A connection opened for the request that
    drops it is not retried: the server may have read it and died or closed on it, and
    a second copy would be load the workload does not have. `timeout_s` replaces the
    client's read timeout for this request; `on_first_token` is called when the first
    token arrives.

    `sent_s` is when the request's headers start out on a connection (httpcore's trace),
    so a wait for a free connection in the client's pool is send lag, not TTFT; a
    transport without the trace stamps when the call starts. A retry keeps the first
    attempt's stamp."""

    result = await _stream_once(client, url, payload, clock, timeout_s, on_first_token)
    stale = result.status is None and result.error in _STALE_CONNECTION_ERRORS
    if stale and not result.new_connection:
        sent_s = result.sent_s
        result = await _stream_once(client, url, payload, clock, timeout_s, on_first_token)
        result.sent_s = min(sent_s, result.sent_s)
        result.retried = True
    return result


_STALE_CONNECTION_ERRORS = frozenset({"RemoteProtocolError", "ReadError", "WriteError"})


def _read_choice(result: StreamResult, chunk: dict[str, Any]) -> None:
    choices = chunk.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    if not isinstance(choice, dict):
        raise TypeError(f"a choice is a JSON {type(choice).__name__}, not an object")
    result.text += str(choice.get("text") or "")
    if choice.get("finish_reason") == "error" and result.error is None:
        result.error = "FinishError"


def _http_detail(result: StreamResult, resp: httpx.Response) -> None:
    with contextlib.suppress(ValueError, UnicodeDecodeError):
        result.detail = _error_message(resp.json())
    if result.detail is None and resp.content:
        result.detail = resp.content[:500].decode("utf-8", "replace")


async def _stream_once(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    clock: RunClock,
    timeout_s: float | None = None,
    on_first_token: Callable[[], None] | None = None,
) -> StreamResult:
    import httpx

    result = StreamResult(sent_s=clock.now())
    on_wire = False

    async def trace(event: str, info: dict[str, Any]) -> None:
        nonlocal on_wire
        if not on_wire and event.endswith("send_request_headers.started"):
            on_wire = True
            result.sent_s = clock.now()
        elif event == "connection.connect_tcp.started":
            result.new_connection = True

    extra: dict[str, Any] = {"extensions": {"trace": trace}}
    if timeout_s is not None:
        timeout = httpx.Timeout(timeout_s, connect=client.timeout.connect, pool=timeout_s)
        extra["timeout"] = timeout
    try:
        if not payload.get("stream"):
            resp = await client.post(url, json=payload, **extra)
            result.status = resp.status_code
            if resp.status_code != 200:
                _http_detail(result, resp)
            resp.raise_for_status()
            result.finish_s = clock.now()
            result.body = resp.json()
            if not isinstance(result.body, dict):
                raise TypeError(f"the answer is a JSON {type(result.body).__name__}")
            _read_choice(result, result.body)
            _read_usage(result, result.body.get("usage"))
            if result.error is not None:
                result.finish_s = None
                return result
            result.first_token_s = result.finish_s
            result.last_chunk_s = result.finish_s
            result.chunks = 1
            result.ok = True
            if on_first_token is not None:
                on_first_token()
            return result
        async with client.stream("POST", url, json=payload, **extra) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                _http_detail(result, resp)
                resp.raise_for_status()
            async for data in sse_data(resp):
                if data == "[DONE]":
                    continue  # read to the end so the connection returns to the pool
                now = clock.now()
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    result.detail = data[:500]
                    raise TypeError(f"a stream event is a JSON {type(chunk).__name__}")
                if "error" in chunk and not chunk.get("choices"):
                    result.error = result.error or "StreamError"
                    result.detail = _error_message(chunk)
                    continue
                if chunk.get("choices"):
                    if result.first_token_s is None:
                        result.first_token_s = now
                        if on_first_token is not None:
                            on_first_token()
                    result.last_chunk_s = now
                    result.chunks += 1
                    _read_choice(result, chunk)
                _read_usage(result, chunk.get("usage"))
        result.finish_s = clock.now()
        if result.error is not None:
            result.finish_s = None
        elif result.first_token_s is None:
            result.error = "NoTokens"
        else:
            result.ok = True
    except httpx.HTTPError as exc:
        result.error = error_name(exc)
        result.finish_s = None
    except (ValueError, KeyError, TypeError) as exc:  # malformed JSON from the server
        result.error = f"BadResponse:{type(exc).__name__}"
        result.detail = result.detail or str(exc)[:500]
        result.finish_s = None
    return result


def lag_percentiles_ms(lags_s: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / max of send lag (actual − target), in milliseconds."""
    if not lags_s:
        return {"lag_p50_ms": 0.0, "lag_p99_ms": 0.0, "lag_max_ms": 0.0}
    ordered = sorted(lags_s)

    def pct(q: float) -> float:
        # nearest-rank percentile: the smallest value with at least q of the mass below
        idx = min(len(ordered) - 1, max(0, int(-(-q * len(ordered) // 1)) - 1))
        return ordered[idx] * 1e3

    return {"lag_p50_ms": pct(0.50), "lag_p99_ms": pct(0.99), "lag_max_ms": ordered[-1] * 1e3}


@dataclass
class DriverStats:
    """What the driver measured about itself (never about the servers)."""

    sent: int = 0
    held: int = 0  # turns that waited for their session's earlier turns (closed replay)
    finished: int = 0
    ok: int = 0
    failed: int = 0
    duration_s: float = 0.0
    lag_p50_ms: float = 0.0
    lag_p99_ms: float = 0.0
    lag_max_ms: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def rate_rps(self) -> float:
        return self.finished / self.duration_s if self.duration_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "held": self.held,
            "finished": self.finished,
            "ok": self.ok,
            "failed": self.failed,
            "duration_s": round(self.duration_s, 4),
            "rate_rps": round(self.rate_rps, 2),
            "lag_p50_ms": round(self.lag_p50_ms, 3),
            "lag_p99_ms": round(self.lag_p99_ms, 3),
            "lag_max_ms": round(self.lag_max_ms, 3),
            "errors": dict(self.errors),
        }


Dispatch = Callable[[Request, float], Awaitable[RequestRecord]]


class LoadDriver:
    """Replays requests at `arrival_s` (time_scale already applied by the workload).
    `dispatch(request, target_s)` does the HTTP work and returns the finished record;
    the driver writes it to the sink at once, so an interrupt loses nothing finished.
    With `sessions` (workload.session_replay closed) a turn whose session is still
    answering an earlier turn is held, and sent when that turn's answer is in."""

    def __init__(
        self,
        dispatch: Dispatch,
        sink: RecordSink,
        clock: RunClock,
        *,
        progress: Callable[[int, int], None] = lambda done, total: None,
        sessions: SessionGate | None = None,
    ) -> None:
        self.dispatch = dispatch
        self.sink = sink
        self.clock = clock
        self.progress = progress
        self.sessions = sessions
        self.stats = DriverStats()
        self._lags: list[float] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed: list[BaseException] = []  # a request's task that raised: said, not lost
        self._total = 0

    async def run(self, requests: Sequence[Request]) -> DriverStats:
        ordered = sorted(requests, key=lambda r: r.arrival_s)
        self._total = len(ordered)
        if not ordered:
            return self.stats
        self.clock.restart(ordered[0].arrival_s)
        start = time.perf_counter()
        tasks = self._tasks
        try:
            for req in ordered:
                delay = req.arrival_s - self.clock.now()
                if delay > 0:
                    await asyncio.sleep(delay)
                if self.sessions is None:
                    self._send(req, req.arrival_s)
                elif (send_s := self.sessions.arrive(req, self.clock.now())) is not None:
                    self._send(req, send_s)
            while tasks:  # a finishing turn adds the turns it releases before it leaves
                await asyncio.wait(set(tasks))
            if self._failed:  # its record was never written: the run must not read complete
                raise self._failed[0]
        finally:
            for task in tasks:
                task.cancel()
            self.stats.duration_s = time.perf_counter() - start
            self.stats.__dict__.update(lag_percentiles_ms(self._lags))
            if self.sessions is not None:
                self.stats.held = self.sessions.held_total
        return self.stats

    def _send(self, req: Request, due_s: float) -> None:
        """Send `req` at `due_s` (its arrival, the finish it waited for, or after a think
        gap: a later time is slept to; the driver's lag is measured from there)."""
        task = asyncio.create_task(self._one(req, due_s))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        self.stats.sent += 1

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._failed.append(task.exception())  # type: ignore[arg-type]

    async def _one(self, req: Request, due_s: float) -> None:
        delay = due_s - self.clock.now()
        if delay > 0:
            await asyncio.sleep(delay)
        record = await self.dispatch(req, req.arrival_s)
        self._lags.append(record.sent_s - due_s)
        self.sink.write([record])
        if self.sessions is not None:
            now = self.clock.now()
            released = self.sessions.finish(record.trace_id, record.session_id, record.turn, now)
            for send_s, held in released:
                self._send(held, send_s)
        self.stats.finished += 1
        if record.ok:
            self.stats.ok += 1
        else:
            self.stats.failed += 1
            key = record.error or "unknown"
            self.stats.errors[key] = self.stats.errors.get(key, 0) + 1
        self.progress(self.stats.finished, self._total)
