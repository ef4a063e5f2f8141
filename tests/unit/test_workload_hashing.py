"""Block ids from string hashes are persistent (traces, caches keyed by them, golden
records), so the compiled hash must give exactly hashlib's ids, and both paths must keep
today's values."""

from __future__ import annotations

import hashlib
import random

import pytest

from btb_lab.workload import hashing

_hashc = pytest.importorskip("btb_lab.workload._hashc", reason="built by `make install`")


def reference(text: str) -> int:
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)


def texts() -> list[str]:
    rng = random.Random(13)
    alphabet = "0123456789abcdefé日\U0001f600 "
    edges = ["", "0", "a", "é", "日本語", "\U0001f600"]
    # BLAKE2b works in 128-byte blocks: lengths on both sides of one, two and three blocks
    edges += ["x" * n for n in (1, 7, 8, 9, 63, 64, 127, 128, 129, 255, 256, 257, 384, 1000)]
    edges += ["é" * 64, "é" * 65]  # 128 and 130 UTF-8 bytes
    drawn = [
        "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 300))) for _ in range(3000)
    ]
    return edges + drawn


def test_the_compiled_hash_gives_hashlibs_ids() -> None:
    items = texts()
    expected = [reference(t) for t in items]
    assert _hashc.stable_hashes63(items) == expected
    assert hashing.python_stable_hashes63(items) == expected
    assert [hashing.stable_hash63(t) for t in items] == expected
    assert hashing.stable_hashes63 is _hashc.stable_hashes63  # the loader uses the C path


def test_known_ids_do_not_move() -> None:
    """Values pinned once, so a change to either path (or to hashlib) cannot go unseen."""
    pinned = {"": 0x64A6A0577479B2B4, "0": 0x042B7D9D43CDDF75, "a": 0x40F89E395B66422F,
              "x" * 300: 0x12B539C1CAD94615, "日本語": 0x7419EDD5D4267B48}  # fmt: skip
    assert _hashc.stable_hashes63(list(pinned)) == list(pinned.values())
    assert hashing.python_stable_hashes63(list(pinned)) == list(pinned.values())


def test_the_compiled_hash_takes_any_iterable_and_refuses_non_strings() -> None:
    assert _hashc.stable_hashes63(iter(["a", "b"])) == [reference("a"), reference("b")]
    assert _hashc.stable_hashes63(()) == []
    with pytest.raises(TypeError, match="expected str, got int"):
        _hashc.stable_hashes63(["a", 1])
    with pytest.raises(UnicodeEncodeError):
        _hashc.stable_hashes63(["\ud800"])  # a lone surrogate, as str.encode() refuses
    with pytest.raises(UnicodeEncodeError):
        hashing.python_stable_hashes63(["\ud800"])
