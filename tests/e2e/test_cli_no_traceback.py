"""Where the CLI promises one line and exit 2, it never shows a traceback (issue 16, item 7)
and names the right thing (item 10): unreadable traces and sweep files, a binary file in
`hypotheses/`, a directory given as the log, ports out of range or in use."""

from __future__ import annotations

import builtins
import io
import os
import socket
from pathlib import Path

import pytest

from tests.helpers import cli, write_small

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "workload"
BINARY = bytes(range(256)) * 8  # not UTF-8, not JSON, not parquet


def one_line_exit_2(result, *expected: str) -> None:
    assert result.code == 2, result.output
    assert not result.traceback, result.output
    for text in expected:
        assert text in result.output, result.output


def trace_hypothesis(folder: Path, trace: str) -> Path:
    return write_small(
        folder,
        **{"  generator:\n    kind: poisson\n    params: {requests: 60, rate_per_s: 4.0}":
           f"  trace:\n    path: {trace}\n    format: mooncake"},
    )  # fmt: skip


@pytest.fixture
def bad_traces(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "binary.jsonl").write_bytes(BINARY)
    (tmp_path / "fake.parquet").write_text('{"timestamp": 0}\n', encoding="utf-8")
    (tmp_path / "binary.parquet").write_bytes(BINARY)
    (tmp_path / "folder.jsonl").mkdir()
    return {p.name: p for p in tmp_path.iterdir()}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("binary.jsonl", "not UTF-8 text"),
        ("fake.parquet", "not a readable parquet file"),
        ("binary.parquet", "not a readable parquet file"),
        ("folder.jsonl", "is a directory, not a trace file"),
    ],
)
def test_trace_inspect_and_run_name_an_unreadable_trace(
    tmp_path: Path, bad_traces: dict[str, Path], name: str, expected: str
) -> None:
    path = bad_traces[name]
    one_line_exit_2(cli("trace", "inspect", path, "--format", "mooncake"), str(path), expected)
    one_line_exit_2(cli("trace", "inspect", path), str(path), expected)  # --format auto
    hyp = trace_hypothesis(tmp_path, name)
    result = cli("run", hyp, "--no-progress", "--out", tmp_path / "out")
    one_line_exit_2(result, str(path), expected)
    assert not (tmp_path / "out").exists()  # refused before the run directory existed


def test_a_pipe_as_the_trace_is_refused_before_the_run(tmp_path: Path) -> None:
    """A run reads its trace more than once (its checksum beside the parse): a pipe would
    be empty the second time, so it is named as such, not as a missing file."""
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    hyp = trace_hypothesis(tmp_path, "pipe.jsonl")
    result = cli("run", hyp, "--no-progress", "--out", tmp_path / "out")
    one_line_exit_2(result, str(fifo), "not a regular file (a pipe or a device)")
    assert "not found" not in result.output
    assert not (tmp_path / "out").exists()
    for fmt in ("mooncake", "auto"):  # refused before it is opened (which would wait)
        inspected = cli("trace", "inspect", fifo, "--format", fmt)
        one_line_exit_2(inspected, str(fifo), "not a regular file (a pipe or a device)")


def test_a_trace_that_cannot_be_opened_is_one_line(tmp_path: Path, monkeypatch) -> None:
    # (as root a chmod 000 file stays readable, so the permission error is simulated)
    trace = tmp_path / "locked.jsonl"
    trace.write_bytes((FIXTURES / "mooncake_small.jsonl").read_bytes())
    real_open = builtins.open

    def guarded_open(file, *args, **kwargs):
        if Path(str(file)).name == "locked.jsonl":
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)  # Path.open calls io.open
    one_line_exit_2(cli("trace", "inspect", trace, "--format", "mooncake"),
                    f"{trace}: cannot read: Permission denied")  # fmt: skip


def test_an_empty_trace_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n", encoding="utf-8")
    hyp = trace_hypothesis(tmp_path, "empty.jsonl")
    result = cli("run", hyp, "--no-progress", "--out", tmp_path / "out")
    one_line_exit_2(result, f"{tmp_path / 'empty.jsonl'}: trace has no requests")


def test_a_binary_sweep_file_is_one_line(tmp_path: Path) -> None:
    sweep = tmp_path / "s.yaml"
    sweep.write_bytes(BINARY)
    one_line_exit_2(cli("sweep", sweep, "--dry-run"), f"{sweep}: not a text (UTF-8) file")


def test_list_survives_a_binary_yaml_in_hypotheses(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hypotheses").mkdir()
    write_small(tmp_path / "hypotheses")
    (tmp_path / "hypotheses" / "junk.yaml").write_bytes(BINARY)
    result = cli("list")
    assert result.code == 0, result.output
    assert "HS" in result.out
    assert "(unreadable YAML)" in result.out


def test_log_append_to_a_directory_is_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    hyp = write_small(tmp_path)
    assert cli("run", hyp, "--no-progress", "--out", tmp_path / "run").code == 0
    (tmp_path / "logs").mkdir()
    one_line_exit_2(cli("log", "append", tmp_path / "run", "--log", tmp_path / "logs"),
                    "is a directory, not a log file")  # fmt: skip


def attached_cluster(folder: Path) -> Path:
    """A cluster hypothesis that attaches to an endpoint: `router serve` launches nothing."""
    return write_small(
        folder,
        **{"backend: sim": "backend: cluster",
           "    - {role: C, count: 2, gpu: H100, gpus: 4}":
           "    - {role: C, count: 1, gpu: H100, gpus: 4}\n"
           "  launch: {endpoints: ['http://127.0.0.1:9'], served_model: tiny}"},
    )  # fmt: skip


def test_router_serve_refuses_a_port_out_of_range(tmp_path: Path) -> None:
    hyp = attached_cluster(tmp_path)
    result = cli("router", "serve", "--hypothesis", hyp, "--variant", "base", "--port", "99999")
    one_line_exit_2(result, "--port")
    assert "router (" not in result.output


def test_router_serve_names_a_port_in_use_before_starting_anything(tmp_path: Path) -> None:
    hyp = attached_cluster(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli("router", "serve", "--hypothesis", hyp, "--variant", "base",
                     "--port", str(port))  # fmt: skip
    one_line_exit_2(result, f"cannot listen on 127.0.0.1:{port}")
    assert "router (" not in result.output  # nothing claimed to listen


def test_a_bad_sweep_grid_path_is_blamed_on_the_sweep_file(tmp_path: Path) -> None:
    base = write_small(tmp_path)
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nbase: hs.yaml\ngrid:\n  repeats: [1, many]\n", encoding="utf-8")
    result = cli("sweep", sweep, "--dry-run")
    one_line_exit_2(result, f"{sweep}:4: grid.repeats", "repeats: Input should be a valid integer")
    assert f"{base}:" not in result.output
