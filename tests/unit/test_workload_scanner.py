"""The compiled `hash_ids` scanner (`_hashc.IdScanner`): the ids `json.loads` and
`block_id` give, one object per id value, refusal of every form it does not read (the
chunk then goes to pyarrow's parser), and loads alike with and without it."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from btb_lab.errors import UserError
from btb_lab.workload import columnar, formats
from btb_lab.workload.hashing import block_id

_hashc = pytest.importorskip("btb_lab.workload._hashc", reason="built by `make install`")


def expected(chunk: bytes) -> list[tuple[int, ...]]:
    return [tuple(map(block_id, json.loads(line)["hash_ids"])) for line in chunk.splitlines()]


def scan(chunk: bytes, strings: bool, interned: dict[int, int] | None = None) -> Any:
    scanned = _hashc.IdScanner({} if interned is None else interned, strings=strings).scan(chunk)
    return None if scanned is None else scanned[0]


def test_string_and_integer_ids_read_as_json_loads_and_block_id_read_them() -> None:
    strings = (
        b'{"a": 1, "hash_ids": ["x", "y", "x"], "m": {"hash_ids": [1]}, "s": "]\\""}\n'
        b'{"hash_ids" : [ ] }\n'
        b'{ "hash_ids":[ "" , "a b" ,"x"], "z": [[{"hash_ids": 2}]] }'
    )
    assert scan(strings, strings=True) == expected(strings)
    integers = (
        b'{"hash_ids": [1, -0, 0, 9223372036854775807, -9223372036854775808]}\n'
        b'{"t": 1.5e3, "hash_ids": [12, 123, 1]}\n'
    )
    assert scan(integers, strings=False) == expected(integers)
    assert scan(b"", strings=True) == []


@pytest.mark.parametrize(
    ("line", "strings"),
    [
        (b'{"hash_ids": ["a\\u0041"]}', True),  # an escape
        (b'{"hash_ids": ["\xc3\xa9"]}', True),  # non-ASCII
        (b'{"hash_ids": [1]}', True),  # an id of the other kind
        (b'{"hash_ids": ["1"]}', False),
        (b'{"hash_ids": [1.0]}', False),
        (b'{"hash_ids": [1e3]}', False),
        (b'{"hash_ids": [01]}', False),
        (b'{"hash_ids": [9223372036854775808]}', False),  # beyond int64
        (b'{"hash_ids": [-9223372036854775809]}', False),
        (b'{"hash_ids": [12345678901234567890123]}', False),
        (b'{"hash_ids": null}', True),
        (b'{"hash_ids": "abc"}', True),
        (b'{"hash_ids": ["a"], "hash_ids": ["b"]}', True),  # twice: json.loads takes the last
        (b'{"hash\\u005fids": ["a"]}', True),  # the key written with an escape
        (b'{"other": ["a"]}', True),  # no ids at all
        (b"{}", True),
        (b'{"hash_ids": ["a",]}', True),
        (b'{"hash_ids": ["a" "b"]}', True),
        (b'{"hash_ids": ["a"]', True),  # cut
        (b'{"hash_ids": ["a"]} {"hash_ids": []}', True),  # two objects on a line
        (b'["a"]', True),
    ],
)
def test_what_it_does_not_read_goes_to_the_parser(line: bytes, strings: bool) -> None:
    good = b'{"hash_ids": ["a"]}\n' if strings else b'{"hash_ids": [1]}\n'
    assert scan(good + line + b"\n" + good, strings) is None


def test_one_object_per_id_value_shared_with_the_files_other_path() -> None:
    known = 10**12 + 7
    interned = {known: known}  # what pyarrow's path kept for an earlier chunk
    scanner = _hashc.IdScanner(interned, strings=False)
    first = scanner.scan(b'{"hash_ids": [1000000000007, 5, -0]}\n')[0]
    second = scanner.scan(b'{"hash_ids": [0, 5, 1000000000007]}\n')[0]
    assert first[0][0] is known
    assert second[0][2] is known
    assert first[0][1] is second[0][1]
    assert first[0][2] is second[0][0]
    assert scanner.distinct == 3  # "-0" and "0" are one id


def test_refused_chunks_keep_what_they_read() -> None:
    scanner = _hashc.IdScanner({}, strings=True)
    assert scanner.scan(b'{"hash_ids": ["a", "b"]}\n{"hash_ids": ["\\n"]}\n') is None
    rows = scanner.scan(b'{"hash_ids": ["b", "a"]}\n')[0]
    assert rows == expected(b'{"hash_ids": ["b", "a"]}')


@pytest.mark.parametrize("strings", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_lines_that_begin_like_recent_lines_read_exactly(strings: bool, seed: int) -> None:
    """Tokens taken from a recent line with the same leading bytes: prefixes of one
    another ("1" and "12"), spacing that differs, arrays that end early, many families
    of lines interleaved (more than the scanner remembers)."""
    rng = random.Random(seed)
    vocabulary = ["1", "12", "123", "2", "21", "", "a"] if strings else [1, 12, 123, -1, 0, 21]
    families = [[rng.choice(vocabulary) for _ in range(rng.randint(0, 12))] for _ in range(24)]
    lines = []
    for _ in range(400):
        ids = list(rng.choice(families))
        ids = ids[: rng.randint(0, len(ids))] + [rng.choice(vocabulary) for _ in range(3)]
        gap = rng.choice([",", ", ", " ,", " , "])
        body = gap.join(json.dumps(i) for i in ids)
        opening = rng.choice(["[", "[ "])
        lines.append(
            f'{{"n": {rng.random()}, "hash_ids": {opening}{body}{rng.choice(["]", " ]"])}}}'
        )
    chunk = "\n".join(lines).encode()
    assert scan(chunk, strings) == expected(chunk)


def _outcome(path: Path, fmt: str) -> Any:
    try:
        return ("ok", formats.load_trace(path, fmt, block_tokens=512).requests)
    except UserError as exc:
        return ("error", str(exc))


@pytest.mark.parametrize("strings", [True, False])
def test_a_stripped_chunk_is_the_chunk_with_each_array_written_as_null(strings: bool) -> None:
    """What pyarrow parses beside the scanner: every other byte of every line as it was
    (the values it checks and reads), the ids `scan` reads, and the same refusals."""
    ids = ['"a"', '"b c"', '"0"'] if strings else ["7", "-0", "9000000000000000000"]
    lines = [  # (the line around its array, the array)
        ('{"input_length": 12, "hash_ids": %s, "x": {"y": [1, "]"]}}', f"[{', '.join(ids)}]"),
        ('{"hash_ids":%s ,"z": "hash_ids"}', "[]"),
        ('  {"a": null,  "hash_ids" :  %s  }', f"[ {ids[0]} ]"),
    ]
    for ending in ("\n", ""):  # the chunk's last line with or without its newline
        chunk = ("\n".join(line % array for line, array in lines) + ending).encode()
        rows, text = _hashc.IdScanner({}, strings=strings).scan(chunk)
        assert rows == expected(chunk)
        assert text == ("\n".join(line % "null" for line, _ in lines) + ending).encode()
    refused = b'{"hash_ids": [1.5]}\n' if not strings else b'{"hash_ids": ["\\u00e9"]}\n'
    both = chunk.rstrip(b"\n") + b"\n" + refused
    assert _hashc.IdScanner({}, strings=strings).scan(both) is None
    assert _hashc.IdScanner({}, strings=strings).scan(b"") == ([], b"")


def test_a_bad_value_beside_a_read_array_is_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scanner skips a line's other values without checking them; in the stripped
    chunk pyarrow still parses them, so a line that is not JSON outside its array is the
    row loader's error, with its line number, as without the scanner."""
    monkeypatch.setattr(columnar, "CHUNK_BYTES", 4096)
    lines = [
        json.dumps({"timestamp": n, "input_length": 1024, "output_length": 2, "hash_ids": [n, 7]})
        for n in range(300)
    ]
    lines[150] = lines[150].replace('"output_length": 2', '"output_length": 2x')
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with_scanner = _outcome(path, "mooncake")
    assert with_scanner[0] == "error"
    assert ":151:" in with_scanner[1]
    monkeypatch.setattr(columnar, "_IdScanner", None)
    assert _outcome(path, "mooncake") == with_scanner


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("fmt", ["mooncake", "bursted-art"])
def test_loads_alike_with_and_without_the_scanner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """Many chunks, one of them refused by the scanner (an escaped id, or a float id):
    the same requests as pyarrow's path, and each id value one object in the whole file."""
    monkeypatch.setattr(columnar, "CHUNK_BYTES", 4096)
    rows = []
    for n in range(400):
        shared = [f"p{n % 5}-{k}" for k in range(6)] if fmt == "bursted-art" else [
            (n % 5) * 100 + k for k in range(6)
        ]  # fmt: skip
        own = f"own{n}" if fmt == "bursted-art" else 10**6 + n
        row: dict[str, Any] = {
            "input_length": 512 * 7,
            "output_length": 4,
            "hash_ids": [*shared, own],
        }
        if fmt == "mooncake":
            row["timestamp"] = 10 * n
        else:
            row.update(arrival_s=n / 10, trace_id="t", source="synthetic", request_id=f"r{n}")
        rows.append(row)
    odd = rows[200]["hash_ids"]
    odd[-1] = "own\u00e9" if fmt == "bursted-art" else odd[-1]
    path = _write(tmp_path / "trace.jsonl", rows)
    if fmt == "mooncake":  # a float id: pyarrow's path decides (the row loader refuses it)
        text = path.read_text().replace("1000200]", "1000200.0]")
        path.write_text(text)
    scans: list[bool] = []
    real = columnar._IdScanner

    class Spy:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._scanner = real(*args, **kwargs)

        def scan(self, chunk: bytes) -> Any:
            scanned = self._scanner.scan(chunk)
            scans.append(scanned is not None)
            return scanned

    monkeypatch.setattr(columnar, "_IdScanner", Spy)
    with_scanner = _outcome(path, fmt)
    monkeypatch.setattr(columnar, "_IdScanner", None)
    without = _outcome(path, fmt)
    assert with_scanner == without
    assert True in scans  # both paths inside one load
    assert False in scans
    if fmt == "bursted-art":
        assert with_scanner[0] == "ok"
        requests = with_scanner[1]
        objects = {id(h) for r in requests for h in r.block_hashes}
        assert len(objects) == len({h for r in requests for h in r.block_hashes})
