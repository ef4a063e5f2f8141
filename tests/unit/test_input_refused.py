"""Bad input is refused before anything runs: one `WHERE: field: message` line and exit 2.

Regressions of issue 16: the YAML alias bomb that hung the loader (1), values that
validated and then misbehaved — non-finite floats, negative guards, counts and sampling
periods that exhaust memory, duplicate keys (5), `--set` values the YAML reader choked on
(7) and `--set` errors blamed on a line of the hypothesis file (10).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import SMALL, cli, cli_subprocess, write_small


def alias_bomb(levels: int = 9, fanout: int = 9) -> str:
    """Nine anchors each listing the previous one nine times: 9**9 nodes once expanded."""
    lines = [f"a0: &a0 [{', '.join(['x'] * fanout)}]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * fanout)}]")
    return "\n".join(lines) + "\n"


def refused(result, *expected: str) -> None:
    assert result.code == 2, result.output
    assert not result.traceback, result.output
    for text in expected:
        assert text in result.output, result.output


# ------------------------------------------------------------------------ (1) alias bomb


@pytest.mark.parametrize("command", ["validate", "run", "router"])
def test_alias_bomb_is_refused_without_hanging(tmp_path: Path, command: str) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb() + SMALL + "notes: *a8\n", encoding="utf-8")
    assert len(bomb.read_bytes()) < 2000  # a few hundred bytes of anchors
    args = {
        "validate": ["validate", bomb],
        "run": ["run", bomb, "--no-progress", "--out", tmp_path / "out"],
        "router": ["router", "serve", "--hypothesis", bomb, "--variant", "base", "--port", "1"],
    }[command]
    # the hang guard: the old loader walked every alias and never came back
    proc = cli_subprocess(*args, cwd=tmp_path, timeout_s=60)
    assert proc.returncode == 2, proc.stderr
    assert "aliases expand to more than" in proc.stderr
    assert f"{bomb}:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_alias_bomb_in_a_sweep_file_is_refused(tmp_path: Path) -> None:
    write_small(tmp_path)
    sweep = tmp_path / "s.yaml"
    sweep.write_text(
        alias_bomb() + "name: s\nbase: hs.yaml\noverrides: {notes: *a8}\n", encoding="utf-8"
    )
    proc = cli_subprocess("sweep", sweep, "--dry-run", cwd=tmp_path, timeout_s=60)
    assert proc.returncode == 2, proc.stderr
    assert "aliases expand to more than" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("where", ["file", "set", "sweep"])
def test_a_recursive_alias_is_refused_without_hanging(tmp_path: Path, where: str) -> None:
    """Found by the fuzz test: `&a [*a]` (a list holding itself) made the expansion count
    loop forever."""
    path = write_small(tmp_path)
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nbase: hs.yaml\noverrides: &o {notes: *o}\n", encoding="utf-8")
    args, blamed = {
        "file": (["validate", path], f"{path}:"),
        "set": (["run", path, "--dry-run", "--set", "notes=&a [x, *a]"],
                "--set notes=&a [x, *a]: "),
        "sweep": (["sweep", sweep, "--dry-run"], f"{sweep}:"),
    }[where]  # fmt: skip
    if where == "file":
        path.write_text(SMALL + "notes: &a [*a]\n", encoding="utf-8")
    # the hang guard: the expansion count never came back
    proc = cli_subprocess(*args, cwd=tmp_path, timeout_s=60)
    assert proc.returncode == 2, proc.stderr
    assert "(YAML): an alias inside the node it names" in proc.stderr
    assert blamed in proc.stderr
    assert "Traceback" not in proc.stderr


def test_shared_anchors_that_expand_little_still_load(tmp_path: Path) -> None:
    base = "  base:\n    router: {policy: least_load}"
    fast = "  fast:\n    router: {policy: round_robin}"
    path = write_small(
        tmp_path, **{base: base.replace("router:", "router: &r"), fast: "  fast:\n    router: *r"}
    )
    result = cli("validate", path)
    assert result.code == 0, result.output


# --------------------------------------------------- (5) values that validated, then misbehaved

BURSTED = (
    "  generator:\n    kind: poisson\n    params: {requests: 60, rate_per_s: 4.0}",
    (
        "  generator:\n    kind: bursted\n    params: {windows: 1, burst_size: 8, decoy_repeats: 2,"
        " background_rate_per_s: .inf}"
    ),
)
CASES = [
    # (name, old text, new text, expected field path, expected message)
    ("time_scale inf", "    params: {requests: 60, rate_per_s: 4.0}",
     "    params: {requests: 60, rate_per_s: 4.0}\n  time_scale: .inf",
     "workload.time_scale", "finite number"),
    ("transfer_setup_ms inf", "repeats: 1", "repeats: 1\nsim: {transfer_setup_ms: .inf}",
     "costs.transfer_setup_ms", "finite number"),
    ("background rate inf", *BURSTED,
     "workload.generator.params.background_rate_per_s", "finite number"),
    ("guard nan", "max_worse: 0.01", "max_worse: .nan", "verdict.guards.0.max_worse",
     "finite number"),
    ("guard negative", "max_worse: 0.01", "max_worse: -5", "verdict.guards.0.max_worse",
     "greater than or equal to 0"),
    ("class value nan", "value: 4000", "value: .nan", "classes.0.when.0.value", "finite number"),
    ("min_effect inf", "min_effect: 0.05", "min_effect: .inf", "verdict.min_effect",
     "finite number"),
    ("instance count", "count: 2", "count: 100000000000", "cluster.instances.0.count",
     "less than or equal to 10000"),
    ("instance count as float", "count: 2", "count: 1.0e+11", "cluster.instances.0.count",
     "less than or equal to 10000"),
    ("sample interval", "repeats: 1", "repeats: 1\nsim: {sample_interval_s: 1e-9}",
     "sim.sample_interval_s", "greater than or equal to 0.01"),
    ("generated requests", "requests: 60,", "requests: 100000000000,",
     "workload.generator.params.requests", "less than or equal to 10000000"),
    ("bootstrap samples", "bootstrap_samples: 200", "bootstrap_samples: 1000000000",
     "verdict.bootstrap_samples", "less than or equal to 100000"),
    ("repeats", "repeats: 1", "repeats: 1000000000", "repeats", "less than or equal to 1000"),
    ("duplicate key", "repeats: 1", "repeats: 1\nrepeats: 2", "repeats",
     "duplicate key 'repeats' (first given at line"),
    ("decrease beyond 100%", "min_effect: 0.05", "min_effect: 5", "verdict",
     "min_effect 5 asks for a decrease of more than 100%"),
    ("empty class name", "name: SHORT", "name: ''", "classes.1.name",
     "a class name must not be empty"),
    ("class name with spaces", "name: SHORT", "name: ' SHORT'", "classes.1.name",
     "surrounding spaces"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("old", "new", "field", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_value_that_would_misbehave_is_refused(
    tmp_path: Path, old: str, new: str, field: str, message: str
) -> None:
    path = write_small(tmp_path, **{old: new})
    result = cli("validate", path)
    refused(result, f": {field}: ", message)
    line = next(line for line in result.err.splitlines() if f": {field}: " in line)
    assert line.startswith((f"{path}:", f"error: {path}:")), line


def test_a_bursted_workload_too_big_to_generate_is_refused(tmp_path: Path) -> None:
    path = write_small(tmp_path, **{BURSTED[0]: BURSTED[1].replace(".inf", "1.0e9")})
    refused(cli("validate", path), "workload.generator.params", "the limit is 10,000,000")


def test_a_seed_bursty_workload_too_big_to_generate_is_refused(tmp_path: Path) -> None:
    # every parameter within its own bound, the product ~1e12 requests
    params = "{windows: 10000, bursts: 1000, burst_size: 100000}"
    path = write_small(tmp_path, **{BURSTED[0]: BURSTED[0].replace(
        "kind: poisson\n    params: {requests: 60, rate_per_s: 4.0}",
        f"kind: seed_bursty\n    params: {params}",
    )})  # fmt: skip
    refused(cli("validate", path), "workload.generator.params", "the limit is 10,000,000")


def test_a_workload_stretched_beyond_the_sampling_budget_is_refused_before_it_runs(
    tmp_path: Path,
) -> None:
    # finite but huge: the simulator would keep a utilization sample per second of ~1e10 s
    path = write_small(
        tmp_path,
        **{"    params: {requests: 60, rate_per_s: 4.0}":
           "    params: {requests: 60, rate_per_s: 4.0}\n  time_scale: 1.0e9"},
    )  # fmt: skip
    result = cli("run", path, "--no-progress", "--out", tmp_path / "out")
    refused(result, f"{path}: sim.sample_interval_s:", "utilization samples")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("setting", ["costs.mfu=1e-9", "costs.mbu=1e-300"])
def test_instances_that_fall_years_behind_stop_the_run_with_one_line(
    tmp_path: Path, setting: str
) -> None:
    # the workload spans seconds, but at an MFU of 1e-9 the instances finish its requests
    # decades of simulated time later: a sample per second of that would exhaust memory
    # (a MemoryError); at an MBU of 1e-300 a decode step's time overflowed (OverflowError)
    path = write_small(tmp_path)
    out = tmp_path / "out"
    result = cli("run", path, "--no-progress", "--out", out, "--set", setting)
    refused(result, "the simulated time passed", "check the cost settings (costs.mfu",
            f"{out}: the run is recorded as failed")  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    assert {r["status"] for r in manifest["runs"]} == {"failed"}


# --------------------------------------------------------- (7, 10) --set values and blame


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("repeats=[1,2", "--set repeats=[1,2: YAML syntax error"),
        ("notes=!!python/object/apply:os.system ['echo owned']", "not allowed"),
        ("variants.fast.router={policy: a, policy: b}", "duplicate key 'policy'"),
        ("repeats=lots", "--set repeats=lots: repeats: Input should be a valid integer"),
        ("variants.fast.router.policy=nope", ("--set variants.fast.router.policy=nope: "
         "variants.fast.router.policy: unknown policy 'nope'")),
        ("workload.time_scale=.inf", "--set workload.time_scale=.inf: workload.time_scale:"),
    ],
)  # fmt: skip
def test_set_values_are_checked_and_blamed_on_the_set(
    tmp_path: Path, item: str, expected: str
) -> None:
    path = write_small(tmp_path)
    result = cli("run", path, "--dry-run", "--set", item)
    refused(result, expected)
    assert f"{path}:" not in result.output  # not a line of the file: the file is fine
    assert "owned" not in result.out


def test_flags_are_blamed_on_the_flag(tmp_path: Path) -> None:
    path = write_small(tmp_path)
    refused(cli("run", path, "--dry-run", "--time-scale", "inf"),
            "--time-scale inf: workload.time_scale: Input should be a finite number")  # fmt: skip


def test_an_error_in_the_file_is_still_blamed_on_its_line(tmp_path: Path) -> None:
    path = write_small(tmp_path, **{"repeats: 1": "repeats: many"})
    line = SMALL.splitlines().index("repeats: 1") + 1
    refused(cli("run", path, "--dry-run", "--set", "seed=4"), f"{path}:{line}: repeats:")


def test_a_control_character_is_named_with_its_line(tmp_path: Path) -> None:
    """Found by the fuzz test: PyYAML refuses it while opening the stream."""
    path = tmp_path / "h.yaml"
    path.write_bytes(SMALL.encode().replace(b"repeats: 1", b"repeats: 1\x00"))
    line = SMALL.splitlines().index("repeats: 1") + 1
    refused(cli("validate", path), f"{path}:{line}: (YAML): unacceptable character #x0000")


@pytest.mark.parametrize(("value", "ok"), [(0.05, True), (0.01, True), (1e-9, False)])
def test_metrics_scrape_interval_is_bounded_below(value: float, ok: bool) -> None:
    from pydantic import ValidationError

    from btb_lab.config.launch import LaunchSettings

    if ok:  # a fast scrape against local fakes is fine
        assert LaunchSettings(metrics_interval_s=value).metrics_interval_s == value
    else:  # a busy loop of HTTP requests to every instance is not
        with pytest.raises(ValidationError, match=r"greater than or equal to 0\.01"):
            LaunchSettings(metrics_interval_s=value)


@pytest.mark.parametrize("kind", ["folder with a file", "file"])
def test_an_out_in_the_way_is_refused_before_the_workload_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """`--out` taken is said before the run loads its trace or generates its workload
    (minutes on a research-sized trace), not after it simulated."""
    import btb_lab.runner

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the workload was loaded")

    monkeypatch.setattr(btb_lab.runner, "_load_requests", no_load)
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("x")
    else:
        out.mkdir()
        (out / "kept.txt").write_text("kept")
    result = cli("run", write_small(tmp_path), "--no-progress", "--out", out)
    assert result.code == 2, result.output
    assert f"--out {out} exists" in result.output
    assert "Traceback" not in result.output
    kept = out if kind == "file" else out / "kept.txt"
    assert kept.read_text() == ("x" if kind == "file" else "kept")


@pytest.mark.parametrize(
    ("args", "expected"),
    [(["--rate", "0"], "--rate must be a finite number"),  # a ZeroDivisionError
     (["--rate", "nan"], "--rate must be a finite number"),
     (["--rate", "1e-9"], "the bench runs at most 600 s"),  # it waited for ever
     (["--requests", "-5"], "--requests must be 1 to 1,000,000"),
     (["--output-tokens", "-1"], "--output-tokens must be 1 to 4,096")],
)  # fmt: skip
def test_router_bench_refuses_flags_it_cannot_run(args: list[str], expected: str) -> None:
    refused(cli("router", "bench", *args), expected)
