"""The assumption waterfall: cumulative steps from the seed profile that end exactly at
btb-lab's causal defaults, and the sweep table's published-figure columns."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pandas as pd
import pytest

from btb_lab.config.costs import CostSettings
from btb_lab.config.sim import SimSettings
from btb_lab.hypothesis import load_hypothesis
from btb_lab.policies.btb import BTBParams
from btb_lab.policies.cache_aware import CacheAwareParams
from btb_lab.sweep import load_sweep
from btb_lab.sweep.ablate import ABLATIONS, ablation_sweep, step_labels, waterfall_table
from btb_lab.sweep.spec import TableSpec
from btb_lab.sweep.table import build_table

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "experiments" / "btb_seed_table.yaml"


def _resolved(overrides: dict[str, object]):  # type: ignore[no-untyped-def]
    return load_hypothesis(ROOT / "hypotheses" / "btb-seed.yaml", overrides).hypothesis


def test_steps_are_cumulative_and_end_at_the_causal_defaults() -> None:
    doc = ablation_sweep(load_sweep(TABLE), "infer-sim")
    steps = doc["axes"]["step"]
    labels = step_labels("infer-sim")
    assert list(steps) == labels
    assert len(labels) == len(ABLATIONS["infer-sim"]) + 1
    assert steps[labels[0]] == {}
    for earlier, later in itertools.pairwise(labels):
        assert set(steps[earlier]) <= set(steps[later])  # cumulative
    first = _resolved({**doc["overrides"], **steps[labels[0]]})
    assert first.sim.window_replay == "fresh"
    assert first.costs.gpu_memory_utilization == 1.0
    last = _resolved({**doc["overrides"], **steps[labels[-1]]})
    # every rule switched: the causal defaults, only the profile's name left
    assert last.sim == SimSettings(profile="infer-sim")
    assert last.costs == CostSettings()
    ca = last.variants["cache_aware"].router.params
    btb = last.variants["btb"].router.params
    assert CacheAwareParams.model_validate(ca) == CacheAwareParams()
    defaults = BTBParams().model_dump()
    assert {k: v for k, v in BTBParams.model_validate(btb).model_dump().items()
            if k in ("tie_break", "recopy", "route_active")} == {
        k: defaults[k] for k in ("tie_break", "recopy", "route_active")
    }  # fmt: skip


def test_every_step_switches_something() -> None:
    doc = ablation_sweep(load_sweep(TABLE), "infer-sim")
    steps = list(doc["axes"]["step"].values())
    for before, after in itertools.pairwise(steps):
        assert len(after) > len(before) or after != before


def test_unknown_profile_is_refused() -> None:
    from btb_lab.errors import UserError

    with pytest.raises(UserError, match="--from"):
        ablation_sweep(load_sweep(TABLE), "vidur")


def test_waterfall_table_orders_steps() -> None:
    labels = ["0 a", "1 b", "2 c"]
    df = pd.DataFrame(
        {"setup": ["x", "x", "x", "y", "y", "y"], "step": ["2 c", "0 a", "1 b"] * 2,
         "h": [1.0, 3.0, 2.0, 6.0, 4.0, 5.0]}
    )  # fmt: skip
    wide = waterfall_table(df, "h", labels, "setup")
    assert list(wide.columns) == labels
    assert wide.loc["x"].tolist() == [3.0, 2.0, 1.0]
    assert wide.loc["y"].tolist() == [4.0, 5.0, 6.0]


def test_a_step_with_no_headline_keeps_its_column() -> None:
    # steps n/a in every setup (a GPU headline a variant has none of, a failed point) were
    # dropped from waterfall.md without a mark, the later steps shifting left
    labels = ["0 a", "1 b", "2 c", "3 d"]
    df = pd.DataFrame(
        {"setup": ["x", "x", "x"], "step": ["0 a", "1 b", "2 c"], "h": [3.0, math.nan, 1.0]}
    )
    wide = waterfall_table(df, "h", labels, "setup")
    assert list(wide.columns) == labels
    assert wide.loc["x"].tolist()[0] == 3.0
    assert wide.loc["x"].tolist()[2] == 1.0
    assert math.isnan(wide.loc["x"].tolist()[1])
    assert math.isnan(wide.loc["x"].tolist()[3])


def test_reference_columns_give_the_gap() -> None:
    from btb_lab.sweep.plan import SweepPoint

    table = TableSpec.model_validate(
        {
            "metrics": ["ttft_mean"],
            "variants": ["ca", "b"],
            "rename": {"ttft_mean reduction % (b vs ca)": "red"},
            "reference": {"axis": "setup", "column": "red", "values": {"s1": 50.0}},
        }
    )

    class V:
        def __init__(self, mean: float) -> None:
            self.mean = mean

        def value(self, metric: str, scope: str) -> float:
            return self.mean

    class S:
        def __init__(self, a: float, b: float) -> None:
            self.variants = {"ca": V(a), "b": V(b)}
            self.verdict = type("W", (), {"word": "VALIDATED"})()

    points = [SweepPoint("p1", {"setup": "s1"}, {}), SweepPoint("p2", {"setup": "s2"}, {})]
    df = build_table(points, {"p1": S(2.0, 0.9), "p2": S(1.0, 1.0)}, table, "ca")  # type: ignore[dict-item]
    row = df.set_index("setup").loc["s1"]
    assert row["red"] == pytest.approx(55.0)
    assert row["published_pct"] == 50.0
    assert row["red_gap_pp"] == pytest.approx(5.0)
    assert not row["red_within"]
    assert math.isnan(df.set_index("setup").loc["s2", "published_pct"])


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("sim.x={a: 1, a: 2}", "--set sim.x={a: 1, a: 2}: a: duplicate key 'a'"),
        ("notes=!!python/object/apply:os.system ['echo owned']", "not allowed"),
        ("cluster.launch.env.C.HF_TOKEN=[1,", "--set cluster.launch.env.C.HF_TOKEN=***: "),
    ],
)
def test_ablate_set_values_are_read_with_the_run_checks(
    tmp_path: Path, item: str, expected: str
) -> None:
    from tests.helpers import cli

    result = cli("ablate", tmp_path / "never-read.yaml", "--set", item)
    assert result.code == 2, result.output
    assert not result.traceback, result.output
    assert expected in result.err
    assert "[1," not in result.err  # a credential's value is not echoed
    assert "owned" not in result.out
