"""Bad input to the trace tools, the loaders, the generators and the hypothesis schema:
each is refused with one line naming the file and line, the field or the flag, exit 2

1. `--block-tokens 0` divided by zero in the row loader; a negative size gave "allows at
   most -13".
2. The 10,000,000-token limit on `input_length` / `output_length` held only past int64:
   the columnar fast path took 20,000,000, and the message printed integers as floats.
3. `log show --log BINARY` said "input is not UTF-8 text" without naming the file.
4. `trace inspect -f FORMAT` printed `rows 0` for an empty trace or a parquet file without
   the format's columns; `trace audit` printed "largest None".
5. A variant named "" or "x,y" validated, though `--variants` can never select it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from btb_lab.config.limits import MAX_TOKENS
from btb_lab.errors import UserError
from btb_lab.workload.formats import load_trace
from btb_lab.workload.generators import GenContext, generate, parse_params
from btb_lab.workload.writer import write_bursted_art
from tests.helpers import cli, write_small

ONE_ROW = {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": list(range(14))}

ROWS: dict[str, dict[str, Any]] = {
    "mooncake": {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
    "bursted-art": {
        "arrival_s": 0.0, "trace_id": "w", "source": "art", "request_id": "r",
        "input_length": 1024, "output_length": 5, "hash_ids": ["p", "q"],
    },
    "art-chat": {
        "timestamp_ms": 0, "request_id": "r", "system_prompt_hash": "s",
        "input_length": 1024, "output_length": 5, "hash_ids": [1, 2],
    },
}  # fmt: skip


def _rows(fmt: str, count: int, **last: Any) -> list[dict[str, Any]]:
    """`count` well-formed rows of `fmt` (distinct ids, arrivals in order), the last one
    changed by `last`."""
    rows = []
    for i in range(count):
        row = dict(ROWS[fmt])
        if "request_id" in row:
            row["request_id"] = f"r{i}"
        rows.append(row)
    rows[-1].update(last)
    return rows


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def refused(result: Any, *expected: str) -> None:
    assert result.code == 2, result.output
    assert not result.traceback, result.output
    assert len(result.err.strip().splitlines()) == 1, result.output
    for text in expected:
        assert text in result.output, result.output


# ------------------------------------------------------------- (1) block size below 1


@pytest.mark.parametrize("block_tokens", ["0", "-512", "1048577", "99999999999999999999999"])
@pytest.mark.parametrize("command", ["inspect", "audit"])
def test_block_tokens_out_of_range_names_the_flag(
    tmp_path: Path, command: str, block_tokens: str
) -> None:
    """Past int64 the block arithmetic raised OverflowError, a traceback."""
    trace = _write(tmp_path / "one.jsonl", [ONE_ROW])
    result = cli("trace", command, trace, "--block-tokens", block_tokens)
    refused(result, f"--block-tokens must be an integer from 1 to 1,048,576 (got {block_tokens})")
    assert "allows at most" not in result.output


def test_generate_refuses_block_tokens_below_one(tmp_path: Path) -> None:
    out = tmp_path / "g.jsonl"
    refused(cli("trace", "generate", "poisson", "-o", out, "--block-tokens", "0"),
            "--block-tokens must be an integer from 1 to 1,048,576 (got 0)")  # fmt: skip
    assert not out.exists()


@pytest.mark.parametrize("fmt", sorted(ROWS))
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("block_tokens", [0, -512])
def test_loaders_refuse_block_tokens_below_one(
    tmp_path: Path, fmt: str, suffix: str, block_tokens: int
) -> None:
    path = _write(tmp_path / f"t{suffix}", _rows(fmt, 2))
    expected = rf"block_tokens must be an integer from 1 to 1,048,576 \(got {block_tokens}\)"
    with pytest.raises(UserError, match=expected):
        load_trace(path, fmt, block_tokens=block_tokens)


def test_generators_refuse_block_tokens_below_one() -> None:
    with pytest.raises(
        UserError, match=r"block_tokens must be an integer from 1 to 1,048,576 \(got 0\)"
    ):
        GenContext(seed=0, block_tokens=0)


# ------------------------------------------------------------- (2) the token limit


@pytest.mark.parametrize("fmt", sorted(ROWS))
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("field", ["input_length", "output_length"])
@pytest.mark.parametrize("value", [MAX_TOKENS + 1, 20_000_000, 2**63 - 1])
def test_lengths_above_the_limit_are_refused_on_every_path(
    tmp_path: Path, fmt: str, suffix: str, field: str, value: int
) -> None:
    """Row 2 is too long: the columnar reader must hand the file to the row loader, which
    names the line; the count prints as an integer."""
    path = _write(tmp_path / f"t{suffix}", _rows(fmt, 2, **{field: value}))
    expected = f"{path}:2: field {field!r}: {value:,} tokens is more than the limit of 10,000,000"
    with pytest.raises(UserError) as caught:
        load_trace(path, fmt)
    assert str(caught.value) == expected
    skipped = load_trace(path, fmt, skip_bad_rows=True)
    assert len(skipped.requests) == 1
    assert skipped.bad_rows == [expected]


@pytest.mark.parametrize("fmt", sorted(ROWS))
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_the_limit_itself_is_accepted(tmp_path: Path, fmt: str, suffix: str) -> None:
    path = _write(tmp_path / f"t{suffix}", _rows(fmt, 2, input_length=MAX_TOKENS))
    assert load_trace(path, fmt).requests[-1].input_tokens == MAX_TOKENS


def test_a_float_too_large_to_be_exact_prints_as_written(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(ONE_ROW).replace("6758", "1e29") + "\n", encoding="utf-8")
    with pytest.raises(UserError, match="field 'input_length': 1e\\+29 tokens is more than"):
        load_trace(path, "mooncake")


def test_inspect_and_run_refuse_a_parquet_length_above_the_limit(tmp_path: Path) -> None:
    path = _write(tmp_path / "big.parquet", _rows("mooncake", 1, input_length=50_000_000))
    expected = f"{path}:1: field 'input_length': 50,000,000 tokens is more than the limit"
    refused(cli("trace", "inspect", "-f", "mooncake", path), expected)
    hyp = write_small(
        tmp_path,
        **{"  generator:\n    kind: poisson\n    params: {requests: 60, rate_per_s: 4.0}":
           "  trace:\n    path: big.parquet\n    format: mooncake"},
    )  # fmt: skip
    refused(cli("run", hyp, "--no-progress", "--out", tmp_path / "out"), expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("bursted", {"windows": 1, "burst_size": 4, "decoys_per_window": 0,
                     "background_rate_per_s": 0, "prefix_tokens": MAX_TOKENS - 1}),
        ("bursted", {"windows": 1, "bursts_per_window": 0, "decoys_per_window": 0,
                     "background_rate_per_s": 0.5, "window_s": 10.0, "burst_spread_s": 1.0,
                     "background_prefixes": 1, "background_prefix_tokens": MAX_TOKENS - 1}),
        ("poisson", {"requests": 3, "prefixes": 1, "shared_fraction": 1.0,
                     "prefix_tokens": MAX_TOKENS - 1}),
    ],
)  # fmt: skip
def test_generators_stay_within_the_limit(
    tmp_path: Path, kind: str, params: dict[str, Any]
) -> None:
    """A prefix just under the limit leaves room for a 1-token suffix; the generated file
    loads (its prompts went past the limit before)."""
    requests = generate(kind, params, GenContext(seed=1, block_tokens=4096))
    assert requests
    assert max(r.input_tokens for r in requests) <= MAX_TOKENS
    path = tmp_path / "g.jsonl"
    write_bursted_art(requests, path)
    assert len(load_trace(path, "bursted-art", block_tokens=4096).requests) == len(requests)


@pytest.mark.parametrize(
    ("kind", "params", "field"),
    [
        ("bursted", {"prefix_tokens": MAX_TOKENS}, "prefix_tokens"),
        ("bursted", {"background_prefix_tokens": MAX_TOKENS}, "background_prefix_tokens"),
        ("poisson", {"prefix_tokens": MAX_TOKENS}, "prefix_tokens"),
        ("seed_bursty", {"prefix_tokens": MAX_TOKENS, "suffix_tokens": 1}, "params"),
    ],
)
def test_generator_prefixes_at_the_limit_are_refused(
    kind: str, params: dict[str, Any], field: str
) -> None:
    with pytest.raises(UserError, match=f"generator {kind!r} param {field!r}"):
        parse_params(kind, params)


def test_seed_bursty_refuses_prompts_that_whole_blocks_round_past_the_limit() -> None:
    params = {"windows": 1, "bursts": 1, "burst_size": 1, "decoys": 0,
              "prefix_tokens": MAX_TOKENS - 1, "suffix_tokens": 0}  # fmt: skip
    with pytest.raises(UserError, match="10,000,384-token prompts, more than the limit"):
        generate("seed_bursty", params, GenContext(seed=0, block_tokens=512))


# ------------------------------------------------------------- (3) the log names the file


def test_read_log_names_a_binary_file(tmp_path: Path) -> None:
    from btb_lab.report.log import read_log

    log = tmp_path / "bin.md"
    log.write_bytes(bytes(range(256)))
    with pytest.raises(UserError, match=rf"^{log}: not a text \(UTF-8\) file$"):
        read_log(log)


def test_log_show_names_a_binary_log(tmp_path: Path) -> None:
    log = tmp_path / "bin.yaml"
    log.write_bytes(bytes(range(256)) * 2)
    refused(cli("log", "show", "--log", log), f"{log}: not a text (UTF-8) file")


# ------------------------------------------------------------- (4) empty traces, columns


def _empty_mooncake_parquet(path: Path) -> Path:
    table = pa.table({
        "timestamp": pa.array([], pa.float64()), "input_length": pa.array([], pa.int64()),
        "output_length": pa.array([], pa.int64()),
        "hash_ids": pa.array([], pa.list_(pa.int64())),
    })  # fmt: skip
    pq.write_table(table, path)
    return path


@pytest.mark.parametrize("command", ["inspect", "audit"])
@pytest.mark.parametrize("name", ["empty.parquet", "empty.jsonl"])
def test_an_empty_trace_is_refused_with_an_explicit_format(
    tmp_path: Path, command: str, name: str
) -> None:
    path = tmp_path / name
    if path.suffix == ".parquet":
        _empty_mooncake_parquet(path)
    else:
        path.write_text("\n", encoding="utf-8")
    refused(cli("trace", command, "-f", "mooncake", path), f"{path}: trace file is empty")
    refused(cli("trace", command, path), f"{path}: trace file is empty")  # auto, as before


def test_a_trace_whose_every_row_was_skipped_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", _rows("mooncake", 1, input_length=-1))
    result = cli("trace", "inspect", "-f", "mooncake", "--skip-bad-rows", path)
    assert result.code == 2, result.output
    assert f"error: {path}: trace has no requests (1 malformed rows skipped)" in result.err


@pytest.mark.parametrize("fmt", sorted(ROWS))
@pytest.mark.parametrize("rows", [0, 2])
def test_a_parquet_without_the_formats_columns_names_the_missing_one(
    tmp_path: Path, fmt: str, rows: int
) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"a": pa.array(range(rows), pa.int64())}), path)
    first = next(iter(ROWS[fmt]))
    expected = f"{path}: field {first!r}: no such column; a {fmt} trace needs"
    for skip in (False, True):
        with pytest.raises(UserError, match=expected):
            load_trace(path, fmt, skip_bad_rows=skip)
    refused(cli("trace", "inspect", "-f", fmt, path), expected, "(columns in the file: a)")


def test_a_parquet_missing_one_column_names_it(tmp_path: Path) -> None:
    row = dict(ROWS["art-chat"])
    del row["input_length"]
    path = _write(tmp_path / "chat.parquet", [row])
    with pytest.raises(UserError, match="field 'input_length': no such column"):
        load_trace(path, "art-chat")


def test_audit_prints_no_python_none(tmp_path: Path) -> None:
    trace = _write(tmp_path / "one.jsonl", [ONE_ROW])
    result = cli("trace", "audit", trace)
    assert result.code == 0, result.output
    assert "None" not in result.output
    assert "largest none (no request has ≥ 16 blocks)" in result.out
    report = json.loads(cli("trace", "audit", trace, "--json").out)
    assert report["deep"]["largest_group"] is None  # JSON keeps its null


# ------------------------------------------------------------- (5) variant names


def _variant_line(text: str, key: str) -> int:
    return text.splitlines().index(f"  {key}:") + 1


@pytest.mark.parametrize(
    ("key", "name", "message"),
    [
        ('""', "", "a variant name must not be empty"),
        ('"  "', "  ", "a variant name must not be empty"),
        ('"x,y"', "x,y", "variant name 'x,y' contains a comma, so `--variants`"),
        ('" fast"', " fast", "variant name ' fast' starts or ends with whitespace"),
        ('"fast\\t"', "fast\t", "variant name 'fast\\t' starts or ends with whitespace"),
        ('"a\\tb"', "a\tb", "variant name 'a\\tb' contains a non-printing character"),
    ],
)
def test_variant_names_that_variants_cannot_select_are_refused(
    tmp_path: Path, key: str, name: str, message: str
) -> None:
    path = write_small(tmp_path, **{"  fast:\n": f"  {key}:\n"})
    line = _variant_line(path.read_text(encoding="utf-8"), key)
    refused(cli("validate", path), f"{path}:{line}: variants.{name}: {message}")


@pytest.mark.parametrize("name", ["btb_at_admission", "of_2.0", "fast lane", "x-y/z"])
def test_ordinary_variant_names_still_validate(tmp_path: Path, name: str) -> None:
    path = write_small(tmp_path, **{"  fast:\n": f'  "{name}":\n'})
    result = cli("validate", path)
    assert result.code == 0, result.output


def test_an_override_is_blamed_for_the_keys_it_made(tmp_path: Path) -> None:
    """`--set` of a key the file does not have, or of a baseline that is not a variant, is
    reported at the flag, not at line 1 of the hypothesis; the same baseline written in
    the file is reported at its own line."""
    hyp = write_small(tmp_path)
    for assignment, where in [
        ("nosuch.path=1", "--set nosuch.path=1: nosuch: unknown key 'nosuch'"),
        ("sim.nosuch=1", "--set sim.nosuch=1: sim.nosuch: unknown key 'nosuch'"),
        ("baseline=nobody", "--set baseline=nobody: baseline: 'nobody' is not a variant"),
    ]:
        result = cli("run", hyp, "--set", assignment, "--dry-run")
        assert result.code == 2, result.output
        assert where in result.err, result.err
        assert not result.traceback
    text = hyp.read_text(encoding="utf-8")
    line = text[: text.index("baseline:")].count("\n") + 1
    (tmp_path / "b.yaml").write_text(
        text.replace(text[text.index("baseline:") :].split("\n")[0], "baseline: nobody"),
        encoding="utf-8",
    )
    result = cli("validate", tmp_path / "b.yaml")
    assert result.code == 2
    assert f"b.yaml:{line}: baseline: 'nobody' is not a variant" in result.output
