"""Prompt synthesis: shared hash ids give shared tokens, exact length, no collisions."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from btb_lab.records import Request
from btb_lab.workload.prompts import prompt_token_ids

VOCAB = 32000


def _req(rid: str, hashes: tuple[int, ...], input_tokens: int, bt: int = 16) -> Request:
    return Request(rid, 0.0, input_tokens, 1, block_hashes=hashes, block_tokens=bt)


def test_shared_leading_ids_share_leading_tokens() -> None:
    a = prompt_token_ids(_req("a", (1, 2, 3, 4), 60), seed=7, vocab_size=VOCAB)
    b = prompt_token_ids(_req("b", (1, 2, 9, 4), 64), seed=7, vocab_size=VOCAB)
    assert a[:32] == b[:32]  # blocks 1 and 2 are shared
    assert a[32:48] != b[32:48]  # block 3 vs 9 differ
    # block 4 is shared by id but follows a different block: its tokens are the same ids,
    # which is fine — prefix caches key on the whole prefix, not the block alone.
    assert len(a) == 60
    assert len(b) == 64


def test_tail_and_unhashed_suffix_come_from_request_id() -> None:
    a = prompt_token_ids(_req("a", (1, 2), 40), seed=7, vocab_size=VOCAB)
    a_again = prompt_token_ids(_req("a", (1, 2), 40), seed=7, vocab_size=VOCAB)
    b = prompt_token_ids(_req("b", (1, 2), 40), seed=7, vocab_size=VOCAB)
    assert a == a_again
    assert a[:32] == b[:32]
    assert a[32:] != b[32:]  # the 8 tokens past the full blocks are per request
    short_hashes = prompt_token_ids(_req("c", (1,), 48), seed=7, vocab_size=VOCAB)
    assert short_hashes[:16] == a[:16]
    assert len(short_hashes) == 48


def test_seed_changes_tokens_and_range_respected() -> None:
    one = prompt_token_ids(_req("a", (5, 6), 32), seed=1, vocab_size=VOCAB)
    two = prompt_token_ids(_req("a", (5, 6), 32), seed=2, vocab_size=VOCAB)
    assert one != two
    tokens = prompt_token_ids(_req("a", (5, 6), 32), seed=1, vocab_size=2000, reserved_ids=1500)
    assert all(1500 <= t < 2000 for t in tokens)


def test_distinct_ids_do_not_collide() -> None:
    blocks = {
        tuple(prompt_token_ids(_req(f"r{i}", (i,), 16), seed=0, vocab_size=VOCAB))
        for i in range(2000)
    }
    assert len(blocks) == 2000


@settings(max_examples=60, deadline=None)
@given(
    hashes=st.lists(st.integers(0, 2**63 - 1), max_size=8),
    extra=st.integers(0, 40),
    bt=st.sampled_from([1, 4, 16]),
)
def test_length_is_exactly_input_tokens(hashes: list[int], extra: int, bt: int) -> None:
    input_tokens = max(0, len(hashes) * bt - (bt - 1 if hashes else 0)) + extra
    request = _req("x", tuple(hashes), input_tokens, bt)
    assert len(prompt_token_ids(request, seed=3, vocab_size=VOCAB)) == input_tokens
