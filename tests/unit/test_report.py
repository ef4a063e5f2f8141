"""Report rendering: seed-log shape, byte-for-byte re-rendering, interrupted runs."""

from __future__ import annotations

import json
from pathlib import Path

from btb_lab.report.render import build_report
from tests.unit.test_runner_fake import fake_effects, run_fake

__all__ = ["fake_effects"]


def test_report_has_the_seed_log_shape(tmp_path: Path, fake_effects) -> None:
    fake_effects["fast"] = 0.5
    outcome = run_fake(tmp_path)
    report = (outcome.run_dir / "report.md").read_text()
    summary = outcome.summary
    assert summary is not None
    base = summary.variants["base"].all
    assert report.startswith("# HT: Test hypothesis\n")
    for heading in (
        "**Claim**: fast is faster than base",
        "**Prior evidence**: none",
        "**Experiment**: backend `fake`",
        "**Result** (TTFT, TPOT and E2E in seconds):",
        "**Verdict**: **VALIDATED**.",
    ):
        assert heading in report
    expected = (
        f"OK={base.ok}/{base.n} TTFT50={base.ttft_p50:.3f} "
        f"TTFT90={base.ttft_p90:.3f} TPOT90={base.tpot_p90:.4f} E2E50={base.e2e_p50:.3f}"
    )
    assert expected in report
    assert "LONG: n=" in report
    assert "SHORT: n=" in report
    assert "fake.factor=1.0" in report  # backend fidelity is printed
    assert "time_scale 1" in report
    assert "](plots/latency_cdf.png)" in report
    assert "](plots/timeline.png)" in report
    assert (outcome.run_dir / "plots" / "latency_cdf.png").is_file()
    assert (outcome.run_dir / "plots" / "timeline.png").is_file()
    assert (outcome.run_dir / "plots" / "utilization.png").is_file()
    assert summary.verdict.reason in report


def test_rerender_is_byte_for_byte(tmp_path: Path, fake_effects) -> None:
    outcome = run_fake(tmp_path)
    run_dir = outcome.run_dir
    before = {p: (run_dir / p).read_bytes() for p in ("report.md", "summary.json")}
    (run_dir / "report.md").unlink()
    build_report(run_dir)
    after = {p: (run_dir / p).read_bytes() for p in ("report.md", "summary.json")}
    assert before == after


def test_summary_contract_keys(tmp_path: Path, fake_effects) -> None:
    outcome = run_fake(tmp_path)
    summary = json.loads((outcome.run_dir / "summary.json").read_text())
    assert summary["hypothesis"] == "HT"
    assert summary["backend"] == "fake"
    # no effect set: both run at 1.0, with independent noise on 120 requests, so the
    # interval reaches both sides of the 5% bar
    assert summary["verdict"]["word"] == "INCONCLUSIVE"
    assert summary["verdict"]["variants"]["fast"]["primary"]["outcome"] == "straddles"
    v = summary["variants"]["fast"]
    for stat in ("n", "ok", "ok_rate", "ttft_p50", "ttft_p90", "ttft_p95", "ttft_p99",
                 "ttft_mean", "tpot_p90", "e2e_p50", "e2e_mean"):  # fmt: skip
        assert stat in v["all"]
    assert set(v["gpu"]) >= {"imbalance", "std", "max"}
    assert set(v["pools"]) == {"synthetic"}
    assert v["pools"]["synthetic"]["n"] == 120
    primary = summary["verdict"]["variants"]["fast"]["primary"]
    for key in ("level", "method", "p_value", "adjustment", "repeat_changes", "repeats_agree"):
        assert key in primary
    assert v["routes"] == {"COLO": 120}
    assert v["cache"]["requests_with_hit"] == 60


def test_engine_lines_show_per_instance_cache_hit_rates_of_real_runs() -> None:
    from btb_lab.report.describe import engine_lines
    from btb_lab.results import RunEntry

    def entry(variant: str, repeat: int, extra: dict | None = None) -> RunEntry:
        return RunEntry(variant=variant, repeat=repeat, seed=0, workload_seed=0, requests=1,
                        status="ok", started="now", extra=extra or {})  # fmt: skip

    runs = [
        entry("least_load", 0, {
            "metrics": {"cache_hit_rate": {"C1": 0.125, "C0": None}},
            "driver": {"lag_p99_ms": 1.234},
        }),
        entry("cache_aware", 1, {"metrics": {"cache_hit_rate": {"C0": 0.5, "C1": 0.75}}}),
        entry("sim_run", 0),  # simulator runs carry no engine metrics
    ]  # fmt: skip
    assert engine_lines(runs) == [
        "least_load r1: prefix-cache hit C0 n/a, C1 12.5%; driver send lag p99 1.23 ms",
        "cache_aware r2: prefix-cache hit C0 50.0%, C1 75.0%",
    ]
    # an instance whose /metrics failed was left out of the line, or the line was dropped
    broken = [
        entry("v", 0, {"metrics": {
            "before": {"C0": {"x": 1.0}, "C1": {"error": "ConnectError"}},
            "after": {"C0": {"x": 2.0}, "C1": {"x": 3.0}},
            "cache_hit_rate": {"C0": 0.25, "C1": 0.9},
        }}),
        entry("v", 1, {"metrics": {
            "before": {"C0": {"x": 1.0}}, "after": {"C0": {"error": "ReadTimeout"}},
            "cache_hit_rate": {},
        }}),
    ]  # fmt: skip
    assert engine_lines(broken) == [
        "v r1: prefix-cache hit C0 25.0%, C1 n/a (/metrics failed: ConnectError at the start)",
        "v r2: prefix-cache hit C0 n/a (/metrics failed: ReadTimeout at the end)",
    ]


def test_latest_verdicts_finds_runs_anywhere_and_skips_overridden_ones(tmp_path: Path) -> None:
    from btb_lab.analysis.models import PrimarySpec, Summary, Verdict
    from btb_lab.report.listing import latest_verdicts
    from btb_lab.results import Manifest

    def stored(rel: str, hid: str, run_id: str, word: str, overrides: dict | None = None) -> None:
        run_dir = tmp_path / rel
        run_dir.mkdir(parents=True)
        Summary(
            hypothesis=hid, title="t", run_id=run_id, backend="sim", complete=True,
            baseline="b", primary=PrimarySpec(metric="ttft_p90", direction="decrease",
            min_effect=0.05), verdict=Verdict(word=word, reason="r"),
        ).save(run_dir)  # fmt: skip
        Manifest(
            run_id=run_id, run_dir=str(run_dir), hypothesis_id=hid, hypothesis_file="h.yaml",
            hypothesis={}, cli={"options": {"overrides": overrides or {}}}, backend="sim",
            variants=["b"], repeats=1, master_seed=0, runs_planned=1, started="now",
            finished="later", complete=True,
        ).save(run_dir)  # fmt: skip
        (tmp_path / "junk").mkdir(exist_ok=True)  # a summary.json that is not ours is skipped
        (tmp_path / "junk" / "summary.json").write_text("{}")

    stored("H4/20260101T000000Z-aaaaaa", "H4", "20260101T000000Z-aaaaaa", "REJECTED")
    stored("log/h4", "H4", "20260102T000000Z-bbbbbb", "VALIDATED")  # make log, newer
    stored("sweeps/s/p1", "H4", "20260103T000000Z-cccccc", "INCONCLUSIVE", {"model": "x"})
    stored("H7/20260101T000000Z-dddddd", "H7", "20260101T000000Z-dddddd", "REJECTED")
    assert latest_verdicts(tmp_path) == {
        "H4": ("VALIDATED", str(tmp_path / "log/h4")),
        "H7": ("REJECTED", str(tmp_path / "H7/20260101T000000Z-dddddd")),
    }


def test_the_decision_rule_line_names_every_scope_of_the_claim_and_its_guards() -> None:
    """A guard restricted to a pool or a class is stated as such, and ok_rate's limit in
    points (it is absolute), as the verdict applies them."""
    from btb_lab.config.hypothesis import Hypothesis
    from btb_lab.report import describe

    hyp = Hypothesis.model_validate(
        {
            "id": "x", "title": "t", "claim": "c", "model": "llama-3.3-70b",
            "workload": {"generator": {"kind": "poisson"}},
            "variants": {"a": {"router": {"policy": "least_load"}},
                         "b": {"router": {"policy": "cache_aware"}}},
            "baseline": "a",
            "verdict": {
                "metric": "ttft_p90", "pool": "art", "direction": "decrease", "min_effect": 0.05,
                "guards": [{"metric": "ok_rate", "max_worse": 0.01},
                           {"metric": "e2e_p90", "pool": "mooncake", "max_worse": 0.1}],
            },
        }
    )  # fmt: skip
    assert describe.rule(hyp) == (
        "ttft_p90 in pool `art` decreases by at least 5% vs `a`; "
        "guards: ok_rate ≤ 1 pt worse, e2e_p90 in pool `mooncake` ≤ 10% worse"
    )


def test_a_class_scoped_rule_says_whose_labels_the_class_is() -> None:
    """The verdict on WARM reads the requests the baseline labels WARM (paired), the
    Result block each variant's own WARM: "+15.7%" beside rows that read −5%, unexplained."""
    from btb_lab.config.hypothesis import Hypothesis
    from btb_lab.report import describe

    hyp = Hypothesis.model_validate({
        "id": "x", "title": "t", "claim": "c", "workload": {"generator": {"kind": "poisson"}},
        "classes": [{"name": "WARM"}],
        "variants": {"a": {"router": {"policy": "least_load"}}}, "baseline": "a",
        "verdict": {"metric": "ttft_p90", "class": "WARM"},
    })  # fmt: skip
    assert describe.rule(hyp).endswith(
        "; a class (WARM) is the requests the baseline labels so, both variants judged on "
        "them (the Result's class rows label each variant's own)"
    )


def test_the_workload_line_names_every_setting_that_shapes_the_replay() -> None:
    """Jitter, resampling, an offset and window gaps written in the file changed what was
    replayed but not the report's words: two reports of different experiments read alike."""
    from btb_lab.config.hypothesis import Hypothesis
    from btb_lab.report import describe

    def line(**workload: object) -> str:
        return describe.workload(Hypothesis.model_validate({
            "id": "x", "title": "t", "claim": "c",
            "workload": {"trace": {"path": "t.jsonl"}, **workload},
            "variants": {"a": {"router": {"policy": "least_load"}}}, "baseline": "a",
            "verdict": {"metric": "ttft_p90"},
        }))  # fmt: skip

    assert line() == "trace `t.jsonl` (mooncake)"
    assert line(offset=200, window_gap_s=30.0,
                variation={"arrival_jitter_s": 2.0, "resample_windows": True}) == (
        "trace `t.jsonl` (mooncake), from request 200 on (offset), windows 30 s apart, "
        "arrivals jittered ±2 s per repeat, windows resampled with replacement per repeat"
    )  # fmt: skip
