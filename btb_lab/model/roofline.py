"""Roofline formulas: compute-bound prefill, KV movement per tier over its bandwidth, and
the seed's cost table (`btb-lab sim costs`). `costmodel.RooflineCostModel` builds on
these for the engine and the policies.
"""

from __future__ import annotations

from collections.abc import Sequence

from btb_lab.errors import UserError
from btb_lab.model.hardware import InstanceSpec, no_query_width

__all__ = [
    "ATTENTION_ROW",
    "COST_TABLE_TIERS",
    "COST_TABLE_TOKENS",
    "attention_pair_s",
    "cost_table",
    "format_ms",
    "format_tokens",
    "load_s",
    "prefill_s",
    "render_cost_table",
    "tier_bandwidth",
]

COST_TABLE_TOKENS: tuple[int, ...] = (500, 1_000, 2_000, 8_000, 16_000, 32_000)
COST_TABLE_TIERS: tuple[str, ...] = ("prefill", "disk", "RDMA", "RAM", "HBM")
ATTENTION_ROW = "prefill + attention"


def prefill_s(inst: InstanceSpec, tokens: float, mfu: float) -> float:
    """Compute-bound prefill: 2 × active params × tokens / (FLOP/s × MFU)."""
    return 2.0 * inst.model.active_params * tokens / (inst.flops * mfu)


def attention_pair_s(inst: InstanceSpec, mfu: float) -> float:
    """Prefill attention per (new token × context token): Q·Kᵀ and the weighted sum of V,
    2 × query width FLOPs each, in every layer, at FLOP/s × MFU. A cold prefill of n
    tokens has n²/2 such pairs (causal), n new tokens after c cached ones n × (c + n/2)."""
    width = inst.model.query_width
    if width is None:
        raise UserError(f"costs.prefill_attention: {no_query_width(inst.model)}")
    return 4.0 * inst.model.layers * width / (inst.flops * mfu)


def tier_bandwidth(inst: InstanceSpec, tier: str) -> float:
    """Bytes/s at which `inst` can make KV resident from `tier`."""
    bws = {
        "hbm": inst.hbm_bw,
        "ram": inst.ram_bw,
        "rdma": inst.rdma_bw,
        "remote": inst.rdma_bw,
        "disk": inst.disk_bw,
    }
    return bws[tier.lower()]


def load_s(inst: InstanceSpec, tokens: float, tier: str) -> float:
    """Bytes of `tokens` of KV over the tier's bandwidth (no setup latency)."""
    return tokens * inst.kv_bytes_per_token / tier_bandwidth(inst, tier)


def cost_table(
    inst: InstanceSpec,
    mfu: float = 0.5,
    tokens: Sequence[int] = COST_TABLE_TOKENS,
    *,
    attention: bool = False,
) -> dict[str, list[float]]:
    """Milliseconds to make N tokens of KV resident, per source (the seed's table; with
    `attention`, a cold prefill with its attention term too, after the prefill row)."""
    table: dict[str, list[float]] = {"prefill": [prefill_s(inst, n, mfu) * 1e3 for n in tokens]}
    if attention:
        pair_s = attention_pair_s(inst, mfu)
        table[ATTENTION_ROW] = [
            (prefill_s(inst, n, mfu) + pair_s * n * n / 2) * 1e3 for n in tokens
        ]
    for tier in COST_TABLE_TIERS[1:]:
        table[tier] = [load_s(inst, n, tier) * 1e3 for n in tokens]
    return table


def format_ms(value_ms: float) -> str:
    """The seed table's precision: about three significant figures, whole ms from 200."""
    if value_ms >= 200:
        return f"{value_ms:.0f}"
    if value_ms >= 10:
        return f"{value_ms:.1f}"
    if value_ms >= 0.1:
        return f"{value_ms:.2f}"
    return f"{value_ms:.3f}"


def format_tokens(tokens: int) -> str:
    """500 → "500", 8000 → "8k" (1k = 1,000 tokens, as in the seed)."""
    if tokens >= 1000 and tokens % 1000 == 0:
        return f"{tokens // 1000}k"
    return str(tokens)


def render_cost_table(
    inst: InstanceSpec,
    mfu: float = 0.5,
    tokens: Sequence[int] = COST_TABLE_TOKENS,
    *,
    attention: bool = False,
) -> str:
    """A markdown table like ARCHITECTURE.md's, with a header naming the setup."""
    table = cost_table(inst, mfu, tokens, attention=attention)
    kv_kib = inst.kv_bytes_per_token / 1024
    per_tok_us = prefill_s(inst, 1, mfu) * 1e6
    lines = [
        (
            f"{inst.gpus}×{inst.gpu.name} serving {inst.model.name}: KV {kv_kib:.0f} KiB/token, "
            f"prefill {per_tok_us:.1f} µs/token (MFU {mfu})"
        ),
        (
            f"ms to make N tokens of KV resident (HBM {inst.hbm_bw / 1e12:.1f} TB/s, "
            f"RAM {inst.ram_bw / 1e9:.0f} GB/s, RDMA {inst.rdma_bw / 1e9:.0f} GB/s, "
            f"disk {inst.disk_bw / 1e9:.0f} GB/s)"
        ),
        "",
        "| source | " + " | ".join(format_tokens(n) for n in tokens) + " |",
        "|---|" + "---:|" * len(tokens),
    ]
    for tier in table:
        lines.append(f"| {tier} | " + " | ".join(format_ms(v) for v in table[tier]) + " |")
    return "\n".join(lines)
