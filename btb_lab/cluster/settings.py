"""Real-cluster launch settings (the `cluster.launch` block of a hypothesis)."""

from __future__ import annotations

from pydantic import Field

from btb_lab.config import StrictModel

__all__ = ["LaunchSettings"]


class LaunchSettings(StrictModel):
    """How to start (or attach to) vLLM servers for the cluster backend."""

    served_model: str | None = Field(
        None, description="Model path or name passed to vLLM (defaults to the model preset's)."
    )
    endpoints: list[str] | None = Field(
        None, description="Attach to servers someone else started instead of launching."
    )
    host: str = Field("127.0.0.1", description="Address servers bind to.")
    extra_args: dict[str, list[str]] = Field(
        default_factory=dict, description="Extra vLLM arguments per role (C, PS)."
    )
    env: dict[str, dict[str, str]] = Field(
        default_factory=dict, description="Extra environment per role (C, PS)."
    )
    ready_timeout_s: float = Field(600.0, gt=0, description="Wait this long for /health.")
    request_timeout_s: float = Field(300.0, gt=0, description="Per-request read timeout.")
    fresh_restart: bool = Field(True, description="Restart instances between variants.")
