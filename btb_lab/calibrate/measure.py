"""Measuring an engine for its cost profile: a designed set of requests against one
OpenAI-compatible server, through the same HTTP client and clock as the load driver.

- **Prefill curve**: isolated requests (`max_tokens` 1) of `n` fresh tokens, and of `n`
  fresh tokens after a cached prefix of `c` tokens (a first request with the prefix alone
  puts it in the prefix cache); time to the first token.
- **Decode curve**: `b` concurrent streams of `L`-token prompts with `ignore_eos`; the
  mean time between streamed tokens while all `b` decode together, at the batch's total
  context at that time.

Prompts are random token ids, fresh for every point, so no point hits another's cache by
accident. Every point is measured `repeats` times and the median kept.
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
from btb_lab.cluster.driver import RunClock, completion_payload, sse_data

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


@dataclass
class StreamStamps:
    """When one streamed completion was sent and when each of its chunks arrived."""

    sent_s: float
    chunk_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def first_s(self) -> float | None:
        return self.chunk_s[0] if self.chunk_s else None


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
                if json.loads(data).get("choices"):
                    out.chunk_s.append(now)
    except httpx.HTTPError as exc:
        out.error = type(exc).__name__
    except ValueError as exc:  # malformed JSON from the server
        out.error = f"BadResponse: {exc}"
    return out


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    low = min(1000, max(3, vocab // 8))
    return rng.integers(low, vocab, size=n).tolist()


async def measure_prefill(
    client: Any, url: str, model: str, design: ProfileDesign, *, vocab: int, seed: int,
    progress: Callable[[], None] = lambda: None,
) -> list[PrefillPoint]:  # fmt: skip
    """Time to first token of isolated requests over the design's prefill points."""
    rng = np.random.default_rng(seed)
    clock = RunClock()
    out: list[PrefillPoint] = []
    for n, c in design.prefill_points():
        times: list[float] = []
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
            times.append(res.first_s - res.sent_s)
        out.append(PrefillPoint(tokens=n, cached=c, seconds=statistics.median(times)))
        progress()
    return out


async def measure_decode(
    client: Any, url: str, model: str, design: ProfileDesign, *, vocab: int, seed: int,
    progress: Callable[[], None] = lambda: None,
) -> list[DecodePoint]:  # fmt: skip
    """Mean step time of `b` concurrent streams while all of them decode."""
    rng = np.random.default_rng(seed + 1)
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
            bad = [s.error for s in streams if s.error or len(s.chunk_s) < 3]
            if bad:
                raise RuntimeError(f"decode of {b} × {n} tokens failed: {bad[0]}")
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
