"""Real-cluster launch settings (the `cluster.launch` block of a hypothesis): where the
servers run (local processes or Ray actors), how they start, and how they are reached."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from btb_lab.config.base import StrictModel
from btb_lab.config.limits import MIN_SAMPLE_INTERVAL_S

__all__ = ["LaunchSettings", "RaySettings", "served_model_of"]

Role = Literal["C", "PS"]


class RaySettings(StrictModel):
    """`cluster.launch.ray`: how instances are placed on a Ray cluster (backend: ray)."""

    address: str | None = Field(
        None,
        description="Ray cluster to connect to (host:port or ray://…); unset: $RAY_ADDRESS, "
        "or, without it, a Ray instance started on this machine for the run.",
    )
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = Field(
        None,
        description="Reserve every instance's resources at once in a placement group with "
        "this strategy (SPREAD: one node per instance where possible); unset: each actor "
        "is placed on its own.",
    )
    num_cpus: float = Field(
        1.0, gt=0, description="Ray CPUs each instance's actor reserves (with its GPUs)."
    )
    resources: dict[Role, dict[str, float]] = Field(
        default_factory=dict,
        description="Extra Ray resources per role, e.g. {PS: {prefill_node: 1}}, for nodes "
        "started with `ray start --resources`.",
    )
    label_selector: dict[Role, dict[str, str]] = Field(
        default_factory=dict,
        description="Ray node labels per role (Ray ≥ 2.49), e.g. {C: {ray.io/accelerator-type: "
        "H100}}.",
    )
    host: str | None = Field(
        None,
        description="Address every server binds to and is reached at; unset: its node's "
        "address on the Ray network. 127.0.0.1 only when every node runs on this machine.",
    )
    poll_interval_s: float = Field(
        0.5, gt=0, description="How often the driver pulls logs and utilization from actors."
    )


class LaunchSettings(StrictModel):
    """How to start (or attach to) vLLM servers for the cluster backend."""

    backend: Literal["local", "ray"] = Field(
        "local",
        description="local: servers are processes of this machine; ray: each server is "
        "owned by a Ray actor placed on the cluster (see `ray`).",
    )
    ray: RaySettings = Field(
        default_factory=RaySettings, description="Placement on Ray (backend: ray)."
    )

    served_model: str | None = Field(
        None, description="Model path or name passed to vLLM (defaults to the model preset's)."
    )
    endpoints: list[str] | None = Field(
        None, description="Attach to servers someone else started instead of launching."
    )
    bootstrap_ports: list[int] | None = Field(
        None,
        description="endpoints mode with a KV connector: each endpoint's Mooncake bootstrap "
        "port (defaults to vLLM's 8998).",
    )
    host: str = Field(
        "127.0.0.1", description="Address servers bind to (backend local; see ray.host)."
    )
    extra_args: dict[str, list[str]] = Field(
        default_factory=dict, description="Extra vLLM arguments per role (C, PS)."
    )
    env: dict[str, dict[str, str]] = Field(
        default_factory=dict, description="Extra environment per role (C, PS)."
    )
    ready_timeout_s: float = Field(600.0, gt=0, description="Wait this long for /health.")
    request_timeout_s: float = Field(300.0, gt=0, description="Per-request read timeout.")
    fresh_restart: bool = Field(True, description="Restart instances between variants.")
    device: Literal["gpu", "cpu"] = Field(
        "gpu",
        description="gpu: assign CUDA_VISIBLE_DEVICES and tensor parallelism per instance; "
        "cpu: instances run on vLLM's CPU build (no GPU assignment, no NVML).",
    )
    first_gpu: int = Field(0, ge=0, description="First GPU index handed out to instances.")
    gpu_pool: list[int] | None = Field(
        None,
        min_length=1,
        description="GPU indices handed out in order instead of first_gpu, 1, 2, …; the list "
        "wraps around, so instances may share a GPU (lower --gpu-memory-utilization then).",
    )
    stop_grace_s: float = Field(
        15.0, gt=0, description="After SIGTERM, wait this long before SIGKILL on teardown."
    )
    vocab_size: int | None = Field(
        None,
        ge=2,
        description="Token ids in generated prompts stay below this; defaults to the served "
        "model's config.json vocab_size when it is a local folder, else 32000.",
    )
    telemetry_interval_s: float = Field(
        0.1,
        ge=MIN_SAMPLE_INTERVAL_S,
        description="Utilization sampling period (NVML or psutil); 0.1 = 10 Hz (at least "
        f"{MIN_SAMPLE_INTERVAL_S:g} s: NVML itself updates utilization no faster).",
    )
    metrics_interval_s: float | None = Field(
        None,
        ge=MIN_SAMPLE_INTERVAL_S,
        description="Also scrape every instance's /metrics this often during the run "
        f"(start and end are always scraped; at least {MIN_SAMPLE_INTERVAL_S:g} s, each "
        "scrape is an HTTP request to every instance).",
    )
    router_cache_blocks: int = Field(
        100_000,
        ge=1,
        description="Prefix blocks the router remembers per instance (LRU) for cache-aware "
        "policies.",
    )
    connect_timeout_s: float = Field(
        10.0, gt=0, description="TCP connect timeout for every request to an instance."
    )
    max_connections: int = Field(
        2048, ge=1, description="Concurrent HTTP connections the load driver may open."
    )

    @field_validator("endpoints")
    @classmethod
    def _server_roots(cls, urls: list[str] | None) -> list[str] | None:
        """Each an http(s) server root with a host and a valid port: a scheme-less, `ftp:`
        or `/v1` URL ran and failed every request with exit 0."""
        from urllib.parse import urlsplit

        for i, url in enumerate(urls or []):
            try:
                parts = urlsplit(url)
                port = parts.port
            except ValueError as exc:
                raise ValueError(f"endpoint {i} {url!r}: {exc}") from None
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"endpoint {i} {url!r}: give http://HOST:PORT (the server's "
                                 "root)")  # fmt: skip
            if parts.path.rstrip("/") or parts.query:
                raise ValueError(f"endpoint {i} {url!r}: give the server's root, without "
                                 f"{parts.path!r} (the requests go to /v1/completions under "
                                 "it)")  # fmt: skip
            del port
        return urls

    @model_validator(mode="after")
    def _ray_launches(self) -> LaunchSettings:
        if self.backend == "ray" and self.endpoints:
            raise ValueError(
                "backend ray launches servers and endpoints attaches to running ones; "
                "remove one of them"
            )
        if self.backend == "ray" and self.gpu_pool is not None:
            raise ValueError("backend ray: Ray assigns the GPUs; remove gpu_pool")
        return self


def served_model_of(launch: LaunchSettings, model: object) -> str:
    """The model name vLLM serves, before `$VARS` are expanded: `served_model`, else a
    model given as a checkpoint name (`org/name`). Raises ValueError naming what is
    missing: a preset such as `llama-3.3-70b` names a shape, not weights."""
    if launch.served_model is not None:
        return launch.served_model
    if isinstance(model, str) and "/" in model:
        return model
    raise ValueError(
        "required for the cluster backend (a Hugging Face name or a local model folder); "
        f"the model preset {model!r} names no served checkpoint"
    )
