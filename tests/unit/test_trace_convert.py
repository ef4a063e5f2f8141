"""`btb-lab trace convert`: a Bursted-ART trace rewritten as parquet with integer block ids
loads to the same requests (every field, in order), through the columnar reader, and a
run replays it to the same records."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from btb_lab import runner
from btb_lab.records import Request
from btb_lab.workload import writer
from btb_lab.workload.formats import load_trace
from btb_lab.workload.generators import GenContext, generate
from tests.golden.test_headlines import records_digest
from tests.helpers import cli
from tests.unit.test_sweep_points import BASE
from tests.unit.test_workload_columnar import Paths

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "workload"
WRITE = writer.write_bursted_art_parquet


def _generated(folder: Path, kind: str, params: dict[str, object]) -> Path:
    path = folder / f"{kind}.jsonl"
    writer.write_bursted_art(generate(kind, params, GenContext(seed=5, block_tokens=256)), path)
    return path


JOB_WITHOUT_TURN = """\
{"arrival_s": 0.0, "trace_id": "w", "source": "art", "request_id": "a", "input_length": 1024, \
"output_length": 1, "hash_ids": ["x", "y"], "session_id": "s", "metadata": {"turn": 2}}
{"arrival_s": 5.0, "trace_id": "w", "source": "art", "request_id": "b", "input_length": 1024, \
"output_length": 1, "hash_ids": ["x", "y"], "session_id": "s", "metadata": {"job_kind": "burst"}}
"""


def _sources(folder: Path) -> list[Path]:
    """Strings ids, turns given and not, sessions, job kinds, windows out of file order;
    a job kind without a turn after a later turn of its session (its turn 1 written
    explicitly made the file fail its own turn-order check)."""
    job = folder / "job_without_turn.jsonl"
    job.write_text(JOB_WITHOUT_TURN, encoding="utf-8")
    return [
        job,
        FIXTURES / "bursted_art_small.jsonl",
        _generated(folder, "agentic", {"sessions": 12, "turns_mean": 4}),
        _generated(
            folder,
            "bursted",
            {
                "windows": 2,
                "burst_size": 20,
                "prefix_tokens": 4096,
                "hinted_bursts": 0.5,
                "hinted_decoys": 0.3,
            },
        ),
    ]


def test_a_converted_trace_loads_to_the_same_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for source in _sources(tmp_path):
        out = tmp_path / f"{source.stem}.parquet"
        result = cli("trace", "convert", source, "-o", out)
        assert result.code == 0, result.output
        assert (
            f"wrote {len(load_trace(source, 'bursted-art', block_tokens=1).requests):,} rows"
            in result.out
        )
        paths = Paths(monkeypatch)
        for block_tokens in (1, 256):
            expected = load_trace(source, "bursted-art", block_tokens=block_tokens)
            got = load_trace(out, "bursted-art", block_tokens=block_tokens)
            assert got.requests == expected.requests
            assert not got.bad_rows
            ids = {id(b) for r in got.requests for b in r.block_hashes}
            assert len(ids) == len({b for r in got.requests for b in r.block_hashes})
        assert paths.fast[1::2] == [True, True]  # the parquet loads took the columnar path


def test_a_run_replays_a_converted_trace_to_the_same_records(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "bursted_art_small.jsonl", tmp_path / "trace.jsonl")
    assert (
        cli("trace", "convert", tmp_path / "trace.jsonl", "-o", tmp_path / "trace.parquet").code
        == 0
    )
    digests = []
    for name in ("trace.jsonl", "trace.parquet"):
        hypothesis = tmp_path / f"{name}.yaml"
        workload = f"trace: {{path: {name}, format: bursted-art}}"
        hypothesis.write_text(BASE.replace("{workload}", workload), encoding="utf-8")
        out = tmp_path / f"run-{name}"
        runner.run_hypothesis(hypothesis, runner.RunOptions(out=out, progress=False))
        digests.append(records_digest(out))
    assert digests[0] == digests[1]


def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out.parquet"
    result = cli("trace", "convert", FIXTURES / "mooncake_small.jsonl", "-o", out)
    assert result.code == 2
    assert not result.traceback
    assert "a mooncake trace; convert rewrites Bursted-ART traces" in result.err

    result = cli(
        "trace", "convert", FIXTURES / "bursted_art_small.jsonl", "-o", tmp_path / "x.jsonl"
    )
    assert result.code == 2
    assert "the output must be a .parquet file" in result.err

    bad = FIXTURES / "bursted_art_bad.jsonl"
    result = cli("trace", "convert", bad, "-o", out)
    assert result.code == 2
    assert not result.traceback
    assert result.err.startswith(f"error: {bad}:")
    assert not out.exists()

    result = cli("trace", "convert", bad, "-o", out, "--skip-bad-rows")
    assert result.code == 0, result.output
    kept = load_trace(bad, "bursted-art", block_tokens=1, skip_bad_rows=True)
    assert f"{len(kept.bad_rows)} malformed rows left out" in result.out
    assert load_trace(out, "bursted-art", block_tokens=1).requests == kept.requests


def test_a_turn_out_of_range_is_named_at_its_line(tmp_path: Path) -> None:
    """A turn past int64 was reported by convert as "a block id does not fit in 64 bits"
    (the row has none); every loader now bounds the turn at the row."""
    source = tmp_path / "t.jsonl"
    source.write_text(
        '{"arrival_s": 0.0, "trace_id": "w", "source": "art", "request_id": "a", '
        '"input_length": 512, "output_length": 1, "hash_ids": [], '
        '"metadata": {"turn": 99999999999999999999999}}\n',
        encoding="utf-8",
    )
    for command in (["convert", source, "-o", tmp_path / "t.parquet"], ["inspect", source]):
        result = cli("trace", *command)
        assert result.code == 2, result.output
        assert not result.traceback
        assert f"{source}:1: field 'metadata.turn': must be an integer from 1 to" in result.err
    assert not (tmp_path / "t.parquet").exists()


def test_the_output_follows_the_umask_and_an_unwritable_one_is_named(tmp_path: Path) -> None:
    """mkstemp made the output private (0600); a folder that cannot be written was
    reported as the temporary file's."""
    import os

    out = tmp_path / "o.parquet"
    result = cli("trace", "convert", FIXTURES / "bursted_art_small.jsonl", "-o", out)
    assert result.code == 0, result.output
    umask = os.umask(0o022)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask
    (tmp_path / "file").write_text("x")
    blocked = tmp_path / "file" / "o.parquet"  # its folder is a file
    result = cli("trace", "convert", FIXTURES / "bursted_art_small.jsonl", "-o", blocked)
    assert result.code == 2, result.output
    assert f"--out {blocked}: cannot write there" in result.err


def _drop_last(requests: list[Request], path: Path) -> int:
    return WRITE(requests[:-1], path)


def _not_parquet(requests: list[Request], path: Path) -> int:
    path.write_bytes(b"not parquet")
    return len(requests)


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (_drop_last, "did not load to the same requests; not written"),
        (_not_parquet, "the parquet file did not load back ("),
    ],
)
def test_a_file_that_does_not_load_back_the_same_is_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: Any, message: str
) -> None:
    monkeypatch.setattr(writer, "write_bursted_art_parquet", write)
    out = tmp_path / "out.parquet"
    out.write_bytes(b"an earlier file")
    result = cli("trace", "convert", FIXTURES / "bursted_art_small.jsonl", "-o", out, "--force")
    assert result.code == 2
    assert not result.traceback
    assert message in result.err
    assert out.read_bytes() == b"an earlier file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.parquet"]  # no partial file


@pytest.mark.parametrize("command", ["convert", "generate"])
def test_an_existing_output_is_replaced_only_with_force(tmp_path: Path, command: str) -> None:
    """A converted or generated trace may be the only copy of what a run replayed."""
    out = tmp_path / ("out.parquet" if command == "convert" else "out.jsonl")
    out.write_bytes(b"an earlier file")
    args = (["convert", FIXTURES / "bursted_art_small.jsonl"] if command == "convert"
            else ["generate", "poisson", "-p", "requests=5"])  # fmt: skip
    refused = cli("trace", *args, "-o", out)
    assert refused.code == 2, refused.output
    assert f"--out {out}: the file exists; --force replaces it" in refused.err
    assert out.read_bytes() == b"an earlier file"
    forced = cli("trace", *args, "-o", out, "--force")
    assert forced.code == 0, forced.output
    assert out.read_bytes() != b"an earlier file"
    directory = tmp_path / ("d.parquet" if command == "convert" else "d.jsonl")
    directory.mkdir()
    folder = cli("trace", *args, "-o", directory)
    assert folder.code == 2
    assert "is a directory" in folder.err


def test_a_source_named_like_the_old_temporary_file_is_kept(tmp_path: Path) -> None:
    # the temporary file was `.{stem}.partial.parquet`: converting that very file to
    # `{stem}.parquet` wrote over the source and moved it away
    first = tmp_path / ".bh.partial.parquet"
    assert cli("trace", "convert", FIXTURES / "bursted_art_small.jsonl", "-o", first).code == 0
    before = first.read_bytes()
    result = cli("trace", "convert", first, "-o", tmp_path / "bh.parquet")
    assert result.code == 0, result.output
    assert first.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".bh.partial.parquet", "bh.parquet"]
