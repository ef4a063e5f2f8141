"""Decode-segment arithmetic of the engine: how long k decode steps of a batch take, which
step boundary a given elapsed time reaches, and the shared-prefix-attention count of
prompt blocks that several decoding sequences read once per step.

A segment's step i (from 0) takes `c0 + i * c1` seconds: `c0` is the weights, the
per-sequence cost times the batch (a fitted profile's `decode_seq_s`; zero on the
roofline) and the batch's context at the segment start, `c1` the batch's growth per step
(one token per sequence). The batch is fixed within a segment (sequences join and leave
only at its boundaries), so k steps take exactly `k * c0 + c1 * k * (k - 1) / 2`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["TIME_EPS_S", "SharedPrefixReads", "segment_s", "steps_reaching"]

TIME_EPS_S = 1e-12  # simulated times this close count as equal (float round-off)


def segment_s(k: int, c0: float, c1: float, start_s: float) -> float:
    """`start_s` plus the duration of `k` decode steps: the end time of a segment that
    starts at `start_s`, or with `start_s = 0.0` its duration (`0.0 + x == x` for every
    duration, so that is the plain `k * c0 + c1 * k * (k - 1) * 0.5`).

    The one formula for a segment's duration; every caller goes through it so all agree to
    the last bit. The start is added first, then `k * c0`, then the growth term, in this
    order: float addition does not associate, and this is the order the engine's end times
    have always had. (`start_s` has no default: filling one in costs a hot call ~0.2%.)
    """
    return start_s + k * c0 + c1 * k * (k - 1) * 0.5


def steps_reaching(elapsed_s: float, c0: float, c1: float) -> int:
    """The smallest k with `segment_s(k, c0, c1, 0.0) >= elapsed_s - TIME_EPS_S`: the step
    boundary at or after `elapsed_s` into a segment (0 when nothing has elapsed). Needs
    `c0 > 0` and `c1 >= 0`, as the engine's coefficients are."""
    if elapsed_s <= 0:
        return 0
    # root of a k² + b k = elapsed with a = c1/2, b = c0 - c1/2, then guarded below
    a = 0.5 * c1
    b = c0 - 0.5 * c1
    root = (-b + math.sqrt(b * b + 4 * a * elapsed_s)) / (2 * a) if a > 0 else elapsed_s / b
    # b² overflows when a step takes ~1e154 s or more (a cost setting far off): then k is
    # tiny, and elapsed / c0 bounds it from above (each step takes at least c0)
    k = math.ceil(root) if math.isfinite(root) else math.ceil(elapsed_s / c0)
    # the float root can be one off either way: settle k exactly with the formula itself
    target = elapsed_s - TIME_EPS_S
    while k > 0 and segment_s(k - 1, c0, c1, 0.0) >= target:
        k -= 1
    while segment_s(k, c0, c1, 0.0) < target:
        k += 1
    return k


class SharedPrefixReads:
    """Cascade attention's saving on one instance (`shared_prefix_attention`): a pinned
    leading prompt block that several decoding sequences hold is read once per step.

    `refs` maps each such block to the decoding sequences holding it; `dup_tokens` is the
    sum over blocks of (refs - 1) × block_tokens, the tokens a step would read twice
    without cascade attention. Invariant: `dup_tokens == sum((r - 1) * block_tokens for r
    in refs.values())` and every count is positive.
    """

    __slots__ = ("block_tokens", "dup_tokens", "refs")

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.refs: dict[int, int] = {}
        self.dup_tokens = 0

    def join(self, hashes: Sequence[int], n: int) -> int:
        """A sequence holding the leading `n` blocks of `hashes` joins the batch; returns
        the tokens of those blocks another sequence already reads."""
        refs = self.refs
        get = refs.get
        dup = 0
        for h in hashes[:n]:
            c = get(h, 0)
            if c:
                dup += 1
            refs[h] = c + 1
        dup *= self.block_tokens
        self.dup_tokens += dup
        return dup

    def leave(self, hashes: Sequence[int], n: int) -> int:
        """Undo `join(hashes, n)` as the sequence leaves; returns the tokens it no longer
        duplicates."""
        refs = self.refs
        dup = 0
        for h in hashes[:n]:
            c = refs[h] - 1
            if c:
                refs[h] = c
                dup += 1
            else:
                del refs[h]
        dup *= self.block_tokens
        self.dup_tokens -= dup
        return dup
