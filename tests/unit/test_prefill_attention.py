"""`costs.prefill_attention`: the roofline's prefill attention term, by hand. Each new token
attends to every token before it (Q·Kᵀ and the weighted sum of V, 2 × query width FLOPs
each per layer), so a cold n-token prefill adds 4 × layers × width × n²/2 FLOPs to the
linear layers' 2 × active params × n, and n new tokens after c cached ones
4 × layers × width × n × (c + n/2). Off (the default) the roofline is what it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from btb_lab.config.costs import CostSettings
from btb_lab.errors import UserError
from btb_lab.model.costmodel import RooflineCostModel
from btb_lab.model.hardware import MODEL_PRESETS, make_instance, resolve_gpu
from tests.helpers import cli, write_small
from tests.unit.test_sim_engine import nodes, req
from tests.unit.test_sim_profile_costs import run

H100X4_FLOPS = 4 * 989e12  # the preset's dense bf16 FLOP/s, four GPUs
LLAMA_LINEAR_FLOPS = 2 * 70.6e9  # per token: 2 × active params
LLAMA_ATTENTION_FLOPS = 4 * 80 * 64 * 128  # per (new, context) pair: 80 layers, 64 × 128 wide


def test_a_long_cold_prefill_costs_what_the_flops_say() -> None:
    n = 65_536
    costs = RooflineCostModel(nodes(1), CostSettings(prefill_attention=True))
    linear_s = LLAMA_LINEAR_FLOPS * n / (H100X4_FLOPS * 0.5)
    attention_s = LLAMA_ATTENTION_FLOPS * n * (n / 2) / (H100X4_FLOPS * 0.5)
    assert costs.prefill_s(0, n) == pytest.approx(linear_s + attention_s, rel=1e-12)
    # BTB's 65,536-token prefix: 1.61× the linear layers alone
    assert costs.prefill_s(0, n) / linear_s == pytest.approx(1.608, abs=1e-3)
    # after a cached prefix, the new tokens attend to all of it
    cached = 32_768
    assert costs.prefill_s(0, 512, cached) == pytest.approx(
        (LLAMA_LINEAR_FLOPS * 512 + LLAMA_ATTENTION_FLOPS * 512 * (cached + 256))
        / (H100X4_FLOPS * 0.5),
        rel=1e-12,
    )


def test_off_by_default_the_roofline_is_the_linear_layers_alone() -> None:
    costs = RooflineCostModel(nodes(1), CostSettings())
    inst = costs.per_instance[0]
    assert inst.prefill_context_token_s == 0.0
    assert not inst.prefill_terms  # the engine keeps its per-token fast path
    assert costs.prefill_s(0, 65_536, 1024) == 65_536 * LLAMA_LINEAR_FLOPS / (H100X4_FLOPS * 0.5)


def test_the_engine_charges_the_term_cold_and_after_a_cached_prefix() -> None:
    """r1: 8 blocks cold; r2, long after, the same 8 blocks and 4 more on the same instance."""
    shared = tuple(range(1, 9))
    reqs = [req("r1", 0.0, shared), req("r2", 100.0, (*shared, 91, 92, 93, 94))]
    for attention in (False, True):
        costs = RooflineCostModel(nodes(1), CostSettings(prefill_attention=attention))
        recs = run(reqs, costs)
        r1, r2 = recs["r1"], recs["r2"]
        assert r2.cached_tokens == 4096
        pair = LLAMA_ATTENTION_FLOPS * attention
        first = (LLAMA_LINEAR_FLOPS * 4096 + pair * 4096 * 2048) / (H100X4_FLOPS * 0.5)
        second = (LLAMA_LINEAR_FLOPS * 2048 + pair * 2048 * (4096 + 1024)) / (H100X4_FLOPS * 0.5)
        assert r1.prefill_s == pytest.approx(first, rel=1e-12)
        assert r1.first_token_s == pytest.approx(first, rel=1e-12)
        assert r2.prefill_s == pytest.approx(second, rel=1e-12)
        assert r2.first_token_s == pytest.approx(100.0 + second, rel=1e-12)


def test_query_widths_of_the_presets() -> None:
    assert MODEL_PRESETS["llama-3.3-70b"].query_width == 8192
    assert MODEL_PRESETS["qwen3-8b"].query_width == 4096
    # the seed's setups have none: the seed simulator has no attention term
    seed = [m for name, m in MODEL_PRESETS.items() if name.startswith("seed-")]
    assert all(m.query_width is None for m in seed)
    inst = make_instance(0, "C0", "C", resolve_gpu("H100"), 4, MODEL_PRESETS["seed-llama-3.3-70b"])
    with pytest.raises(UserError, match=r"model\.attention_heads"):
        RooflineCostModel([inst], CostSettings(prefill_attention=True))


SHAPE = (
    "model: {name: q30, params: 3.05e+10, active_params: 3.3e+9, layers: 48, kv_heads: 4, "
    "head_dim: 128}"
)
ATTENTION = "\ncosts: {prefill_attention: true}"


def test_a_shape_without_query_heads_is_refused_at_the_line(tmp_path: Path) -> None:
    path = write_small(tmp_path, **{"model: llama-3.3-70b": SHAPE + ATTENTION})
    result = cli("validate", path)
    assert result.code == 2
    assert not result.traceback
    assert f"{path}:6: costs.prefill_attention: model q30 has no query width" in result.err
    assert "model.attention_heads" in result.err
    # with the query heads given, it runs and the long prompts pay for attention
    with_heads = SHAPE.replace("head_dim: 128", "head_dim: 128, attention_heads: 32")
    ok = write_small(tmp_path, "ok.yaml", **{"model: llama-3.3-70b": with_heads + ATTENTION})
    assert cli("validate", ok).code == 0


def test_a_variant_asking_for_it_is_blamed_and_a_profile_refuses_it(tmp_path: Path) -> None:
    path = write_small(
        tmp_path,
        **{
            "model: llama-3.3-70b": SHAPE,
            "    router: {policy: round_robin}": "    router: {policy: round_robin}\n"
            "    costs: {prefill_attention: true}",
        },
    )
    result = cli("validate", path)
    assert result.code == 2
    assert not result.traceback
    assert "variants.fast.costs.prefill_attention: model q30 has no query width" in result.err
    with pytest.raises(ValueError, match="a fitted profile"):
        CostSettings(prefill_attention=True, model={"profile": "p.yaml"})


def test_sim_costs_prints_the_attention_row_only_when_asked() -> None:
    plain = cli("sim", "costs")
    assert plain.code == 0
    assert "attention" not in plain.out
    table = cli("sim", "costs", "--attention")
    assert table.code == 0
    row = next(line for line in table.out.splitlines() if line.startswith("| prefill + attention"))
    # 32k tokens: 2,284 ms of linear layers + 679 ms of attention
    assert row.split("|")[-2].strip() == "2963"
