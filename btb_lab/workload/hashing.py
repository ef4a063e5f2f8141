"""Stable ids for prefix blocks: string block ids become 63-bit ints via blake2b.

Python's `hash()` changes per process, so every persistent id in btb-lab goes through
here instead. Integer ids (Mooncake, ART-Chat) are kept exactly as they are.
"""

from __future__ import annotations

import hashlib

__all__ = ["BlockIdAllocator", "block_id", "stable_hash63"]

_MASK_63 = (1 << 63) - 1


def stable_hash63(text: str) -> int:
    """A 63-bit non-negative int that is the same in every process and on every machine."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") & _MASK_63


def block_id(value: int | str) -> int:
    """Block id as stored in `Request.block_hashes`: ints unchanged, strings hashed."""
    if isinstance(value, bool):
        raise TypeError("a block id cannot be a boolean")
    if isinstance(value, int):
        return value
    return stable_hash63(value)


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
