"""Property-based fuzzing of the CLI's contract on its input files (issue 16).

The shipped hypothesis, sweep and trace files are mutated — a value replaced by another
type, a non-finite or huge number, a duplicate key, an alias, binary bytes, another text
encoding, a cut — and every case must end as the CLI promises: exit 0, or exit 2 with
one `WHERE[:LINE]: [field: ]message` line per problem whose WHERE is the file (or the
flag) at fault; never a traceback, never a hang (each case runs under an alarm).

Bounded for `make test`: a fixed number of examples per target, derandomized (the same
cases every run), in-process through `btb_lab.cli.main`, a per-case time limit.
"""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import CliResult, cli

ROOT = Path(__file__).resolve().parents[2]
HYPOTHESES = sorted((ROOT / "hypotheses").glob("*.yaml"))
SWEEPS = sorted((ROOT / "experiments").glob("*.yaml"))
FIXTURES = ROOT / "tests" / "fixtures" / "workload"
TRACES = {
    **dict.fromkeys(FIXTURES.glob("mooncake_*.jsonl"), "mooncake"),
    **dict.fromkeys(FIXTURES.glob("bursted_art_*.jsonl"), "bursted-art"),
    **dict.fromkeys(FIXTURES.glob("art_chat_*.jsonl"), "art-chat"),
    ROOT / "experiments" / "workloads" / "gamma_200.jsonl": "bursted-art",
}
CASE_LIMIT_S = 60  # one case; the slowest real case (a sweep's dry run) takes about 2 s
FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# values that have broken input handling somewhere: types, non-finite and huge numbers
NASTY: list[Any] = [
    None, True, False, 0, -1, 1, 2**63, 10**12, -(10**12), 1e308, -1e308, 1e-308,
    float("inf"), float("-inf"), float("nan"), "", "x", "1e11", "!!python/object:os.system",
    "é" * 3, "\x00", [], [1, [2]], {}, {"a": 1}, "a" * 5000, [None] * 3,
]  # fmt: skip


class CaseTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """The hang guard: SIGALRM interrupts a case that runs past `seconds`."""

    def alarm(signum: int, frame: object) -> None:
        raise CaseTimeout(f"case ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


PROBLEM = re.compile(r"^(?:error: )?(?P<where>\S.*?)(?::\d+)?: \S")


def run_case(*args: str | Path) -> CliResult:
    with time_limit(CASE_LIMIT_S):
        return cli(*args)


def assert_contract(result: CliResult, *sources: str | Path) -> None:
    """Exit 0, or exit 2 with one problem per line, each naming one of `sources`."""
    assert not result.traceback, result.output
    assert result.code in (0, 2), result.output
    if result.code == 0:
        return
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert lines, result.output
    names = [str(s) for s in sources]
    for line in lines:
        match = PROBLEM.match(line)
        assert match, f"not WHERE: message: {line!r}"
        where = match.group("where")
        assert any(where.startswith(n) for n in names), f"{line!r} names none of {names}"


# ---------------------------------------------------------------- mutations of YAML files


def leaf_paths(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into the document (mappings and lists included)."""
    paths = [prefix] if prefix else []
    if isinstance(data, dict):
        for key, value in data.items():
            paths += leaf_paths(value, (*prefix, key))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            paths += leaf_paths(value, (*prefix, index))
    return paths


def set_path(data: Any, path: tuple[Any, ...], value: Any) -> None:
    node = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


@st.composite
def mutated_yaml(draw: st.DrawFn, source: Path) -> bytes:
    """The file with one mutation: a value replaced, a key duplicated, an alias bomb, an
    anchor reused, binary bytes, another encoding, or a cut."""
    text = source.read_text(encoding="utf-8")
    kind = draw(st.sampled_from(
        ["value", "value", "value", "duplicate", "alias", "bomb", "binary", "utf16", "cut"]
    ))  # fmt: skip
    if kind in ("value", "alias"):
        data = yaml.safe_load(text)
        paths = leaf_paths(data)
        path = draw(st.sampled_from(paths))
        if kind == "value":
            set_path(data, path, draw(st.sampled_from(NASTY)))
            return yaml.safe_dump(data, sort_keys=False, allow_unicode=True).encode()
        other = draw(st.sampled_from(paths))  # the same node twice, as YAML anchor + alias
        node = data
        for part in other:
            node = node[part]
        set_path(data, path, node)
        return yaml.dump(data, Dumper=yaml.SafeDumper, sort_keys=False).encode()
    if kind == "duplicate":
        lines = text.splitlines()
        keyed = [i for i, line in enumerate(lines) if re.match(r"^\s*[A-Za-z_]\w*:", line)]
        i = draw(st.sampled_from(keyed))
        return "\n".join([*lines[: i + 1], lines[i], *lines[i + 1 :]]).encode()
    if kind == "bomb":
        levels = draw(st.integers(5, 9))
        anchors = ["b0: &b0 [x, x, x, x, x, x, x, x, x]"] + [
            f"b{i}: &b{i} [{', '.join([f'*b{i - 1}'] * 9)}]" for i in range(1, levels)
        ]
        return ("\n".join(anchors) + f"\n{text}\nnotes: *b{levels - 1}\n").encode()
    if kind == "binary":
        raw = text.encode()
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + draw(st.binary(min_size=1, max_size=64)) + raw[at:]
    if kind == "utf16":
        return text.encode("utf-16")
    at = draw(st.integers(0, len(text)))
    return text[:at].encode()


@FUZZ
@given(data=st.data())
def test_mutated_hypotheses_keep_the_contract(tmp_path_factory, data) -> None:
    source = data.draw(st.sampled_from(HYPOTHESES))
    folder = tmp_path_factory.mktemp("hyp")
    path = folder / source.name
    path.write_bytes(data.draw(mutated_yaml(source)))
    result = run_case("validate", path)
    assert_contract(result, path)
    if result.code == 0:
        assert_contract(run_case("run", path, "--dry-run"), path)


@FUZZ
@given(data=st.data())
def test_mutated_sweeps_keep_the_contract(tmp_path_factory, data) -> None:
    source = data.draw(st.sampled_from(SWEEPS))
    folder = tmp_path_factory.mktemp("sweep") / "experiments"
    folder.mkdir()
    (folder.parent / "hypotheses").symlink_to(ROOT / "hypotheses")
    path = folder / source.name
    path.write_bytes(data.draw(mutated_yaml(source)))
    result = run_case("sweep", path, "--dry-run")
    assert_contract(result, path, folder.parent / "hypotheses", ROOT / "hypotheses")


@FUZZ
@given(data=st.data())
def test_set_overrides_keep_the_contract(tmp_path_factory, data) -> None:
    source = data.draw(st.sampled_from([p for p in HYPOTHESES if p.stem.startswith("h")]))
    paths = leaf_paths(yaml.safe_load(source.read_text(encoding="utf-8")))
    path = data.draw(st.sampled_from(paths))
    dotted = ".".join(map(str, path)) + data.draw(st.sampled_from(["", "", ".extra", ".0"]))
    value = data.draw(st.sampled_from([
        *(yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("\n...")
          for v in NASTY if not (isinstance(v, str) and len(v) > 100)),
        "[1, 2", "{a: 1, a: 2}", "!!python/object/apply:os.system [ls]", "&a [*a]", "*nope",
    ]))  # fmt: skip
    result = run_case("run", source, "--dry-run", "--set", f"{dotted}={value}")
    assert_contract(result, "--set", source)


# ---------------------------------------------------------------- mutations of trace rows


@st.composite
def mutated_trace(draw: st.DrawFn, source: Path) -> bytes:
    """The trace with one row changed: a field replaced or dropped, the row cut, replaced
    by binary bytes or by another JSON value, or the whole file in UTF-16."""
    import json

    lines = source.read_text(encoding="utf-8").splitlines()
    i = draw(st.integers(0, len(lines) - 1))
    kind = draw(st.sampled_from(["field", "field", "field", "drop", "cut", "binary", "json",
                                 "utf16"]))  # fmt: skip
    if kind == "utf16":
        return "\n".join(lines).encode("utf-16")
    try:
        row = json.loads(lines[i])
    except ValueError:  # the fixtures of bad rows have some already
        row = None
    if kind in ("field", "drop") and isinstance(row, dict) and row:
        key = draw(st.sampled_from(sorted(row)))
        if kind == "drop":
            del row[key]
        else:
            row[key] = draw(st.sampled_from(NASTY))
        lines[i] = json.dumps(row)  # NaN and Infinity as Python's json writes them
    elif kind == "cut":
        lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
    elif kind == "json":
        lines[i] = json.dumps(draw(st.sampled_from(NASTY)))
    else:
        return "\n".join(lines[:i]).encode() + b"\n" + draw(st.binary(min_size=1, max_size=64))
    return ("\n".join(lines) + "\n").encode()


@FUZZ
@given(data=st.data())
def test_mutated_traces_keep_the_contract(tmp_path_factory, data) -> None:
    source = data.draw(st.sampled_from(sorted(TRACES)))
    path = tmp_path_factory.mktemp("trace") / source.name
    path.write_bytes(data.draw(mutated_trace(source)))
    for fmt in (TRACES[source], "auto"):
        assert_contract(run_case("trace", "inspect", path, "--format", fmt), path)
