"""Measuring an engine for its cost profile: a designed set of requests against one
OpenAI-compatible server, through the same HTTP client and clock as the load driver.

- **Prefill curve**: isolated requests (`max_tokens` 1) of `n` fresh tokens, and of `n`
  fresh tokens after a cached prefix of `c` tokens (a first request with the prefix alone
  puts it in the prefix cache); time to the first token.
- **Decode curve**: `b` concurrent streams of `L`-token prompts with `ignore_eos`; the
  mean time between streamed tokens while all `b` decode together, at the batch's total
  context at that time.

Prompts are random token ids, fresh for every point, so no point hits another's cache by
accident; a calibration's prompts come from its seed, which is drawn anew for every
calibration unless given (the same prompts sent twice would be served from the cache).
One request is sent first and not measured (the connection and the server's first-request
set-up). Every point is measured `repeats` times and the median kept.

The server's own counts are checked where it reports them (`usage`): the cached tokens
of each prefill point are the ones it reports (its block size may differ from the one
assumed), a fresh part it already had cached means the prompts reached it before, and a
decode stream must carry one event per token, spaced in time (a buffering proxy's burst,
or an engine that stops early, would be read as impossibly fast steps).
"""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from btb_lab.calibrate.fit import DecodePoint, PrefillPoint
from btb_lab.cluster.driver import RunClock, completion_payload, sse_data, token_count

__all__ = [
    "ProfileDesign",
    "StreamStamps",
    "measure_decode",
    "measure_prefill",
    "stream_stamps",
    "total_points",
]


@dataclass(frozen=True)
class ProfileDesign:
    """Which points to measure, sized to the server's context length and batch limit."""

    max_context: int
    max_batch: int
    block_tokens: int
    repeats: int = 3
    decode_tokens: int = 32

    def prefill_points(self) -> list[tuple[int, int]]:
        """(fresh tokens, cached tokens): a curve across the context, then cached prefixes
        of a quarter and half of it under fresh parts of several sizes."""
        top = self.max_context - 8
        sizes = sorted({max(8, int(top * f)) for f in (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9)})
        points = [(n, 0) for n in sizes]
        for frac in (0.25, 0.5):
            c = max(self.block_tokens, int(top * frac) // self.block_tokens * self.block_tokens)
            for n in (max(8, top // 32), max(8, top // 8), max(8, top // 4)):
                if c + n <= top:
                    points.append((n, c))
        return points

    def decode_points(self) -> list[tuple[int, int]]:
        """(batch, prompt tokens per sequence)."""
        batches = sorted({b for b in (1, 2, 4, 8, 16, 32) if b <= self.max_batch})
        room = self.max_context - self.decode_tokens - 8
        lengths = sorted({max(16, int(room * f)) for f in (0.05, 0.3, 0.7)})
        return [(b, n) for b in batches for n in lengths]


# a decode step faster than this is no step: the stream's events arrived together
MIN_STEP_S = 1e-4


@dataclass
class StreamStamps:
    """When one streamed completion was sent and when each of its chunks arrived."""

    sent_s: float
    chunk_s: list[float] = field(default_factory=list)
    error: str | None = None
    usage: dict[str, Any] | None = None  # the server's final counts, when it sends them

    @property
    def first_s(self) -> float | None:
        return self.chunk_s[0] if self.chunk_s else None

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the server served from its prefix cache, where it says."""
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return token_count(details.get("cached_tokens")) if isinstance(details, dict) else None

    @property
    def completion_tokens(self) -> int | None:
        return token_count((self.usage or {}).get("completion_tokens"))


async def stream_stamps(client: Any, url: str, body: dict[str, Any], clock: RunClock
                        ) -> StreamStamps:  # fmt: skip
    """POST a streamed completion, stamping every data chunk (never raises for HTTP)."""
    import httpx

    out = StreamStamps(sent_s=clock.now())
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                out.error = f"HTTP{resp.status_code}: {resp.text[:200]}"
                return out
            async for data in sse_data(resp):
                if data == "[DONE]":
                    continue
                now = clock.now()
                event = json.loads(data)
                if not isinstance(event, dict):
                    out.error = f"BadResponse: a stream event is a JSON {type(event).__name__}"
                    return out
                if event.get("error"):
                    out.error = f"the server sent an error: {str(event['error'])[:200]}"
                    return out
                if isinstance(event.get("usage"), dict):
                    out.usage = event["usage"]
                if event.get("choices"):
                    out.chunk_s.append(now)
    except httpx.HTTPError as exc:
        out.error = type(exc).__name__
    except ValueError as exc:  # malformed JSON from the server
        out.error = f"BadResponse: {exc}"
    if out.error is None and not out.chunk_s:
        out.error = "no token streamed (the answer held no server-sent completion events)"
    return out


async def warm_up(client: Any, url: str, model: str, vocab: int, rng: np.random.Generator,
                  clock: RunClock) -> None:  # fmt: skip
    """One request not measured: the first one pays for the connection and the server's
    first-request set-up, which made the first point tens of milliseconds slower."""
    res = await stream_stamps(client, url, completion_payload(model, _tokens(rng, 8, vocab), 2),
                              clock)  # fmt: skip
    if res.error:
        raise RuntimeError(f"the first request failed: {res.error}")


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    low = min(1000, max(3, vocab // 8))
    return rng.integers(low, vocab, size=n).tolist()


async def measure_prefill(
    client: Any, url: str, model: str, design: ProfileDesign, *, vocab: int, seed: int,
    progress: Callable[[], None] = lambda: None,
) -> list[PrefillPoint]:  # fmt: skip
    """Time to first token of isolated requests over the design's prefill points."""
    rng = np.random.default_rng([seed, 0])  # the decode curve's prompts are stream 1
    clock = RunClock()
    await warm_up(client, url, model, vocab, rng, clock)
    out: list[PrefillPoint] = []
    for n, c in design.prefill_points():
        times: list[float] = []
        hits: list[int] = []
        for _ in range(design.repeats):
            prefix = _tokens(rng, c, vocab)
            if c:  # put the prefix in the cache first
                warm = await stream_stamps(client, url, completion_payload(model, prefix, 1),
                                           clock)  # fmt: skip
                if warm.error:
                    raise RuntimeError(f"prefill warm-up failed: {warm.error}")
            body = completion_payload(model, prefix + _tokens(rng, n, vocab), 1)
            res = await stream_stamps(client, url, body, clock)
            if res.error or res.first_s is None:
                raise RuntimeError(f"prefill of {n}+{c} tokens failed: {res.error}")
            cached = res.cached_tokens
            if cached is not None and cached >= c + design.block_tokens:
                raise RuntimeError(
                    f"prefill of {n}+{c} tokens: the server served {cached} of them from its "
                    f"prefix cache, where {c} were put there: these prompts reached it before "
                    f"(a calibration with the same --seed {seed}); give another --seed, or "
                    "none, or restart the server"
                )
            hits.append(c if cached is None else min(cached, c + n))
            times.append(res.first_s - res.sent_s)
        # the cached part is what the server says it had (its blocks may not be ours)
        hit = int(statistics.median(hits))
        out.append(PrefillPoint(tokens=n + c - hit, cached=hit, seconds=statistics.median(times)))
        progress()
    return out


async def measure_decode(
    client: Any, url: str, model: str, design: ProfileDesign, *, vocab: int, seed: int,
    progress: Callable[[], None] = lambda: None,
) -> list[DecodePoint]:  # fmt: skip
    """Mean step time of `b` concurrent streams while all of them decode."""
    rng = np.random.default_rng([seed, 1])
    clock = RunClock()
    out: list[DecodePoint] = []
    t = design.decode_tokens
    for b, n in design.decode_points():
        steps: list[float] = []
        contexts: list[float] = []
        for _ in range(design.repeats):
            bodies = [completion_payload(model, _tokens(rng, n, vocab), t) for _ in range(b)]
            streams = await asyncio.gather(*(stream_stamps(client, url, body, clock)
                                             for body in bodies))  # fmt: skip
            bad = [_decode_problem(s, t) for s in streams]
            if any(bad):
                raise RuntimeError(f"decode of {b} × {n} tokens failed: "
                                   + next(p for p in bad if p))  # fmt: skip
            # the window in which every stream is past its first token and not yet done
            start = max(s.chunk_s[0] for s in streams)
            end = min(s.chunk_s[-1] for s in streams)
            gaps: list[float] = []
            generated: list[float] = []
            for s in streams:
                inside = [x for x in s.chunk_s if start <= x <= end]
                if len(inside) >= 2:
                    gaps.append((inside[-1] - inside[0]) / (len(inside) - 1))
                    # tokens this stream has at mid-window: its chunks before the middle
                    mid = (start + end) / 2
                    generated.append(sum(1 for x in s.chunk_s if x <= mid))
            if not gaps:  # too short an overlap: fall back to each stream's own mean gap
                gaps = [(s.chunk_s[-1] - s.chunk_s[0]) / (len(s.chunk_s) - 1) for s in streams]
                generated = [t / 2] * len(streams)
            steps.append(float(np.mean(gaps)))
            contexts.append(b * n + float(np.sum(generated)) * b / max(len(generated), 1))
        out.append(DecodePoint(batch=b, context_tokens=statistics.median(contexts),
                               seconds=statistics.median(steps)))  # fmt: skip
        progress()
    return out


def total_points(design: ProfileDesign) -> int:
    return len(design.prefill_points()) + len(design.decode_points())


def _decode_problem(stream: StreamStamps, asked: int) -> str | None:
    """Why a decode stream's events cannot time its steps, or None."""
    if stream.error:
        return stream.error
    got = stream.completion_tokens
    if got is not None and got != asked:
        return (f"the server generated {got} tokens where {asked} were asked (ignore_eos "
                "not honoured?)")  # fmt: skip
    events = len(stream.chunk_s)
    if events < 3 or events * 2 < asked:  # an event per token, give or take an empty one
        return (
            f"{events} stream events for {asked} tokens: step times are read one token "
            "an event (a server that sends several tokens an event cannot be timed)"
        )
    gap = float(np.median(np.diff(stream.chunk_s)))
    if gap < MIN_STEP_S:
        return f"the tokens arrived together (median gap {gap * 1e6:.1f} µs): a proxy buffering?"
    return None
