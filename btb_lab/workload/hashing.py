"""Stable ids for prefix blocks: string block ids become 63-bit ints via blake2b.

Python's `hash()` changes per process, so every persistent id in btb-lab goes through
here instead. Integer ids (Mooncake, ART-Chat) are kept exactly as they are. Loaders
convert each distinct id once (`BlockIdInterner`), not once per occurrence.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = [
    "BlockIdAllocator",
    "BlockIdInterner",
    "block_id",
    "python_stable_hashes63",
    "stable_hash63",
    "stable_hashes63",
]

_MASK_63 = (1 << 63) - 1


def stable_hash63(text: str) -> int:
    """A 63-bit non-negative int that is the same in every process and on every machine."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") & _MASK_63


def python_stable_hashes63(texts: Iterable[str]) -> list[int]:
    """`stable_hash63` of each of `texts`, in one pass (no function call per text)."""
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes
    return [
        from_bytes(blake2b(t.encode(), digest_size=8).digest(), "big") & _MASK_63 for t in texts
    ]


try:  # the same function in C (`_hashc.c`), where the install could build it
    from btb_lab.workload._hashc import stable_hashes63
except ImportError:  # pragma: no cover - installs without a C compiler
    stable_hashes63 = python_stable_hashes63


def block_id(value: int | str) -> int:
    """Block id as stored in `Request.block_hashes`: ints unchanged, strings hashed."""
    if isinstance(value, bool):
        raise TypeError("a block id cannot be a boolean")
    if isinstance(value, int):
        return value
    return stable_hash63(value)


class BlockIdInterner(dict[int | str, int]):
    """`block_id` memoized over one trace: each distinct id is converted once, and every
    occurrence of it shares one int object, so a loaded trace costs one tuple slot per
    block occurrence plus one int per distinct block.

    Keys must be exact `str` or `int` (never `bool` or `float`, which compare equal to
    ints): callers check the types of a row's ids before looking them up.
    """

    __slots__ = ()

    def __missing__(self, key: int | str) -> int:
        value = stable_hash63(key) if isinstance(key, str) else key
        self[key] = value
        return value

    def ids(self, items: Iterable[int | str]) -> tuple[int, ...]:
        """The block ids of `items` (exact `str` / `int` values), in order."""
        return tuple(map(self.__getitem__, items))


class BlockIdAllocator:
    """Fresh block ids for generated prompts: a namespace-derived 63-bit base plus a counter.

    Cheaper than hashing one label per block, and collisions with a real trace's small
    integer ids are practically impossible because the base is a random-looking 63-bit int.
    """

    def __init__(self, namespace: str) -> None:
        self._next = stable_hash63(namespace) | (1 << 62)

    def take(self, count: int) -> tuple[int, ...]:
        """`count` ids never handed out before by this allocator."""
        start = self._next
        self._next += count
        return tuple((start + i) & _MASK_63 for i in range(count))
