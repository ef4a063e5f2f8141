"""`btb-lab compare` on constructed runs with known errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from btb_lab.analysis.compare import compare_runs
from btb_lab.cli import app
from btb_lab.results import Manifest
from tests.unit.test_runner_fake import EFFECTS, fake_effects, run_fake

__all__ = ["fake_effects"]


def _as_cluster(run_dir: Path) -> None:
    """Relabel a fake run as a real-cluster run (the reference side of a comparison)."""
    manifest = Manifest.load(run_dir)
    manifest.backend = "cluster"
    manifest.save(run_dir)


@pytest.fixture
def pair(tmp_path: Path, fake_effects) -> tuple[Path, Path]:
    """A 'real' run (3 repeats) and a 'model' run whose every TTFT is exactly 1.25× the
    real one's (the fake backend draws the same numbers for the same seed)."""
    EFFECTS.update({"base": 1.0, "fast": 0.5})
    real = run_fake(tmp_path, out="real", repeats=3).run_dir
    _as_cluster(real)
    EFFECTS.update({"base": 1.25, "fast": 0.625})
    model = run_fake(tmp_path, out="model", repeats=3).run_dir
    return real, model


def test_known_errors_spread_verdicts_and_ranking(pair: tuple[Path, Path]) -> None:
    real, model = pair
    c = compare_runs([model, real])  # order does not matter: the cluster run is the reference
    assert (c.reference_backend, c.model_backend) == ("cluster", "fake")
    assert c.reference_runs == [str(real)]
    for variant in ("base", "fast"):
        for metric in ("ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99"):
            assert c.gap(variant, metric).error == pytest.approx(0.25), (variant, metric)
        assert c.gap(variant, "tpot_p50").error == pytest.approx(0.0, abs=1e-12)
    # the spread is the reference's (max − min) / mean over its three repeats
    records = pd.read_parquet(real / "requests.parquet")
    ok = records[(records["variant"] == "base") & records["ok"]]
    per_repeat = ok.groupby("repeat")["ttft_s"].apply(lambda s: np.percentile(s, 90)).to_numpy()
    expected = (per_repeat.max() - per_repeat.min()) / per_repeat.mean()
    gap = c.gap("base", "ttft_p90")
    assert gap.spread == pytest.approx(expected)
    assert gap.within_spread == (expected >= 0.25)
    assert len(gap.reference_repeats) == 3
    # classes are the reference's labels on both sides, so every class has both sides
    assert (
        c.gap("fast", "ttft_p50", "LONG").n_model == c.gap("fast", "ttft_p50", "LONG").n_reference
    )
    assert [(v.variant, v.agrees) for v in c.verdicts] == [("fast", True)]
    assert c.reference_ranking == c.model_ranking == ["fast", "base"]
    assert c.same_ranking


def test_cli_writes_compare_files_and_refuses_other_experiments(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    real, model = pair
    runner = CliRunner()
    out = tmp_path / "cmp"
    result = runner.invoke(app, ["compare", str(real), str(model), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "verdicts agree 1/1, ranking same" in result.output
    data = json.loads((out / "compare.json").read_text())
    assert data["hypothesis"] == "HT"
    md = (out / "compare.md").read_text()
    assert "| base | +25.0% [" in md
    assert (out / "plots" / "ttft_cdf.png").is_file()

    # another hypothesis: refused with exit 2 and a clear message, unless --force
    other = Manifest.load(model)
    other.hypothesis["id"] = "OTHER"
    other.save(model)
    refused = runner.invoke(app, ["compare", str(real), str(model), "--out", str(out / "x")])
    assert refused.exit_code == 2
    assert "runs of different experiments" in refused.output
    assert "is hypothesis 'OTHER'" in refused.output
    forced = runner.invoke(app, ["compare", str(real), str(model), "--force", "--out",
                                 str(out / "y")])  # fmt: skip
    assert forced.exit_code == 0, forced.output
    assert "Warning" in (out / "y" / "compare.md").read_text()


def test_out_that_is_a_run_directory_or_a_file_is_refused(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    real, model = pair
    runner = CliRunner()
    before = sorted(p.name for p in real.rglob("*"))
    refused = runner.invoke(app, ["compare", str(real), str(model), "--out", str(real)])
    assert refused.exit_code == 2
    assert "a run directory" in refused.output
    assert "Traceback" not in refused.output
    assert sorted(p.name for p in real.rglob("*")) == before  # nothing written into it
    # any run directory, not only one of those compared
    other = run_fake(tmp_path, out="other").run_dir
    refused = runner.invoke(app, ["compare", str(real), str(model), "--out", str(other)])
    assert refused.exit_code == 2
    assert "a run directory" in refused.output
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    refused = runner.invoke(app, ["compare", str(real), str(model), "--out", str(a_file)])
    assert refused.exit_code == 2
    assert "a file, not a folder" in refused.output
    assert a_file.read_text() == "mine"
    # a folder under a file cannot be made: the OS error, said in one line
    refused = runner.invoke(app, ["compare", str(real), str(model), "--out", str(a_file / "cmp")])
    assert refused.exit_code == 2, refused.output
    assert "Traceback" not in refused.output


def test_a_variant_one_run_lacks_is_said_not_dropped(tmp_path: Path, fake_effects) -> None:
    """A run of the baseline only beside a full one: the other variant cannot be compared,
    and compare.md and the terminal say so and which run lacks it."""
    EFFECTS.update({"base": 1.0, "fast": 0.5})
    real = run_fake(tmp_path, out="real", repeats=2).run_dir
    _as_cluster(real)
    model = run_fake(tmp_path, out="model", repeats=2, variants=["base"]).run_dir
    out = tmp_path / "cmp"
    result = CliRunner().invoke(app, ["compare", str(real), str(model), "--out", str(out)])
    assert result.exit_code == 0, result.output
    said = f"variant fast is not compared: {model} did not run it"
    assert f"warning: {said}" in result.output
    assert said in (out / "compare.md").read_text()
    assert {g.variant for g in compare_runs([real, model]).gaps} == {"base"}
    # one variant on both sides: nothing to rank
    one = compare_runs([real, model])
    assert (one.reference_ranking, one.same_ranking) == (["base"], None)
    assert "ranking n/a" in result.output


def test_a_side_without_records_ranks_nothing(tmp_path: Path, fake_effects) -> None:
    """A run stopped before any record: every value n/a, so no ranking either (before, the
    variants without a value sorted last and the orders "differed")."""
    from tests.unit.test_runner_fake import INTERRUPT

    EFFECTS.update({"base": 1.0, "fast": 0.5})
    full = run_fake(tmp_path, out="full").run_dir
    INTERRUPT["base"] = 0
    with pytest.raises(KeyboardInterrupt):
        run_fake(tmp_path, out="empty")
    c = compare_runs([full, tmp_path / "empty"])
    assert (c.model_ranking, c.same_ranking) == ([], None)
    assert any("ranking without base, fast" in w for w in c.warnings)
    out = tmp_path / "cmp"
    result = CliRunner().invoke(app, ["compare", str(full), str(tmp_path / "empty"),
                                      "--out", str(out)])  # fmt: skip
    assert "ranking n/a" in result.output
    assert "different order" not in (out / "compare.md").read_text()


def test_runs_judged_by_another_verdict_rule_are_compared_with_a_warning(
    pair: tuple[Path, Path],
) -> None:
    real, model = pair
    other = Manifest.load(model)
    other.hypothesis["verdict"]["metric"] = "ok_rate"
    other.save(model)
    c = compare_runs([real, model])
    said = f"{model} judges by another verdict rule than {real} (verdict.metric differ)"
    assert any(said in w for w in c.warnings), c.warnings
    assert c.gap("base", "ttft_p90").error == pytest.approx(0.25)  # the numbers still compare


def _rule(run_dir: Path, **verdict: object) -> None:
    manifest = Manifest.load(run_dir)
    manifest.hypothesis["verdict"].update(verdict)
    manifest.save(run_dir)


def test_the_ranking_is_over_the_requests_the_verdict_judges(
    pair: tuple[Path, Path],
) -> None:
    """In the model run `fast` is slower than `base` on SHORT requests alone (a fifth of
    them: the median over every request keeps `fast` first). A verdict on SHORT must
    rank by SHORT: it ranked by every request, and said "same order" here, or "different
    order" where SHORT ranks alike."""
    real, model = pair
    frame = pd.read_parquet(model / "requests.parquet")
    slow = (frame["variant"] == "fast") & (frame["input_tokens"] < 4000)
    assert 0 < slow.sum() < (frame["variant"] == "fast").sum() / 4
    frame.loc[slow, ["first_token_s", "finish_s"]] += 30.0
    frame.to_parquet(model / "requests.parquet", index=False)
    for run in (real, model):
        _rule(run, metric="ttft_p50")
    everything = compare_runs([real, model])
    assert everything.reference_ranking == everything.model_ranking == ["fast", "base"]
    for run in (real, model):
        _rule(run, **{"class": "SHORT"})
    short = compare_runs([real, model])
    assert short.ranking_scope == "SHORT"
    assert (short.reference_ranking, short.model_ranking) == (["fast", "base"], ["base", "fast"])
    assert short.same_ranking is False


def test_a_fallback_ranking_is_by_latency_lower_first(pair: tuple[Path, Path]) -> None:
    # the claimed `increase` of a cache-hit claim listed the slowest variant as best
    real, model = pair
    for run in (real, model):
        _rule(run, metric="cache_hit_rate", direction="increase")
    c = compare_runs([real, model])
    assert c.primary_metric == "ttft_p50"
    assert c.reference_ranking == c.model_ranking == ["fast", "base"]


def test_runs_of_one_side_that_reach_other_verdicts_are_said(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    # the agreement was the first model run's alone: the answer hung on argument order
    real, model = pair
    EFFECTS.update({"base": 1.0, "fast": 1.0})
    same = run_fake(tmp_path, out="same").run_dir
    c = compare_runs([real, model, same])
    said = f"the runs of one side reach different verdicts ({model} VALIDATED, {same} "
    assert any(w.startswith(said) for w in c.warnings), c.warnings


def test_a_run_compared_with_itself_is_said(pair: tuple[Path, Path]) -> None:
    """`compare X X` (or X beside its own path spelled another way) agreed with itself
    in silence: every error 0, verdicts agreeing, as if the model were exact."""
    real, model = pair
    c = compare_runs([real, model, model.parent / "." / model.name])
    assert any("is given twice" in w for w in c.warnings), c.warnings
    assert not any("is given twice" in w for w in compare_runs([real, model]).warnings)


def test_a_tie_on_one_side_is_no_different_order(pair: tuple[Path, Path]) -> None:
    """Two variants the simulator gives the same TTFT (identical policies, a deterministic
    engine) were listed in file order, and compare said "different order" of the real
    run's noisy split."""
    real, model = pair
    frame = pd.read_parquet(model / "requests.parquet")
    base = frame[frame["variant"] == "base"].set_index(["repeat", "request_id"])
    fast = frame["variant"] == "fast"
    keys = pd.MultiIndex.from_frame(frame.loc[fast, ["repeat", "request_id"]])
    for column in ("sent_s", "first_token_s", "finish_s"):
        frame.loc[fast, column] = base.loc[keys, column].to_numpy()
    frame.to_parquet(model / "requests.parquet", index=False)
    for run in (real, model):
        _rule(run, metric="ttft_p50")
    c = compare_runs([real, model])
    assert c.reference_ranking == ["fast", "base"]
    assert c.same_ranking is True
    assert any("base and fast tie on ttft_p50 in the fake run" in w for w in c.warnings), c.warnings
