"""Known answers: the seed's prefill-vs-transfer table, cell by cell, and the CLI."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from btb_lab.cli import app
from btb_lab.config.costs import CostSettings
from btb_lab.model.costmodel import RooflineCostModel
from btb_lab.model.hardware import GPU_PRESETS, MODEL_PRESETS, make_instance
from btb_lab.model.roofline import COST_TABLE_TIERS, cost_table, format_ms

SEED_TABLE = {
    "prefill": ["35.7", "71.4", "142.8", "571", "1142", "2284"],
    "disk": ["23.4", "46.8", "93.6", "374", "749", "1498"],
    "RDMA": ["0.82", "1.64", "3.28", "13.1", "26.2", "52.4"],
    "RAM": ["0.74", "1.49", "2.98", "11.9", "23.8", "47.7"],
    "HBM": ["0.012", "0.024", "0.049", "0.20", "0.39", "0.78"],
}


@pytest.fixture
def node():  # type: ignore[no-untyped-def]
    return make_instance(0, "C0", "C", GPU_PRESETS["H100"], 4, MODEL_PRESETS["llama-3.3-70b"])


@pytest.mark.parametrize("tier", COST_TABLE_TIERS)
def test_every_cell_matches_the_seed(node, tier: str) -> None:  # type: ignore[no-untyped-def]
    printed = [format_ms(v) for v in cost_table(node)[tier]]
    assert printed == SEED_TABLE[tier]


def test_exact_values_behind_the_rounding(node) -> None:  # type: ignore[no-untyped-def]
    table = cost_table(node)
    assert table["RAM"][0] == pytest.approx(0.7447, abs=1e-4)  # seed printed 0.75
    assert table["prefill"][1] == pytest.approx(1000 * 2 * 70.6e9 / (4 * 989e12 * 0.5) * 1e3)


def test_cli_prints_the_table() -> None:
    result = CliRunner().invoke(
        app, ["sim", "costs", "--model", "llama-3.3-70b", "--gpu", "H100", "--gpus", "4"]
    )
    assert result.exit_code == 0, result.output
    for tier, cells in SEED_TABLE.items():
        assert f"| {tier} | " + " | ".join(cells) + " |" in result.output


def test_cost_model_transfer_uses_setup_and_slower_link() -> None:
    fast = make_instance(0, "C0", "C", GPU_PRESETS["B300"], 4, MODEL_PRESETS["llama-3.3-70b"])
    slow = make_instance(1, "C1", "C", GPU_PRESETS["H100"], 4, MODEL_PRESETS["llama-3.3-70b"])
    costs = RooflineCostModel([fast, slow], CostSettings(mfu=0.5, transfer_setup_ms=1.0))
    expected = 0.001 + 1000 * 320 * 1024 / 200e9  # H100 node's 200 GB/s bounds the copy
    assert costs.transfer_s(1000, 0, 1) == pytest.approx(expected)
    assert costs.transfer_s(1000, 1, 0) == pytest.approx(expected)
    assert costs.prefill_s(1, 1000) == pytest.approx(0.0713852, rel=1e-5)
    assert costs.prefill_s(0, 1000) < costs.prefill_s(1, 1000)
