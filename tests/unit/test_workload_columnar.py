"""The loaders' columnar fast path gives exactly the row loader's requests, errors and
skipped rows: it takes well-formed files and hands everything else to the row loader."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from btb_lab.errors import UserError
from btb_lab.workload import columnar, formats
from btb_lab.workload.generators import GenContext, generate
from btb_lab.workload.hashing import stable_hash63
from btb_lab.workload.writer import bursted_art_rows, write_bursted_art

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "workload"
SAMPLES = ROOT / "experiments" / "workloads"
COLUMNAR = formats._columnar


class Paths:
    """Which path each load took (the spy wraps `formats._columnar`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fast: list[bool] = []
        self._monkeypatch = monkeypatch
        monkeypatch.setattr(formats, "_columnar", self._spy)

    def _spy(self, build: Any, path: Path, block_tokens: int) -> formats.LoadedTrace | None:
        result = COLUMNAR(build, path, block_tokens)
        self.fast.append(result is not None)
        return result

    def row_only(self) -> None:
        self._monkeypatch.setattr(formats, "_columnar", lambda *args: None)


def _outcome(load: Callable[[], formats.LoadedTrace]) -> Any:
    try:
        trace = load()
    except UserError as exc:
        return ("error", str(exc))
    return ("ok", trace.requests, trace.bad_rows)


def both(
    monkeypatch: pytest.MonkeyPatch, path: Path, fmt: str, block_tokens: int = 512, *,
    skip_bad_rows: bool = False,
) -> tuple[Any, Any, bool]:  # fmt: skip
    """(default outcome, row-loader outcome, whether the default took the fast path)."""
    paths = Paths(monkeypatch)

    def load() -> formats.LoadedTrace:
        return formats.load_trace(path, fmt, block_tokens=block_tokens, skip_bad_rows=skip_bad_rows)

    default = _outcome(load)
    took_fast = paths.fast == [True]
    paths.row_only()
    return default, _outcome(load), took_fast


def _seed_bursty_file(tmp_path: Path) -> Path:
    params = {"windows": 2, "bursts": 2, "burst_size": 30, "prefix_tokens": 4096, "decoys": 5}
    requests = generate("seed_bursty", params, GenContext(seed=3, block_tokens=256))
    path = tmp_path / "seed_bursty.jsonl"
    write_bursted_art(requests, path)
    return path


def _bursted_with_real_windows(tmp_path: Path) -> Path:
    params = {
        "windows": 2, "burst_size": 40, "prefix_tokens": 8192, "real_windows": 2,
        "window_s": 2.0, "burst_spread_s": 1.0, "decoy_repeats": 2,
        "real_trace": str(FIXTURES / "mooncake_small.jsonl"),
    }  # fmt: skip
    requests = generate("bursted", params, GenContext(seed=1, block_tokens=512))
    path = tmp_path / "bursted.jsonl"
    write_bursted_art(requests, path)
    return path


WELL_FORMED = [
    (FIXTURES / "mooncake_small.jsonl", "mooncake"),
    (FIXTURES / "art_chat_small.jsonl", "art-chat"),
    (SAMPLES / "bursted_small.jsonl", "bursted-art"),
    (SAMPLES / "agentic_200.jsonl", "bursted-art"),
    (SAMPLES / "gamma_200.jsonl", "bursted-art"),
]


@pytest.mark.parametrize(("path", "fmt"), WELL_FORMED, ids=lambda v: getattr(v, "name", v))
def test_well_formed_files_take_the_fast_path_with_the_same_requests(
    monkeypatch: pytest.MonkeyPatch, path: Path, fmt: str
) -> None:
    fast, rows, took_fast = both(monkeypatch, path, fmt)
    assert took_fast
    assert fast[0] == "ok"
    assert fast == rows


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.jsonl")), ids=lambda p: p.name)
@pytest.mark.parametrize("skip_bad_rows", [False, True])
def test_every_fixture_reads_as_the_row_loader_reads_it(
    monkeypatch: pytest.MonkeyPatch, path: Path, skip_bad_rows: bool
) -> None:
    fmt = {"art": "art-chat", "bursted": "bursted-art", "mooncake": "mooncake"}[
        path.name.split("_")[0]
    ]
    default, rows, _ = both(monkeypatch, path, fmt, skip_bad_rows=skip_bad_rows)
    assert default == rows


@pytest.mark.parametrize("chunk_bytes", [columnar.CHUNK_BYTES, 4096])
def test_generated_windows_load_alike_in_one_or_many_batches(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, chunk_bytes: int
) -> None:
    monkeypatch.setattr(columnar, "CHUNK_BYTES", chunk_bytes)
    for path, block_tokens in (
        (_seed_bursty_file(tmp_path), 256),
        (_bursted_with_real_windows(tmp_path), 512),
    ):
        fast, rows, took_fast = both(monkeypatch, path, "bursted-art", block_tokens)
        assert took_fast
        assert fast == rows
        requests = fast[1]
        # the same ids as hashing every written name, one int object per distinct id
        written = [json.loads(line)["hash_ids"] for line in path.read_text().splitlines()]
        assert [r.block_hashes for r in requests] == [
            tuple(stable_hash63(name) for name in names) for names in written
        ]
        if chunk_bytes > 4096:  # one batch: one int object per distinct id
            objects = {id(h) for r in requests for h in r.block_hashes}
            assert len(objects) == len({h for r in requests for h in r.block_hashes})


@pytest.mark.parametrize("tail", ["", "not json\n"])
def test_the_reading_thread_ends_with_the_load(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tail: str
) -> None:
    """The next chunk is parsed on a thread (its ids scanned on another, where the
    scanner is built); a load leaves none behind, whole or given
    up for the row loader after some chunks (workers and the report fork only from a
    process with one thread), and the requests are those of one chunk at a time."""
    monkeypatch.setattr(columnar, "CHUNK_BYTES", 4096)
    path = _seed_bursty_file(tmp_path)
    text = path.read_text()
    assert len(text) > 10 * 4096  # many chunks
    path.write_text(text + tail)
    threads: list[int] = []
    real = columnar._json_chunks

    def counting(*args: Any) -> Any:
        for batches in real(*args):
            threads.append(threading.active_count())
            yield batches

    monkeypatch.setattr(columnar, "_json_chunks", counting)
    before = threading.active_count()
    default, rows, took_fast = both(monkeypatch, path, "bursted-art", 256, skip_bad_rows=True)
    # the parse ran on a thread of its own, the scan on another
    assert max(threads) == before + 1 + (columnar._IdScanner is not None)
    assert threading.active_count() == before
    assert took_fast == (not tail)
    assert default == rows


def test_mooncake_line_numbers_run_on_across_batches(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 10 * i, "input_length": 1024, "output_length": 4, "hash_ids": [i % 7, i]}
        for i in range(600)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.setattr(columnar, "CHUNK_BYTES", 4096)
    fast, slow, took_fast = both(monkeypatch, path, "mooncake")
    assert took_fast
    assert fast == slow
    assert fast[1][-1].request_id == "trace-600"


def test_parquet_files_take_the_fast_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = _seed_bursty_file(tmp_path)
    requests = formats.load_trace(source, "bursted-art", block_tokens=256).requests
    path = tmp_path / "windows.parquet"
    pq.write_table(pa.Table.from_pylist(list(bursted_art_rows(requests))), path)
    fast, rows, took_fast = both(monkeypatch, path, "bursted-art", 256)
    assert took_fast
    assert fast == rows
    chat = tmp_path / "chat.parquet"
    lines = (FIXTURES / "art_chat_small.jsonl").read_text().splitlines()
    table = pa.Table.from_pylist([json.loads(line) for line in lines])
    narrow = table.set_column(  # int32 lengths widen exactly
        table.schema.get_field_index("input_length"), "input_length",
        table.column("input_length").cast(pa.int32()),
    )  # fmt: skip
    pq.write_table(narrow, chat)
    fast, rows, took_fast = both(monkeypatch, chat, "art-chat")
    assert took_fast
    assert fast == rows


def test_one_turn_may_hold_several_requests_of_a_session(tmp_path: Path) -> None:
    path = _seed_bursty_file(tmp_path)
    requests = formats.load_trace(path, "bursted-art", block_tokens=256).requests
    bursts = [r for r in requests if ":burst:" in r.request_id]
    assert len(bursts) == 2 * 2 * 30
    assert {r.turn for r in bursts} == {1}
    rows = [
        {"arrival_s": t, "trace_id": "w", "source": "art", "request_id": name,
         "input_length": 10, "output_length": 1, "hash_ids": ["a"], "session_id": "s",
         "metadata": {"turn": turn}}
        for name, t, turn in (("a", 1.0, 1), ("b", 3.0, 1), ("c", 2.0, 2))
    ]  # fmt: skip
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(row) + "\n" for row in rows))
    # turn 2 arrives before the second request of turn 1
    with pytest.raises(UserError, match="turn 2 of session 's' is out of order with turn 1"):
        formats.load_trace(bad, "bursted-art")


BURSTED = (
    '{"arrival_s": 1.0, "trace_id": "w", "source": "art", "request_id": "r1", '
    '"input_length": 1024, "output_length": 3, "hash_ids": ["p", "q"], '
    '"session_id": "s", "group_id": null, "metadata": {"turn": 1}}'
)
MOONCAKE = '{"timestamp": 5, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]}'


def _bursted(**changes: Any) -> str:
    row = json.loads(BURSTED)
    row.update(changes)
    return json.dumps(row)


ODD_FILES = {
    # fall back, same outcome as the row loader
    "blank line": ("mooncake", MOONCAKE + "\n\n" + MOONCAKE + "\n"),
    "crlf": ("mooncake", MOONCAKE + "\r\n" + MOONCAKE + "\r\n"),
    "byte-order mark": ("mooncake", "\ufeff" + MOONCAKE + "\n"),
    "two objects on a line": ("mooncake", MOONCAKE + " " + MOONCAKE + "\n"),
    "no final newline": ("mooncake", MOONCAKE + "\n" + MOONCAKE),
    "float length": ("mooncake", MOONCAKE.replace("1024", "1024.0") + "\n"),
    "half length": ("mooncake", MOONCAKE.replace("1024", "1024.5") + "\n"),
    "bool id": ("mooncake", MOONCAKE.replace("[1, 2]", "[true, 2]") + "\n"),
    "string id in mooncake": ("mooncake", MOONCAKE.replace("[1, 2]", '["1", 2]') + "\n"),
    "time goes back": ("mooncake", MOONCAKE + "\n" + MOONCAKE.replace(": 5", ": 4") + "\n"),
    "too many ids": ("mooncake", MOONCAKE.replace("1024", "512") + "\n"),
    "nan time": ("mooncake", MOONCAKE.replace(": 5", ": NaN") + "\n"),
    "big int id": ("mooncake", MOONCAKE.replace("[1, 2]", "[1, 99999999999999999999]") + "\n"),
    "duplicate key": ("mooncake", MOONCAKE.replace("{", '{"timestamp": 9, ', 1) + "\n"),
    "tab in a string": ("bursted-art", BURSTED.replace('"r1"', '"r\t1"') + "\n"),
    "null turn": ("bursted-art", _bursted(metadata={"turn": None}) + "\n"),
    "null turn among turns": (
        "bursted-art",
        _bursted() + "\n" + _bursted(request_id="r2", metadata={"turn": None}) + "\n",
    ),
    "null turn with an escaped key": (
        "bursted-art",
        _bursted(metadata={"turn": None}).replace('"turn"', '"tu\\u0072n"') + "\n",
    ),
    "no turn": ("bursted-art", _bursted(metadata={"split": "test"}) + "\n"),
    "metadata string": ("bursted-art", _bursted(metadata='{"turn": 2}') + "\n"),
    "turn zero": ("bursted-art", _bursted(metadata={"turn": 0}) + "\n"),
    "integer request id": ("bursted-art", _bursted(request_id=7) + "\n"),
    "integer ids": ("bursted-art", _bursted(hash_ids=[1, 2]) + "\n"),
    "mixed ids": ("bursted-art", _bursted(hash_ids=["p", 2]) + "\n"),
    "unknown source": ("bursted-art", _bursted(source="web") + "\n"),
    "missing trace id": ("bursted-art", _bursted(trace_id=None) + "\n"),
    "repeated request id": ("bursted-art", BURSTED + "\n" + BURSTED + "\n"),
    "turns out of order": (
        "bursted-art",
        _bursted(metadata={"turn": 2}) + "\n" + _bursted(request_id="r2", arrival_s=2.0) + "\n",
    ),
    "not an object": ("bursted-art", BURSTED + "\n[1, 2]\n"),
    "empty file": ("mooncake", ""),
}


@pytest.mark.parametrize("name", sorted(ODD_FILES))
@pytest.mark.parametrize("skip_bad_rows", [False, True])
def test_odd_files_read_exactly_as_the_row_loader_reads_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, skip_bad_rows: bool
) -> None:
    fmt, text = ODD_FILES[name]
    path = tmp_path / "trace.jsonl"
    path.write_bytes(text.encode())
    default, rows, _ = both(monkeypatch, path, fmt, skip_bad_rows=skip_bad_rows)
    assert default == rows


@pytest.mark.parametrize(
    "name",
    ["blank line", "crlf", "byte-order mark", "two objects on a line", "float length",
     "bool id", "time goes back", "too many ids", "nan time", "duplicate key",
     "tab in a string", "null turn", "null turn among turns", "turn zero",
     "null turn with an escaped key",
     "integer request id", "unknown source", "repeated request id", "turns out of order"],
)  # fmt: skip
def test_odd_files_fall_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str) -> None:
    fmt, text = ODD_FILES[name]
    path = tmp_path / "trace.jsonl"
    path.write_bytes(text.encode())
    _, _, took_fast = both(monkeypatch, path, fmt, skip_bad_rows=True)
    assert not took_fast


def test_a_row_without_a_turn_keeps_the_fast_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(_bursted(metadata={"split": "test"}) + "\n" + _bursted(request_id="r2") + "\n")
    fast, rows, took_fast = both(monkeypatch, path, "bursted-art")
    assert took_fast
    assert fast == rows
    assert [r.turn for r in fast[1]] == [1, 1]


@pytest.mark.parametrize(("kind", "fast"), [("summarize", True), ("", False)])
def test_job_kind_is_read_alike_on_both_paths(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str, fast: bool
) -> None:
    """A `metadata.job_kind` (the prompt-hint prior) comes through the fast path as the row
    loader reads it; an empty one, which the row loader refuses, falls back to it."""
    rows = [
        {"arrival_s": float(i), "trace_id": "w", "source": "synthetic", "request_id": f"r{i}",
         "input_length": 512, "output_length": 1, "hash_ids": [i],
         "metadata": {"job_kind": kind} if i else {}}
        for i in range(3)
    ]  # fmt: skip
    path = tmp_path / "kinds.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    default, row_loader, took_fast = both(monkeypatch, path, "bursted-art")
    assert default == row_loader
    assert took_fast is fast
    if fast:
        assert [r.job_kind for r in default[1]] == [None, kind, kind]


@pytest.mark.parametrize("fast", [True, False])
def test_an_id_is_one_object_across_the_whole_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast: bool
) -> None:
    """A prefix shared by rows far apart (other read batches) is the same int objects in
    each: the simulator's caches match a burst's blocks by identity."""
    monkeypatch.setattr(columnar, "CHUNK_BYTES", 2048)  # many batches
    path = tmp_path / "trace.jsonl"
    prefix = [10**9 + i for i in range(8)]
    rows = [
        {"timestamp": 10 * n, "input_length": 5120, "output_length": 4,
         "hash_ids": [*prefix, 2 * 10**9 + n]}
        for n in range(300)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    paths = Paths(monkeypatch)
    if not fast:
        paths.row_only()
    requests = formats.load_trace(path, "mooncake", block_tokens=512).requests
    assert paths.fast == ([True] if fast else [])
    first, last = requests[0].block_hashes, requests[-1].block_hashes
    assert first[:8] == last[:8] == tuple(prefix)
    assert all(a is b for a, b in zip(first[:8], last[:8], strict=True))


_hashc = pytest.importorskip("btb_lab.workload._hashc", reason="built by `make install`")


def test_the_compiled_id_loops_are_the_loaders_and_give_the_python_loops_rows(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`_hashc.interned` / `rows_of_ids` against the pure-Python loops: the same block
    ids, row for row, and the same sharing (one object per distinct id of the file)."""
    assert columnar._rows_of_ids is _hashc.rows_of_ids
    assert columnar._interned is _hashc.interned
    monkeypatch.setattr(columnar, "CHUNK_BYTES", 8192)  # several batches
    path = _seed_bursty_file(tmp_path)

    def load() -> list[tuple[int, ...]]:
        requests = formats.load_trace(path, "bursted-art", block_tokens=256).requests
        assert len({id(h) for r in requests for h in r.block_hashes}) == len(
            {h for r in requests for h in r.block_hashes}
        )
        return [r.block_hashes for r in requests]

    compiled = load()
    monkeypatch.setattr(columnar, "_rows_of_ids", columnar.python_rows_of_ids)
    monkeypatch.setattr(columnar, "_interned", columnar.python_interned)
    assert load() == compiled
    assert sum(map(len, compiled)) > 2_000


@pytest.mark.parametrize("loops", ["compiled", "python"])
def test_the_id_loops_check_their_arrays(loops: str) -> None:
    import numpy as np

    rows_of_ids = _hashc.rows_of_ids if loops == "compiled" else columnar.python_rows_of_ids
    interned = _hashc.interned if loops == "compiled" else columnar.python_interned
    ids = [7, 8, 9]
    index = np.array([2, 0, 0, 1], dtype=np.int64)
    for width in (np.int64, np.int32):  # Arrow's dictionary indices are int32
        rows = rows_of_ids(ids, index.astype(width), np.array([0, 1, 1, 4], dtype=np.int64))
        assert rows == [(9,), (), (7, 7, 8)]
    with pytest.raises(ValueError, match="out of range"):
        rows_of_ids(ids, np.array([5], dtype=np.int32), np.array([0, 1], dtype=np.int64))
    assert rows_of_ids(ids, index[:0], np.array([0], dtype=np.int64)) == []
    with pytest.raises(ValueError, match="out of range"):
        rows_of_ids(ids, np.array([3], dtype=np.int64), np.array([0, 1], dtype=np.int64))
    with pytest.raises(ValueError, match="out of range"):
        rows_of_ids(ids, np.array([-1], dtype=np.int64), np.array([0, 1], dtype=np.int64))
    table: dict[int, int] = {}
    big = 10**12
    first = interned(table, [big, big + 1])
    again = interned(table, [int(str(big)), big + 2])
    assert again == [big, big + 2]
    assert again[0] is first[0]
    if loops == "compiled":
        with pytest.raises(ValueError, match="bounds"):
            rows_of_ids(ids, index, np.array([0, 3, 2], dtype=np.int64))
        with pytest.raises(ValueError, match="bounds"):
            rows_of_ids(ids, index, np.array([0, 5], dtype=np.int64))
        with pytest.raises(TypeError, match="int64"):
            rows_of_ids(ids, index.astype(np.int16), np.array([0, 1], dtype=np.int64))
        with pytest.raises(TypeError, match="int64"):
            rows_of_ids(ids, index, np.array([0, 1], dtype=np.int32))
        with pytest.raises(TypeError):
            interned([], [1])


@pytest.mark.parametrize(("path", "fmt"), WELL_FORMED, ids=lambda v: getattr(v, "name", v))
def test_gzip_files_load_as_their_plain_text(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, path: Path, fmt: str
) -> None:
    """A published `trace.jsonl.gz` reads as is, on both paths, to the requests of the
    file it decompresses to (request ids from the name without `.gz`)."""
    import gzip

    plain = formats.load_trace(path, fmt, block_tokens=512)
    packed = tmp_path / f"{path.name}.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    fast, rows, took_fast = both(monkeypatch, packed, fmt)
    assert took_fast
    assert fast == rows == ("ok", plain.requests, plain.bad_rows)


def test_a_cut_gzip_file_is_an_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import gzip

    source = SAMPLES / "bursted_small.jsonl"
    packed = gzip.compress(source.read_bytes())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed[: len(packed) // 2])
    default, rows, took_fast = both(monkeypatch, cut, "bursted-art")
    assert not took_fast
    assert default == rows
    assert default[0] == "error"
    assert default[1].startswith(f"{cut}:")
    assert "gzip stream ends early" in default[1]
