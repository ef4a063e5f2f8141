"""Bad input found by probing the command line as a user would (2026-12-06): each was a
traceback, an exit code other than 2, or a silent wrong answer before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from tests.helpers import SMALL, cli, write_small

# the small hypothesis's workload, which tests replace with a trace
GENERATOR = "  generator:\n    kind: poisson\n    params: {requests: 60, rate_per_s: 4.0}"


def refused(result, *expected: str) -> None:
    assert result.code == 2, result.output
    assert not result.traceback, result.output
    for text in expected:
        assert text in result.output, result.output


# ------------------------------------------------------------- dates YAML cannot build


def test_a_value_that_reads_as_an_impossible_date_is_named_with_its_line(
    tmp_path: Path,
) -> None:
    # PyYAML builds 2026-02-30 with datetime, whose ValueError escaped as a traceback
    path = write_small(tmp_path, **{"claim: round robin is no worse than least load": (
        "claim: 2026-02-30\nnotes:\n  - 2001-12-14t21:59:43.10-25:00")})  # fmt: skip
    line = SMALL.splitlines().index("claim: round robin is no worse than least load") + 1
    result = cli("validate", path)
    refused(
        result,
        f"{path}:{line}: claim: '2026-02-30' reads as a date or time but is not one "
        "(day is out of range for month)",
        f"{path}:{line + 2}: notes.0: '2001-12-14t21:59:43.10-25:00' reads as a date",
    )


def test_an_impossible_date_in_a_set_is_blamed_on_the_set(tmp_path: Path) -> None:
    result = cli("run", write_small(tmp_path), "--dry-run", "--set", "claim=2026-13-45")
    refused(result, "--set claim=2026-13-45: '2026-13-45' reads as a date or time")


def test_a_real_date_still_reads_as_a_date(tmp_path: Path) -> None:
    # the check refuses only what datetime cannot build; a real date reaches the model,
    # which says the field wants text
    path = write_small(tmp_path, **{"claim: round robin is no worse than least load": (
        "claim: 2026-02-28")})  # fmt: skip
    refused(cli("validate", path), "claim: Input should be a valid string")


@pytest.mark.parametrize("where", ["generate", "list"])
def test_an_impossible_date_elsewhere_is_no_traceback(tmp_path: Path, where: str) -> None:
    if where == "generate":
        result = cli("trace", "generate", "poisson", "-o", tmp_path / "g.jsonl",
                     "-p", "requests=2026-13-45")  # fmt: skip
        refused(result, "2026-13-45")
    else:
        write_small(tmp_path, **{"seed: 3": "seed: 3\nnotes: 2026-02-30"})
        result = cli("list", "--hypotheses", tmp_path)
        assert result.code == 0, result.output
        assert "(unreadable YAML)" in result.output


# --------------------------------------------- a stored run that lost samples or events


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("run")
    out = folder / "out"
    result = cli("run", write_small(folder), "--out", out, "--no-progress")
    assert result.code == 0, result.output
    return out


@pytest.mark.parametrize(("name", "what"), [("utilization.parquet", "utilization samples"),
                                            ("events.parquet", "events")])  # fmt: skip
@pytest.mark.parametrize("damage", ["deleted", "corrupt"])
def test_a_report_refuses_a_run_that_lost_what_its_manifest_counts(
    small_run: Path, tmp_path: Path, name: str, what: str, damage: str
) -> None:
    # the GPU metrics were undefined (a verdict on gpu_std became INCONCLUSIVE) and the
    # warm copies unseen, silently, and report.md was overwritten
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    shutil.rmtree(run / "parts")
    report = (run / "report.md").read_bytes()
    if damage == "deleted":
        (run / name).unlink()
    else:
        (run / name).write_text("bad\n", encoding="utf-8")
    refused(cli("report", run), "the manifest counts", f"{what} but 0 can be read ({name}")
    assert (run / "report.md").read_bytes() == report


def test_a_run_with_its_parquet_files_reports_as_before(small_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    shutil.rmtree(run / "parts")
    manifest = json.loads((run / "manifest.json").read_text(encoding="utf-8"))
    assert all(r["samples"] > 0 and r["events"] > 0 for r in manifest["runs"])
    assert cli("report", run).code == 0


# ------------------------------------------------------------------ flags and values


def test_a_jitter_numpy_cannot_draw_is_refused_before_the_run(tmp_path: Path) -> None:
    result = cli("run", write_small(tmp_path), "--dry-run",
                 "--set", "workload.variation.arrival_jitter_s=1e308")  # fmt: skip
    refused(result, "workload.variation.arrival_jitter_s: Input should be less than or equal")


def test_a_negative_seed_for_generate_is_refused(tmp_path: Path) -> None:
    result = cli("trace", "generate", "poisson", "-o", tmp_path / "g.jsonl",
                 "-p", "requests=5", "--seed", "-1")  # fmt: skip
    refused(result, "--seed")
    assert not (tmp_path / "g.jsonl").exists()


@pytest.mark.parametrize("flag", [("--seed", "-1"), ("--jobs", "-3")])
def test_a_sweep_refuses_a_negative_seed_or_jobs_before_any_point(
    tmp_path: Path, flag: tuple[str, str]
) -> None:
    write_small(tmp_path)
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nbase: hs.yaml\naxes:\n  r:\n    one: {}\n", encoding="utf-8")
    for dry in (["--dry-run"], ["--out", str(tmp_path / "out")]):
        refused(cli("sweep", sweep, *flag, *dry), flag[0])
    assert not (tmp_path / "out").exists()


def test_a_sweep_whose_base_is_a_sweep_says_so(tmp_path: Path) -> None:
    # the base's keys failed the hypothesis schema once per point, with no word why
    write_small(tmp_path)
    inner = tmp_path / "inner.yaml"
    inner.write_text("name: i\nbase: hs.yaml\naxes:\n  r:\n    one: {}\n", encoding="utf-8")
    outer = tmp_path / "outer.yaml"
    outer.write_text("name: o\nbase: inner.yaml\naxes:\n  s:\n    two: {}\n", encoding="utf-8")
    refused(
        cli("sweep", outer, "--dry-run"),
        f"{outer}:2: base: {inner} is a sweep file, not a hypothesis: name the hypothesis it "
        f"varies ({tmp_path / 'hs.yaml'}) and add its axes here",
    )


def test_generate_refuses_a_parquet_name_for_the_jsonl_it_writes(tmp_path: Path) -> None:
    refused(cli("trace", "generate", "poisson", "-o", tmp_path / "g.parquet",
                "-p", "requests=5"), "generate writes JSONL", "trace convert")  # fmt: skip
    assert not (tmp_path / "g.parquet").exists()


def test_a_cluster_without_instances_is_refused_at_its_line(tmp_path: Path) -> None:
    path = write_small(tmp_path, **{"  instances:\n    - {role: C, count: 2, gpu: H100, gpus: 4}":
                                    "  instances: []"})  # fmt: skip
    line = SMALL.splitlines().index("  instances:") + 1
    refused(cli("validate", path), f"{path}:{line}: cluster.instances: List should have at least")


# --------------------------------------------------------------------- trace and log files


def test_a_trace_with_a_byte_order_mark_loads_as_without(tmp_path: Path) -> None:
    from btb_lab.workload.formats import load_trace

    plain = tmp_path / "plain.jsonl"
    assert cli("trace", "generate", "poisson", "-o", plain, "-p", "requests=20").code == 0
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert cli("trace", "inspect", marked).code == 0
    a = load_trace(plain, "bursted-art", block_tokens=512, skip_bad_rows=False)
    b = load_trace(marked, "bursted-art", block_tokens=512, skip_bad_rows=False)
    assert [r.block_hashes for r in a.requests] == [r.block_hashes for r in b.requests]
    assert [r.arrival_s for r in a.requests] == [r.arrival_s for r in b.requests]
    assert len(b.requests) == 20
    assert not b.bad_rows


@pytest.fixture
def logged(small_run: Path, tmp_path: Path) -> Path:
    log = tmp_path / "LOG.md"
    assert cli("log", "append", small_run, "--log", log).code == 0
    return log


@pytest.mark.parametrize("damage", ["end removed", "end made an entry"])
def test_an_append_refuses_a_log_whose_markers_were_edited(
    small_run: Path, logged: Path, damage: str
) -> None:
    text = logged.read_text(encoding="utf-8")
    end = next(line for line in text.splitlines() if line.startswith("<!-- btb-lab:end"))
    new = "" if damage == "end removed" else end.replace("btb-lab:end", "btb-lab:entry")
    logged.write_text(text.replace(end + "\n", new + ("\n" if new else "")), encoding="utf-8")
    before = logged.read_bytes()
    result = cli("log", "append", small_run, "--log", logged)
    refused(result, f"{logged}:", "has no end marker", "mend the btb-lab markers by hand")
    assert logged.read_bytes() == before  # not a second copy of the entry


def test_appending_the_same_run_twice_still_replaces_its_entry(
    small_run: Path, logged: Path
) -> None:
    before = logged.read_text(encoding="utf-8")
    assert cli("log", "append", small_run, "--log", logged).code == 0
    assert logged.read_text(encoding="utf-8") == before


@pytest.mark.parametrize(
    "item",
    ["seed=true", "cluster.instances.0.count=true", "verdict.min_effect=false",
     "variants.fast.sim.max_batch=true"],
)  # fmt: skip
def test_a_boolean_is_no_number(tmp_path: Path, item: str) -> None:
    # lax validation read `seed: true` as seed 1; a boolean setting still takes true
    result = cli("run", write_small(tmp_path), "--dry-run", "--set", item)
    refused(result, f"--set {item}: ", "Input should be a number, not true or false")


def test_a_boolean_setting_still_takes_a_boolean(tmp_path: Path) -> None:
    result = cli("run", write_small(tmp_path), "--dry-run", "--set", "sim.disk_tier=true")
    assert result.code == 0, result.output


# ------------------------------------------------------------------ smaller slips


def test_a_class_named_twice_is_refused(tmp_path: Path) -> None:
    path = write_small(tmp_path, **{"  - name: SHORT": "  - name: LONG"})
    line = SMALL.splitlines().index("classes:") + 1
    expected = "classes: class 'LONG' is named twice (classes.0 and classes.1)"
    refused(cli("validate", path), f"{path}:{line}: {expected}")


def test_a_class_after_a_catch_all_is_refused(tmp_path: Path) -> None:
    """A rule without conditions matches every request: a class after it would be empty
    in every table and any verdict on it INCONCLUSIVE, without a word why."""
    path = write_small(tmp_path, **{"  - name: SHORT": "  - name: SHORT\n  - name: REST"})
    line = SMALL.splitlines().index("classes:") + 1
    expected = (
        "classes: class 'SHORT' (classes.1) has no conditions and matches every request, "
        "so 'REST' after it can never match: put it last"
    )
    refused(cli("validate", path), f"{path}:{line}: {expected}")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--backend", "nope"], "--backend nope: choose from "),
        (["--variants", ","], "--variants: name at least one variant"),
        (["--variants="], "--variants: name at least one variant"),
        (["--set", "seed=4", "--set", "seed=5"],
         "--set seed=5: seed is given already (--set seed=4)"),
    ],
)  # fmt: skip
def test_a_dry_run_checks_its_flags_as_a_run_does(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    refused(cli("run", write_small(tmp_path), "--dry-run", *args), expected)


def test_a_generator_parameter_given_twice_is_refused(tmp_path: Path) -> None:
    result = cli("trace", "generate", "poisson", "-o", tmp_path / "g.jsonl",
                 "-p", "requests=5", "-p", "requests=6")  # fmt: skip
    refused(result, "--param requests=6: requests is given already (--param requests=5)")


def test_listing_a_folder_that_is_not_there_is_an_error(tmp_path: Path) -> None:
    refused(cli("list", "--hypotheses", tmp_path / "nope"), "--hypotheses", "not found")


def test_runs_of_one_trace_with_different_seeds_compare(tmp_path: Path) -> None:
    # the seed shapes a generated workload, not a trace replayed as it is: compare refused
    # these as "generated workloads differ"
    trace = tmp_path / "t.jsonl"
    assert cli("trace", "generate", "poisson", "-o", trace,
               "-p", "requests=40", "-p", "rate_per_s=4").code == 0  # fmt: skip
    path = write_small(tmp_path, **{
        GENERATOR:
        f"  trace: {{path: {trace}, format: bursted-art}}"})  # fmt: skip
    runs = []
    for seed in (3, 4):
        out = tmp_path / f"r{seed}"
        assert cli("run", path, "--out", out, "--seed", str(seed), "--no-progress").code == 0
        runs.append(out)
    result = cli("compare", *runs, "--out", tmp_path / "cmp")
    assert result.code == 0, result.output
    generated = []
    for seed in (3, 4):
        out = tmp_path / f"g{seed}"
        small = write_small(tmp_path, name=f"g{seed}.yaml")
        assert cli("run", small, "--out", out, "--seed", str(seed), "--no-progress").code == 0
        generated.append(out)
    refused(cli("compare", *generated, "--out", tmp_path / "cmp2"), "generated workloads differ")


def test_a_log_under_a_file_names_the_file(small_run: Path, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("", encoding="utf-8")
    log = tmp_path / "afile" / "x" / "LOG.md"
    refused(cli("log", "append", small_run, "--log", log), f"{tmp_path / 'afile'} is a file")


# ------------------------------------------------- Mooncake timestamps written in seconds


def _mooncake(path: Path, rows: int, step: float) -> Path:
    with path.open("w", encoding="utf-8") as handle:
        for i in range(rows):
            row = {"timestamp": round(i * step, 3), "input_length": 600, "output_length": 20,
                   "hash_ids": [i, i + 1]}  # fmt: skip
            handle.write(json.dumps(row) + "\n")
    return path


@pytest.mark.parametrize(("step", "hinted"), [(0.5, True), (500.0, False)])
def test_mooncake_timestamps_that_look_like_seconds_are_pointed_out(
    tmp_path: Path, step: float, hinted: bool
) -> None:
    # 200 requests half a millisecond apart: seconds read as milliseconds, replayed a
    # thousand times denser with nothing else amiss; half a second apart is a real trace
    trace = _mooncake(tmp_path / "t.jsonl", 200, step)
    inspect = cli("trace", "inspect", trace)
    assert inspect.code == 0, inspect.output
    assert ("Mooncake timestamps are milliseconds" in inspect.err) is hinted
    path = write_small(tmp_path, **{
        GENERATOR:
        f"  trace: {{path: {trace}, format: mooncake}}\n  time_scale: 2"})  # fmt: skip
    dry = cli("run", path, "--dry-run")
    assert dry.code == 0, dry.output
    note = "200 requests arrive in 0.0995 s (2,010 requests/s) before time_scale"
    assert (note in dry.output) is hinted, dry.output
    if hinted:
        assert "(time_scale: 2000)" in dry.output
        # the advice taken, the note is gone (it asked for 1000 times more again)
        assert (
            "timestamps are milliseconds"
            not in cli("trace", "inspect", trace, "--time-scale", "1000").err
        )


# ---------------------------------------------------------------------- compare labels


def test_a_run_compared_with_itself_has_no_gap_in_any_class(tmp_path: Path) -> None:
    # a request's class can depend on its variant (cached_fraction): the model side took
    # the baseline's labels for every variant, so least_load's WARM class held other
    # requests than the reference's and a run differed from itself by +50%
    trace = Path(__file__).resolve().parents[2] / "experiments/workloads/gamma_200.jsonl"
    path = write_small(tmp_path, **{
        GENERATOR:
        f"  trace: {{path: {trace}, format: bursted-art}}\n  requests: 60",
        "  - name: LONG\n    when:\n      - {field: input_tokens, op: \">=\", value: 4000}":
        "  - name: LONG\n    when:\n      - {field: cached_fraction, op: \">=\", value: 0.5}",
        "    router: {policy: round_robin}": "    router: {policy: cache_aware}",
    })  # fmt: skip
    run = tmp_path / "run"
    assert cli("run", path, "--out", run, "--no-progress").code == 0
    result = cli("compare", run, run, "--out", tmp_path / "cmp")
    assert result.code == 0, result.output
    gaps = json.loads((tmp_path / "cmp" / "compare.json").read_text(encoding="utf-8"))["gaps"]
    labelled = {(g["variant"], g["scope"]): (g["n_reference"], g["n_model"]) for g in gaps}
    assert {scope for _, scope in labelled} == {"all", "LONG", "SHORT"}
    for (variant, scope), (n_ref, n_model) in labelled.items():
        assert n_ref == n_model, (variant, scope)
    for gap in gaps:
        assert gap["error"] in (0.0, None), gap
    # the classes differ between the variants here, so the test can tell the labels apart
    records = pd.read_parquet(run / "requests.parquet")
    warm = records[records["cached_tokens"] >= 0.5 * records["input_tokens"]]
    counts = warm.groupby("variant", observed=True).size()
    assert counts.nunique() > 1, counts


# ------------------------------------------------------------- repeats that are copies


def test_repeats_that_replay_an_earlier_one_exactly_count_once(tmp_path: Path) -> None:
    # a plain trace on the deterministic simulator: every repeat has the same records;
    # each copy counted as new evidence narrowed the interval (INCONCLUSIVE at 1 repeat,
    # VALIDATED at 4 with nothing learnt)
    trace = Path(__file__).resolve().parents[2] / "experiments/workloads/gamma_200.jsonl"
    path = write_small(tmp_path, **{
        GENERATOR:
        f"  trace: {{path: {trace}, format: bursted-art}}\n  requests: 60"})  # fmt: skip
    primary = {}
    reasons = {}
    for repeats in (1, 4):
        out = tmp_path / f"r{repeats}"
        assert cli("run", path, "--out", out, "--repeats", str(repeats), "--no-progress").code == 0
        summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
        verdict = summary["verdict"]["variants"]["fast"]
        primary[repeats] = {k: verdict["primary"][k] for k in ("change", "ci_low", "ci_high")}
        reasons[repeats] = summary["verdict"]["reason"]
    assert primary[4] == primary[1]
    assert "count once (repeat 2 = 1, 3 = 1, 4 = 1)" in reasons[4]
    assert "count once" not in reasons[1]


def test_repeats_of_a_generated_workload_all_count(tmp_path: Path) -> None:
    out = tmp_path / "r"
    path = write_small(tmp_path)
    assert cli("run", path, "--out", out, "--repeats", "3", "--no-progress").code == 0
    reason = json.loads((out / "summary.json").read_text(encoding="utf-8"))["verdict"]["reason"]
    assert "count once" not in reason
    assert "of 3 repeats" in reason


def test_auto_repeats_stop_once_a_repeat_copies_an_earlier_one(tmp_path: Path) -> None:
    trace = Path(__file__).resolve().parents[2] / "experiments/workloads/gamma_200.jsonl"
    path = write_small(tmp_path, **{
        GENERATOR:
        f"  trace: {{path: {trace}, format: bursted-art}}\n  requests: 60",
        "repeats: 1":
        "repeats: auto\nauto_repeats: {min: 2, max: 6, half_width: 0.0001}"})  # fmt: skip
    out = tmp_path / "r"
    assert cli("run", path, "--out", out, "--no-progress").code == 0
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert sorted({r["repeat"] for r in manifest["runs"]}) == [0, 1]


# ------------------------------------------------------------- a stop while reporting


def test_a_stop_while_the_report_is_written_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # it ended with exit 130 and not a word, the manifest complete and no report.md
    import btb_lab.report.render as render
    from btb_lab import interrupts

    monkeypatch.setattr(interrupts, "_received", [])  # no SIGTERM left over by another test
    real = render.build_report

    def stopped(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(render, "build_report", stopped)
    out = tmp_path / "run"
    result = cli("run", write_small(tmp_path), "--out", out, "--no-progress")
    assert result.code == 130, result.output
    assert f"no report yet: `btb-lab report {out}` writes it" in result.err
    assert not (out / "report.md").exists()
    assert (out / "requests.parquet").is_file()
    monkeypatch.setattr(render, "build_report", real)
    assert cli("report", out).code == 0
    assert (out / "report.md").is_file()


def test_a_run_whose_variants_crashed_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every variant failed (a MemoryError in the event runs) and the run exited 0
    from btb_lab.sim.engine import Engine

    def crash(self: object, *args: object, **kwargs: object) -> None:
        raise RuntimeError("engine broke")

    monkeypatch.setattr(Engine, "run", crash)
    out = tmp_path / "run"
    result = cli("run", write_small(tmp_path), "--out", out, "--no-progress")
    assert result.code == 1, result.output
    assert not result.traceback
    assert f"failed runs of base, fast: their tracebacks are in {out}" in result.err
    assert (out / "report.md").is_file()


def test_a_sweep_reruns_a_point_whose_records_are_gone(tmp_path: Path) -> None:
    # it counted the point as finished and intervals.csv dropped its rows without a word
    write_small(tmp_path)
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nbase: hs.yaml\naxes:\n  r:\n    one: {}\n    two: {seed: 4}\n",
                     encoding="utf-8")  # fmt: skip
    out = tmp_path / "out"
    assert cli("sweep", sweep, "--jobs", "1", "--out", out).code == 0
    victim = sorted((out / "points").iterdir())[0]
    (victim / "requests.parquet").unlink()
    shutil.rmtree(victim / "parts", ignore_errors=True)
    again = cli("sweep", sweep, "--jobs", "1", "--out", out)
    assert again.code == 0, again.output
    assert "1 already finished, 1 to run" in again.output
    assert (victim / "requests.parquet").is_file()


@pytest.mark.parametrize(
    "flag", [("--block-tokens", "0"), ("--vocab-size", "0"), ("--max-context", "-5"),
             ("--max-batch", "0")],
)  # fmt: skip
def test_calibrate_refuses_sizes_it_cannot_measure_with(
    tmp_path: Path, flag: tuple[str, str]
) -> None:
    # --block-tokens 0 divided by zero and --vocab-size 0 failed numpy's draw (tracebacks);
    # the others went on to send requests
    result = cli("calibrate", "--endpoint", "http://127.0.0.1:1", "--model", "m", *flag,
                 "-o", tmp_path / "p.yaml")  # fmt: skip
    refused(result, flag[0])
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.parametrize("item", ["foo.bar=1", "repeats=lots"])
def test_an_ablation_refuses_a_bad_set_once_before_writing(tmp_path: Path, item: str) -> None:
    # each point refused it at a line of the ablation.yaml the command had written
    write_small(tmp_path)
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nbase: hs.yaml\naxes:\n  setup:\n    one: {}\n", encoding="utf-8")
    out = tmp_path / "abl"
    result = cli("ablate", sweep, "--jobs", "1", "--out", out, "--set", item)
    refused(result, f"--set {item}: ")
    assert "ablation.yaml" not in result.output
    assert result.err.count(f"--set {item}") == 1
    assert not out.exists()


def test_report_all_with_a_target_is_refused(small_run: Path) -> None:
    # the target was ignored without a word
    refused(cli("report", "--all", small_run), "--all re-renders every run", "drop")


def test_report_all_re_renders_the_other_runs_past_a_damaged_one(
    small_run: Path, tmp_path: Path
) -> None:
    # it stopped at the first run it could not read: the runs after it were not re-rendered
    results = tmp_path / "results"
    for name in ("A/1-damaged", "B/2-good"):
        shutil.copytree(small_run, results / name)
    (results / "A/1-damaged/manifest.json").write_text("[]", encoding="utf-8")
    (results / "B/2-good/report.md").unlink()
    result = cli("report", "--all", "--results", results)
    refused(result, "1-damaged/manifest.json: not a btb-lab manifest",
            "1 of 2 runs under")  # fmt: skip
    assert (results / "B/2-good/report.md").is_file()
    assert "2-good/report.md: " in result.out


def _dry_run_of_a_50_request_trace(tmp_path: Path, workload_lines: str) -> str:
    """`run --dry-run`'s output for the small hypothesis replaying a generated 50-request
    trace, with `workload_lines` (YAML under `workload:`) added."""
    trace = tmp_path / "g.jsonl"
    assert cli("trace", "generate", "poisson", "-o", trace, "-p", "requests=50").code == 0
    path = write_small(
        tmp_path,
        **{GENERATOR: f"  trace: {{path: {trace}, format: bursted-art}}\n{workload_lines}"},
    )
    result = cli("run", path, "--dry-run")
    assert result.code == 0, result.output
    return str(result.output)


def test_the_note_on_fewer_requests_names_the_offset(tmp_path: Path) -> None:
    output = _dry_run_of_a_50_request_trace(tmp_path, "  offset: 40\n  requests: 30")
    assert "workload.requests is 30 but the workload has 10 after workload.offset 40" in output


def test_resampling_the_windows_of_a_one_window_trace_is_said(tmp_path: Path) -> None:
    # it did nothing, silently, and the report then advised the setting it already had
    output = _dry_run_of_a_50_request_trace(tmp_path, "  variation: {resample_windows: true}")
    said = "resample_windows: the workload has one window (trace_id), so every repeat"
    assert said in output
    assert "arrival_jitter_s would vary it" in output


def test_compare_says_a_run_is_incomplete(small_run: Path, tmp_path: Path) -> None:
    stopped = tmp_path / "stopped"
    shutil.copytree(small_run, stopped)
    manifest = json.loads((stopped / "manifest.json").read_text(encoding="utf-8"))
    manifest["complete"] = False
    (stopped / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    result = cli("compare", small_run, stopped, "--out", tmp_path / "cmp")
    assert result.code == 0, result.output
    assert f"warning: {stopped} is incomplete (stopped or failed)" in result.err


def test_compare_refuses_runs_of_another_model(small_run: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    path = write_small(tmp_path)
    assert cli("run", path, "--out", other, "--set", "model=qwen3-8b", "--no-progress").code == 0
    refused(cli("compare", small_run, other, "--out", tmp_path / "cmp"),
            f"{other} ran another model than {small_run}", "--force")  # fmt: skip


ONE_GROUP = "    - {role: C, count: 2, gpu: H100, gpus: 4}"
PD_SPLIT = {"    router: {policy: round_robin}": "    router: {policy: pd_split}"}


@pytest.mark.parametrize(("roles", "missing"), [("PS", "C"), ("C", "PS")])
def test_pd_split_without_a_pool_it_needs_is_refused_at_validate(
    tmp_path: Path, roles: str, missing: str
) -> None:
    # validate said ok; the run ran the baseline, then failed on pd_split
    group = ONE_GROUP.replace("role: C", f"role: {roles}")
    path = write_small(tmp_path, **{ONE_GROUP: group}, **PD_SPLIT)
    line = SMALL.splitlines().index("    router: {policy: round_robin}") + 1
    needs = f"'pd_split' needs at least one instance with role {missing} in cluster.instances"
    refused(cli("validate", path), f"{path}:{line}: variants.fast.router.policy: policy {needs}")


@pytest.mark.parametrize("policy", ["ps_always", "ps_flexd", "ps_cost"])
def test_a_prefill_service_policy_without_a_ps_instance_is_refused_at_validate(
    tmp_path: Path, policy: str
) -> None:
    # validate and --dry-run said ok; the run ran the baseline, then failed mid-run
    path = write_small(
        tmp_path, **{"    router: {policy: round_robin}": f"    router: {{policy: {policy}}}"}
    )
    line = SMALL.splitlines().index("    router: {policy: round_robin}") + 1
    needs = f"'{policy}' needs at least one instance with role PS in cluster.instances"
    refused(cli("validate", path), f"{path}:{line}: variants.fast.router.policy: policy {needs}")


def test_pd_split_with_both_pools_validates(tmp_path: Path) -> None:
    both = ONE_GROUP.replace("count: 2", "count: 1")
    path = write_small(tmp_path, **{ONE_GROUP: f"{both}\n{both.replace('role: C', 'role: PS')}"},
                       **PD_SPLIT)  # fmt: skip
    result = cli("validate", path)
    assert result.code == 0, result.output


def test_validate_explain_with_files_still_checks_them(tmp_path: Path) -> None:
    # the files were ignored and a broken one exited 0
    path = write_small(tmp_path, **{"repeats: 1": "repeats: many"})
    result = cli("validate", "--explain", path)
    refused(result, "verdict.min_ok_requests:", f"{path}:")


# --------------------------------------------------------- a trace changed in place


def _trace_run(tmp_path: Path, trace: Path, out: Path) -> Path:
    path = write_small(tmp_path, **{GENERATOR: f"  trace: {{path: {trace}, format: bursted-art}}"})
    assert cli("run", path, "--out", out, "--no-progress").code == 0
    return path


def test_compare_refuses_runs_of_a_trace_changed_in_between(tmp_path: Path) -> None:
    # the manifest kept only the path: runs of two versions of one file compared as one
    # experiment (E2E errors of +6,898%)
    trace = tmp_path / "t.jsonl"
    assert cli("trace", "generate", "poisson", "-o", trace, "-p", "requests=40").code == 0
    _trace_run(tmp_path, trace, tmp_path / "a")
    stamp = json.loads((tmp_path / "a" / "manifest.json").read_text(encoding="utf-8"))["trace"]
    assert stamp["path"] == str(trace.resolve())
    assert stamp["bytes"] == trace.stat().st_size
    _trace_run(tmp_path, trace, tmp_path / "b")  # the file as it was: the same experiment
    assert cli("compare", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "c1").code == 0
    rows = [json.loads(line) for line in trace.read_text(encoding="utf-8").splitlines()]
    with trace.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps({**row, "output_length": 1}) + "\n")
    _trace_run(tmp_path, trace, tmp_path / "e")
    refused(cli("compare", tmp_path / "a", tmp_path / "e", "--out", tmp_path / "c2"),
            "replayed another version of the trace file")  # fmt: skip


def test_a_sweep_reruns_points_whose_trace_changed(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    assert cli("trace", "generate", "poisson", "-o", trace, "-p", "requests=40").code == 0
    write_small(tmp_path, **{GENERATOR: f"  trace: {{path: {trace}, format: bursted-art}}"})
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nbase: hs.yaml\naxes:\n  r:\n    one: {}\n", encoding="utf-8")
    out = tmp_path / "out"
    assert cli("sweep", sweep, "--jobs", "1", "--out", out).code == 0
    assert "1 already finished" in cli("sweep", sweep, "--jobs", "1", "--out", out).output
    text = trace.read_text(encoding="utf-8")
    trace.write_text(text.replace('"output_length":', '"output_length":1'), encoding="utf-8")
    again = cli("sweep", sweep, "--jobs", "1", "--out", out)
    assert again.code == 0, again.output
    assert "0 already finished, 1 to run" in again.output


def test_a_trace_edited_in_its_middle_keeping_its_size_is_another_version(
    tmp_path: Path,
) -> None:
    """The stamp digested only the first and last MiB: a same-size edit between them
    went unnoticed. A stamp of an older run, without the whole-file CRC, still matches by
    size and edges (a sweep does not rerun every point after an upgrade)."""
    from btb_lab.results.manifest import same_contents
    from btb_lab.workload.trace_checks import STAMP_EDGE_BYTES, trace_stamp

    trace = tmp_path / "t.jsonl"
    line = b'{"pad": "' + b"x" * 1000 + b'"}\n'
    trace.write_bytes(line * (3 * STAMP_EDGE_BYTES // len(line)))
    before = trace_stamp(trace)
    data = bytearray(trace.read_bytes())
    middle = len(data) // 2
    data[middle] = ord("y")  # inside a pad string: the same size, still JSON
    trace.write_bytes(bytes(data))
    after = trace_stamp(trace)
    assert after["bytes"] == before["bytes"]
    assert after["edges_blake2b"] == before["edges_blake2b"]
    assert not same_contents(before, after)
    older = {k: v for k, v in before.items() if k != "crc32"}
    assert same_contents(older, before)
    assert same_contents(before, {**before, "path": "/elsewhere/t.jsonl"})  # a copy


@pytest.mark.parametrize("value", ["nan", "2", "0"])
def test_sim_costs_names_what_is_wrong_with_mfu(value: str) -> None:
    # NaN passed typer's range check to "should be less than or equal to 1"
    shown = {"nan": "nan", "2": "2.0", "0": "0.0"}[value]
    refused(cli("sim", "costs", "--mfu", value), f"{shown} is not a number from 0.01 to 1")


def test_a_negative_list_index_in_set_is_refused_at_the_flag(tmp_path: Path) -> None:
    # `instances.-1` was taken, and a bad value under it blamed on the file's line
    path = write_small(tmp_path)
    refused(
        cli("run", path, "--dry-run", "--set", "cluster.instances.-1.count=x"),
        "--set cluster.instances.-1.count=x: cluster.instances.-1.count: index -1: count from 0",
    )


def test_a_check_of_a_whole_section_names_the_override_that_changed_it(tmp_path: Path) -> None:
    # `--set workload.generator=null` left the workload with neither source; the error
    # named only the file's line, as if the file were wrong
    path = write_small(tmp_path)
    line = SMALL.splitlines().index("workload:") + 1
    refused(
        cli("run", path, "--dry-run", "--set", "workload.generator=null"),
        f"{path}:{line} (with --set workload.generator=null): workload: give exactly one of "
        "'trace' or 'generator'",
    )


def test_list_notes_an_id_that_several_files_share(tmp_path: Path) -> None:
    # both rows showed the same run as their own, without a word
    folder = tmp_path / "hyps"
    folder.mkdir()
    for name in ("a.yaml", "b.yaml"):
        (folder / name).write_text(SMALL, encoding="utf-8")
    result = cli("list", "--hypotheses", folder, "--results", tmp_path / "results")
    assert result.code == 0, result.output
    assert "is the id of a.yaml, b.yaml: their runs are stored together" in result.output


def test_the_sampling_limit_message_writes_huge_counts_short(tmp_path: Path) -> None:
    # `time_scale: 1e300` printed the span and the sample count as 300-digit numbers
    path = write_small(
        tmp_path,
        **{"    params: {requests: 60, rate_per_s: 4.0}":
           "    params: {requests: 60, rate_per_s: 4.0}\n  time_scale: 1.0e300"},
    )  # fmt: skip
    result = cli("run", path, "--no-progress", "--out", tmp_path / "out")
    refused(result, "e+30", "utilization samples, more than the limit of 10,000,000")
    assert "000,000,000,000,000,000" not in result.output


def test_inspect_lays_windows_out_as_a_replay_does_at_the_default_scale(
    tmp_path: Path,
) -> None:
    # at --time-scale 1 the windows sat on top of one another at their raw times: span
    # and rate described no replay (10 windows: 10× the rate), and 1.0001 gave the replay's
    trace = tmp_path / "b.jsonl"
    assert cli("trace", "generate", "bursted", "-o", trace, "-p", "windows=4").code == 0
    at_one = json.loads(cli("trace", "inspect", trace, "--json").output)
    nudged = json.loads(cli("trace", "inspect", trace, "--json", "--time-scale", "1.000001").output)
    assert at_one["span_s"] == pytest.approx(nudged["span_s"], rel=1e-5)
    assert at_one["arrival_rate_per_s"] == pytest.approx(nudged["arrival_rate_per_s"], rel=1e-5)


@pytest.mark.parametrize(("block_tokens", "said"), [(256, True), (512, False)])
def test_a_trace_of_larger_blocks_than_the_hypothesis_says_is_pointed_out(
    tmp_path: Path, block_tokens: int, said: bool
) -> None:
    # a 512-token-block trace read at 256: every cached prefix counted half, silently
    # (the other side, more ids than a prompt allows, is refused by the loader)
    trace = tmp_path / "t.jsonl"
    with trace.open("w", encoding="utf-8") as handle:
        for i in range(40):
            tokens = 600 + 97 * i
            ids = [1000 * i + b for b in range(-(-tokens // 512))]
            handle.write(json.dumps({"timestamp": 500 * i, "input_length": tokens,
                                     "output_length": 20, "hash_ids": ids}) + "\n")  # fmt: skip
    path = write_small(tmp_path, **{
        GENERATOR: f"  trace: {{path: {trace}, format: mooncake}}\n"
        f"  block_tokens: {block_tokens}"})  # fmt: skip
    result = cli("run", path, "--dry-run")
    assert result.code == 0, result.output
    note = "every row carries one block id per 512 tokens, but workload.block_tokens is 256"
    assert (note in result.output) is said, result.output


# ------------------------------------------- a hypothesis file edited since its run


def test_list_and_log_append_say_the_file_changed_since_its_run(tmp_path: Path) -> None:
    """`list` showed the newest run's verdict, and `log append ID` logged it, after the
    file's rule had changed: a verdict of settings the file no longer says, in silence."""
    folder = tmp_path / "hypotheses"
    folder.mkdir()
    path = write_small(folder)
    results = tmp_path / "results"
    assert cli("run", path, "--out", results / "HS" / "r1", "--no-progress").code == 0
    listed = cli("list", "--hypotheses", folder, "--results", results)
    assert listed.code == 0, listed.output
    assert "changed since" not in listed.output
    path.write_text(path.read_text(encoding="utf-8") + "# a comment\n", encoding="utf-8")
    assert "changed since" not in cli("list", "--hypotheses", folder, "--results", results).output
    path.write_text(
        path.read_text(encoding="utf-8").replace("min_effect: 0.05", "min_effect: 0.2"),
        encoding="utf-8",
    )
    listed = cli("list", "--hypotheses", folder, "--results", results)
    assert listed.code == 0, listed.output
    assert f"note: {path} changed since {results / 'HS' / 'r1'} ran it (verdict differs)" in (
        listed.output
    )
    logged = cli("log", "append", "HS", "--results", results, "--log", tmp_path / "LOG.md")
    assert logged.code == 0, logged.output
    assert f"warning: {path} changed since this run (verdict differs)" in logged.output


# --------------------------------- settings that depend on another one, refused alone


@pytest.mark.parametrize(
    ("replace", "expected"),
    [
        ({"seed: 3": "seed: 3\nsim: {router_match_tiers: hbm_ram, router_view: routed}"},
         "sim.router_match_tiers: hbm_ram needs sim.router_view: resident"),
        ({"policy: round_robin}": "policy: lmetric, params: {overload_factor: 1.5}}"},
         "overload_factor needs sticky_sessions: true"),
        ({"seed: 3": "seed: 3\nsim: {connector_decode_slowdown: 0.2}"},
         "sim.connector_decode_slowdown: variant base, variant fast run no KV connector"),
    ],
)  # fmt: skip
def test_a_setting_that_would_change_nothing_alone_is_refused(
    tmp_path: Path, replace: dict[str, str], expected: str
) -> None:
    """Each ran as if unset: a sweep over it measured a flat 'no effect'."""
    refused(cli("validate", write_small(tmp_path, **replace)), expected)


def test_a_connector_slowdown_for_the_variants_with_a_connector_is_kept(tmp_path: Path) -> None:
    # H1's shape: the baseline runs without a connector, the variant with one
    path = write_small(tmp_path, **{
        "seed: 3": "seed: 3\nsim: {connector_decode_slowdown: 0.2}",
        "    router: {policy: round_robin}": (
            "    router: {policy: round_robin}\n    cluster: {kv_connector: {type: nixl}}"),
    })  # fmt: skip
    result = cli("validate", path)
    assert result.code == 0, result.output


def test_per_class_checks_of_a_gpu_metric_are_refused(tmp_path: Path) -> None:
    # they printed the whole run's value as a class's, with its own interval
    path = write_small(tmp_path, **{"  metric: ttft_p90": "  metric: gpu_max\n  per_class: [LONG]"})
    refused(cli("validate", path), "verdict.per_class: metric 'gpu_max' cannot be restricted")


def test_a_model_that_does_not_fit_is_refused_by_validate(tmp_path: Path) -> None:
    # validate said ok; the run then stopped with no file or line
    path = write_small(tmp_path, **{"gpus: 4}": "gpus: 1}"})
    line = SMALL.splitlines().index("  instances:") + 1
    refused(cli("validate", path), f"{path}:{line}: cluster.instances: instance C0 (1×H100",
            "does not fit")  # fmt: skip


@pytest.mark.parametrize("policy", ["ps_always", "ps_flexd", "ps_cost"])
def test_a_prefill_service_policy_without_a_c_instance_is_refused(
    tmp_path: Path, policy: str
) -> None:
    # on a PS-only cluster its offloads decoded where they prefilled: no offload at all,
    # while its records still said route PS
    path = write_small(tmp_path, **{
        "role: C, count: 2": "role: PS, count: 2",
        "    router: {policy: round_robin}": f"    router: {{policy: {policy}}}",
        "    router: {policy: least_load}": "    router: {policy: round_robin}",
    })  # fmt: skip
    refused(cli("validate", path),
            f"'{policy}' needs at least one instance with role C in cluster.instances")  # fmt: skip
