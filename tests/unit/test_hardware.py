"""Hardware and model presets: the seed's figures, per-GPU vs per-node, fit errors."""

from __future__ import annotations

import pytest

from btb_lab.config.hypothesis import ClusterSpec, InstanceGroup, ModelShape
from btb_lab.errors import UserError
from btb_lab.model.hardware import (
    GPU_PRESETS,
    MODEL_PRESETS,
    build_instances,
    kv_bytes_per_token,
    make_instance,
    resolve_model,
)


def test_seed_node_aggregates_per_gpu_figures() -> None:
    inst = make_instance(0, "C0", "C", GPU_PRESETS["H100"], 4, MODEL_PRESETS["llama-3.3-70b"])
    assert inst.flops == pytest.approx(4 * 989e12)
    assert inst.hbm_bw == pytest.approx(13.4e12)
    assert inst.ram_bw == pytest.approx(220e9)
    assert inst.rdma_bw == pytest.approx(200e9)
    assert inst.disk_bw == pytest.approx(7e9)  # shared: does not scale with GPUs


def test_llama_kv_is_320_kib_per_token() -> None:
    assert kv_bytes_per_token(MODEL_PRESETS["llama-3.3-70b"]) == 320 * 1024


def test_every_preset_fits_its_seed_setup() -> None:
    setups = [
        ("llama-3.3-70b", "H100", 4),
        ("qwen3-8b", "H100", 4),
        ("glm45", "H100", 4),
        ("glm46", "H100", 8),
        ("kimi-k2", "H100", 8),
        ("dense1t-gqa16", "B300", 4),
    ]
    for model, gpu, n in setups:
        inst = make_instance(0, "C0", "C", GPU_PRESETS[gpu], n, MODEL_PRESETS[model])
        assert inst.kv_budget_tokens > 1024, model
    assert set(GPU_PRESETS) == {"A100", "H100", "H200", "B200", "B300", "MI300X"}


def test_model_that_does_not_fit_names_the_instance() -> None:
    cluster = ClusterSpec(instances=[InstanceGroup(count=2, gpu="H100", gpus=1)])
    with pytest.raises(UserError, match=r"instance C0 .*does not fit"):
        build_instances("llama-3.3-70b", cluster)


def test_model_leaving_no_kv_room_is_an_error() -> None:
    # 141.2 GB of weights in 2×80 GB × 0.8845 = 141.5 GB leaves room for ~976 tokens
    cluster = ClusterSpec(instances=[InstanceGroup(count=1, gpu="H100", gpus=2)])
    with pytest.raises(UserError, match=r"instance C0 .*leaves"):
        build_instances("llama-3.3-70b", cluster, gpu_memory_utilization=0.8845)


def test_instances_named_per_role_in_order() -> None:
    cluster = ClusterSpec(
        instances=[
            InstanceGroup(role="PS", count=1, gpu="H100", gpus=4),
            InstanceGroup(role="C", count=2, gpu="H200", gpus=4),
        ]
    )
    insts = build_instances("llama-3.3-70b", cluster)
    assert [(i.index, i.name, i.role, i.gpu.name) for i in insts] == [
        (0, "PS0", "PS", "H100"),
        (1, "C0", "C", "H200"),
        (2, "C1", "C", "H200"),
    ]


def test_explicit_shape_and_unknown_names() -> None:
    shape = ModelShape(params=8e9, layers=32, kv_heads=8, head_dim=128)
    spec = resolve_model(shape)
    assert spec.active_params == 8e9
    assert kv_bytes_per_token(spec) == 2 * 32 * 8 * 128 * 2
    with pytest.raises(UserError, match="unknown model"):
        resolve_model("gpt-17")
    cluster = ClusterSpec(instances=[InstanceGroup(gpu="TPU9")])
    with pytest.raises(UserError, match="unknown gpu"):
        build_instances("qwen3-8b", cluster)
