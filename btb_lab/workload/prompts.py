"""Token-id prompts for real servers, built from a request's block hashes.

Each full block maps deterministically (blake2b of hash id and seed) to a fixed sequence
of `block_tokens` token ids, so requests sharing leading hash ids share identical
leading tokens and hit vLLM's prefix cache exactly as the trace says. The partial tail
block and any tokens past the hashed blocks are filled from the request id, so they
never match another request by accident. The prompt is exactly `input_tokens` long.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

from btb_lab.records import Request

__all__ = ["DEFAULT_RESERVED_IDS", "block_token_ids", "prompt_token_ids"]

# Low ids hold special and byte-fallback tokens in common tokenizers; stay clear of them.
DEFAULT_RESERVED_IDS = 1000


def _seed_of(*parts: object) -> int:
    text = "\x1f".join(str(part) for part in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=16).digest(), "big")


@lru_cache(maxsize=65536)
def block_token_ids(
    hash_id: int, *, seed: int, block_tokens: int, vocab_size: int, reserved_ids: int
) -> tuple[int, ...]:
    """The fixed token ids of one full block (cached: popular prefixes repeat a lot)."""
    rng = np.random.default_rng(_seed_of("block", hash_id, seed))
    return tuple(rng.integers(reserved_ids, vocab_size, size=block_tokens).tolist())


def prompt_token_ids(
    request: Request,
    *,
    seed: int,
    vocab_size: int,
    reserved_ids: int = DEFAULT_RESERVED_IDS,
) -> list[int]:
    """Exactly `request.input_tokens` token ids in `[reserved_ids, vocab_size)`."""
    if vocab_size <= reserved_ids:
        raise ValueError(f"vocab_size {vocab_size} must exceed reserved_ids {reserved_ids}")
    bt = request.block_tokens
    full_blocks = min(len(request.block_hashes), request.input_tokens // bt)
    tokens: list[int] = []
    for hash_id in request.block_hashes[:full_blocks]:
        tokens.extend(
            block_token_ids(
                hash_id,
                seed=seed,
                block_tokens=bt,
                vocab_size=vocab_size,
                reserved_ids=reserved_ids,
            )
        )
    rest = request.input_tokens - len(tokens)
    if rest:
        rng = np.random.default_rng(_seed_of("tail", request.request_id, seed))
        tokens.extend(rng.integers(reserved_ids, vocab_size, size=rest).tolist())
    return tokens
