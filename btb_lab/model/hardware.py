"""GPU and model presets, and the instance shapes the simulator and cost model are built on.

An instance is `gpus` GPUs of one type serving one model tensor-parallel: compute, HBM
bandwidth and capacity, PCIe (host RAM) and RDMA bandwidth add up across its GPUs; the
node's disk is shared, so its bandwidth does not scale with the GPU count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from btb_lab.errors import UserError

if TYPE_CHECKING:
    from btb_lab.config.hypothesis import ClusterSpec, ModelShape

__all__ = [
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "GPUSpec",
    "InstanceSpec",
    "ModelSpec",
    "build_instances",
    "kv_bytes_per_token",
    "make_instance",
    "no_query_width",
    "resolve_gpu",
    "resolve_model",
]

GB = 1e9


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """One GPU. Bandwidths are bytes/s *per GPU*; `disk_bw` is the whole node's (shared)."""

    name: str
    flops: float  # peak dense bf16 FLOP/s
    hbm_bw: float  # bytes/s
    hbm_bytes: float
    pcie_bw: float  # host RAM <-> GPU, bytes/s per GPU
    rdma_bw: float  # GPU <-> remote GPU, bytes/s per GPU
    disk_bw: float  # NVMe, bytes/s, shared by the node


# Figures per GPU. The seed's 4×H100 node is HBM 13.4 TB/s, PCIe 220 GB/s, RDMA 200 GB/s
# and disk 7 GB/s (shared), i.e. 3.35 TB/s, 55 GB/s and 50 GB/s per GPU; other GPUs use
# the same host link and NIC class unless their platform ships a faster one.
GPU_PRESETS: dict[str, GPUSpec] = {
    # NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s dense bf16, 2,039 GB/s HBM2e;
    # PCIe Gen4 x16 (~27.5 GB/s usable), 200 Gb/s HDR InfiniBand per GPU (25 GB/s).
    "A100": GPUSpec("A100", 312e12, 2.039e12, 80 * GB, 27.5 * GB, 25 * GB, 7 * GB),
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB (seed).
    "H100": GPUSpec("H100", 989e12, 3.35e12, 80 * GB, 55 * GB, 50 * GB, 7 * GB),
    # NVIDIA H200 SXM datasheet: same compute as H100, 4.8 TB/s HBM3e, 141 GB.
    "H200": GPUSpec("H200", 989e12, 4.8e12, 141 * GB, 55 * GB, 50 * GB, 7 * GB),
    # NVIDIA HGX B200 datasheet: 2.25 PFLOP/s dense bf16 per GPU, 8 TB/s, 180 GB HBM3e;
    # ConnectX-7 400 Gb/s per GPU (50 GB/s).
    "B200": GPUSpec("B200", 2.25e15, 8e12, 180 * GB, 55 * GB, 50 * GB, 7 * GB),
    # NVIDIA HGX B300 (Blackwell Ultra) datasheet: 2.25 PFLOP/s dense bf16, 8 TB/s,
    # 288 GB HBM3e; PCIe Gen6 (~110 GB/s), ConnectX-8 800 Gb/s per GPU (100 GB/s).
    "B300": GPUSpec("B300", 2.25e15, 8e12, 288 * GB, 110 * GB, 100 * GB, 7 * GB),
    # AMD Instinct MI300X datasheet: 1,307.4 TFLOP/s dense bf16, 5.3 TB/s, 192 GB HBM3;
    # PCIe Gen5 x16, 400 Gb/s NIC per GPU.
    "MI300X": GPUSpec("MI300X", 1307.4e12, 5.3e12, 192 * GB, 55 * GB, 50 * GB, 7 * GB),
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A served model. `weight_bytes` per parameter and `kv_dtype_bytes` per KV element
    differ for quantized checkpoints (weights in fp8/int4, KV cache in bf16).
    `query_width` is query heads × the dimension attention scores and values are computed
    over (the roofline's prefill attention term, `costs.prefill_attention`); None where
    the shape does not say."""

    name: str
    params: float
    active_params: float  # per token (MoE); equals params for dense models
    weight_bytes: float  # bytes per parameter
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype_bytes: float = 2.0
    query_width: int | None = None

    @property
    def weight_total_bytes(self) -> float:
        return self.params * self.weight_bytes

    @property
    def active_weight_bytes(self) -> float:
        """Weight bytes one decode step reads."""
        return self.active_params * self.weight_bytes


MODEL_PRESETS: dict[str, ModelSpec] = {
    # Llama-3.3-70B-Instruct config.json, fp16 as in the seed: 80 layers, 8 KV heads × 128.
    # 64 query heads × 128.
    "llama-3.3-70b": ModelSpec(
        "llama-3.3-70b", 70.6e9, 70.6e9, 2, 80, 8, 128, query_width=64 * 128
    ),
    # Qwen3-8B config.json: 8.2B params, 36 layers, 8 KV heads × 128, bf16; 32 query heads.
    "qwen3-8b": ModelSpec("qwen3-8b", 8.2e9, 8.2e9, 2, 36, 8, 128, query_width=32 * 128),
    # GLM-4.5 (355B total / 32B active MoE, 92 layers, 8 KV heads × 128, 96 query heads).
    # int4 weights (AWQ/GPTQ) so it fits 4×H100 as in the seed's glm45_h100x4 setup; bf16 KV.
    "glm45": ModelSpec("glm45", 355e9, 32e9, 0.5, 92, 8, 128, query_width=96 * 128),
    # GLM-4.6 (same shape as GLM-4.5, 355B / 32B active) with fp8 weights (the official
    # -FP8 checkpoint), bf16 KV. (Not the seed's `glm52` setup: that is `seed-glm52`.)
    "glm46": ModelSpec("glm46", 355e9, 32e9, 1, 92, 8, 128, query_width=96 * 128),
    # Kimi K2 (1.04T total / 32B active, 61 layers, MLA). MLA caches one 576-wide latent
    # per layer (kv_lora_rank 512 + rope 64), modeled as 1 head × 288 for K and V; int4
    # weights (as Kimi-K2-Thinking ships) so it fits 8×H100. Prefill attention runs on 64
    # heads with 192-wide scores (128 + rope 64) and 128-wide values: the mean, 160 × 64.
    "kimi-k2": ModelSpec("kimi-k2", 1.04e12, 32e9, 0.5, 61, 1, 288, query_width=160 * 64),
    # A hypothetical dense 1T model: 120 layers, GQA with 16 KV heads × 128, fp8 weights,
    # bf16 KV (983,040 B/token). (The seed's dense1t is `seed-dense1t`.)
    "dense1t-gqa16": ModelSpec("dense1t-gqa16", 1e12, 1e12, 1, 120, 16, 128),
    # The BTB seed simulator's six setups, exactly as it defines them (SEED-SIMULATOR.md):
    # one dtype for weights and KV; KV bytes/token = 2 × layers × KV heads × head dim ×
    # dtype bytes gives the seed's figures (327,680 / 147,456 / 47,104 / 22,464 / 62,464 /
    # 245,760). The shapes behind the MoE and MLA figures are the seed's arithmetic, not
    # the released checkpoints' configs.
    "seed-llama-3.3-70b": ModelSpec("seed-llama-3.3-70b", 70.6e9, 70.6e9, 2, 80, 8, 128, 2),
    "seed-qwen3-8b": ModelSpec("seed-qwen3-8b", 8.19e9, 8.19e9, 2, 36, 8, 128, 2),
    "seed-glm45": ModelSpec("seed-glm45", 355e9, 32e9, 0.5, 92, 4, 128, 0.5),
    "seed-glm52": ModelSpec("seed-glm52", 744e9, 40e9, 0.5, 78, 1, 288, 0.5),
    "seed-kimi-k2": ModelSpec("seed-kimi-k2", 1e12, 32e9, 0.5, 61, 8, 128, 0.5),
    "seed-dense1t": ModelSpec("seed-dense1t", 1e12, 1e12, 1, 120, 8, 128, 1),
}


# Names that promised the seed's model while meaning another; asking for one says which.
RENAMED_PRESETS = {
    "glm52": "use glm46 (GLM-4.6, fp8 weights, bf16 KV) or seed-glm52 (the seed's setup)",
    "dense1t": "use dense1t-gqa16 (16 KV heads, bf16 KV) or seed-dense1t (the seed's setup)",
}


def no_query_width(model: ModelSpec) -> str:
    """Why `model` cannot price prefill attention (`costs.prefill_attention`)."""
    having = ", ".join(name for name, spec in MODEL_PRESETS.items() if spec.query_width)
    return (
        f"model {model.name} has no query width for the prefill attention term; give "
        "model.attention_heads (config.json num_attention_heads) or use a preset that has "
        f"one ({having})"
    )


def kv_bytes_per_token(model: ModelSpec) -> float:
    """K and V for every layer and KV head: 2 × layers × kv_heads × head_dim × bytes."""
    return 2 * model.layers * model.kv_heads * model.head_dim * model.kv_dtype_bytes


def resolve_model(model: str | ModelShape) -> ModelSpec:
    """A preset by name, or an explicit `ModelShape` from a hypothesis file."""
    if isinstance(model, str):
        key = model.lower()
        if key in RENAMED_PRESETS:
            raise UserError(f"model {model!r} was renamed: {RENAMED_PRESETS[key]}")
        if key not in MODEL_PRESETS:
            raise UserError(
                f"unknown model {model!r}; choose one of: {', '.join(sorted(MODEL_PRESETS))} "
                "or give an explicit shape (params, layers, kv_heads, head_dim)"
            )
        return MODEL_PRESETS[key]
    return ModelSpec(
        name=model.name,
        params=model.params,
        active_params=model.active_params or model.params,
        weight_bytes=model.dtype_bytes,
        layers=model.layers,
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        kv_dtype_bytes=model.dtype_bytes,
        query_width=model.attention_heads and model.attention_heads * model.head_dim,
    )


def resolve_gpu(name: str) -> GPUSpec:
    for key, spec in GPU_PRESETS.items():
        if key.lower() == name.lower():
            return spec
    raise UserError(f"unknown gpu {name!r}; choose one of: {', '.join(GPU_PRESETS)}")


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One serving instance: aggregated hardware plus the model it serves."""

    index: int
    name: str  # C0, C1, ..., PS0, ...
    role: str  # "C" or "PS"
    gpu: GPUSpec
    gpus: int
    model: ModelSpec
    kv_budget_bytes: float  # HBM left for KV after weights (within gpu_memory_utilization)
    kv_connector: bool = False

    @property
    def flops(self) -> float:
        return self.gpu.flops * self.gpus

    @property
    def hbm_bw(self) -> float:
        return self.gpu.hbm_bw * self.gpus

    @property
    def ram_bw(self) -> float:
        return self.gpu.pcie_bw * self.gpus

    @property
    def rdma_bw(self) -> float:
        return self.gpu.rdma_bw * self.gpus

    @property
    def disk_bw(self) -> float:
        return self.gpu.disk_bw  # shared by the node: does not scale with GPUs

    @property
    def kv_bytes_per_token(self) -> float:
        return kv_bytes_per_token(self.model)

    @property
    def kv_budget_tokens(self) -> int:
        return int(self.kv_budget_bytes // self.kv_bytes_per_token)


def make_instance(
    index: int,
    name: str,
    role: str,
    gpu: GPUSpec,
    gpus: int,
    model: ModelSpec,
    *,
    gpu_memory_utilization: float = 0.9,
    kv_connector: bool = False,
) -> InstanceSpec:
    """An instance, or a UserError naming it when the model does not fit or leaves no KV."""
    usable = gpu.hbm_bytes * gpus * gpu_memory_utilization
    weights = model.weight_total_bytes
    label = f"instance {name} ({gpus}×{gpu.name}, {usable / GB:.0f} GB usable HBM)"
    if weights >= usable:
        raise UserError(
            f"{label}: model {model.name} needs {weights / GB:.0f} GB of weights and does "
            "not fit; use more GPUs per instance, a larger GPU or a quantized model"
        )
    budget = usable - weights
    if budget < kv_bytes_per_token(model) * 1024:
        raise UserError(
            f"{label}: model {model.name} leaves {budget / GB:.2f} GB for KV, not even "
            "1,024 tokens; use more GPUs per instance"
        )
    return InstanceSpec(index, name, role, gpu, gpus, model, budget, kv_connector)


def build_instances(
    model: str | ModelShape | ModelSpec,
    cluster: ClusterSpec,
    *,
    gpu_memory_utilization: float = 0.9,
) -> list[InstanceSpec]:
    """Instances in hypothesis order, named C0.. and PS0.. per role."""
    spec = model if isinstance(model, ModelSpec) else resolve_model(model)
    connector = cluster.kv_connector.type != "none"
    counters: dict[str, int] = {}
    out: list[InstanceSpec] = []
    for group in cluster.instances:
        gpu = resolve_gpu(group.gpu)
        for _ in range(group.count):
            number = counters.get(group.role, 0)
            counters[group.role] = number + 1
            out.append(
                make_instance(
                    len(out),
                    f"{group.role}{number}",
                    group.role,
                    gpu,
                    group.gpus,
                    spec,
                    gpu_memory_utilization=gpu_memory_utilization,
                    kv_connector=connector,
                )
            )
    return out
