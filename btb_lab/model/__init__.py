"""The backend-neutral model of the hardware and its costs: GPU and LLM presets and the
instances built from them (`hardware`), roofline formulas and the seed's cost table
(`roofline`), and the cost model the simulator's engine and every cost-based policy share
(`costmodel`). Imports config and the base modules only; neither backend is imported here.
"""

from btb_lab.model.costmodel import InstanceCosts, RooflineCostModel, build_cost_model
from btb_lab.model.hardware import (
    GPU_PRESETS,
    MODEL_PRESETS,
    GPUSpec,
    InstanceSpec,
    ModelSpec,
    build_instances,
    kv_bytes_per_token,
    make_instance,
    resolve_gpu,
    resolve_model,
)

__all__ = [
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "GPUSpec",
    "InstanceCosts",
    "InstanceSpec",
    "ModelSpec",
    "RooflineCostModel",
    "build_cost_model",
    "build_instances",
    "kv_bytes_per_token",
    "make_instance",
    "resolve_gpu",
    "resolve_model",
]
