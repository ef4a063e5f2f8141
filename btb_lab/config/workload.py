"""The `workload:` block of a hypothesis: a trace file or a generator, plus time scaling."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from btb_lab.config.base import StrictModel
from btb_lab.config.limits import MAX_BLOCK_TOKENS

__all__ = [
    "SESSION_REPLAY_TEXT",
    "GeneratorSpec",
    "RepeatVariation",
    "TraceSpec",
    "WorkloadSpec",
]


class TraceSpec(StrictModel):
    path: str = Field(description="Trace file, relative to the hypothesis file's folder.")
    format: str = Field("mooncake", description="Loader name: mooncake, bursted-art, art-chat.")
    skip_bad_rows: bool = Field(
        False, description="Count and report malformed rows instead of failing."
    )


class GeneratorSpec(StrictModel):
    kind: str = Field(description="Generator name: bursted, seed_bursty, agentic, poisson, gamma.")
    params: dict[str, Any] = Field(
        default_factory=dict, description="Generator parameters (validated by the generator)."
    )


class RepeatVariation(StrictModel):
    """How repeats of a trace replay differ (a generator already draws new requests from
    each repeat's seed). Applied to every repeat, the first included, from that repeat's
    workload seed, so repeats measure workload variance rather than determinism."""

    arrival_jitter_s: float = Field(
        0.0,
        ge=0,
        le=1e9,  # numpy's uniform draw overflows past ~9e307; 1e9 s is 31 years
        description="Move each arrival by a uniform draw in ±this many seconds (after "
        "time_scale); a session's turns keep their order. Draws before 0 shift every "
        "arrival later alike (none piles up at 0).",
    )
    resample_windows: bool = Field(
        False,
        description="Replay windows (trace_ids) drawn with replacement, as many as the "
        "trace has; a window drawn twice gets fresh request ids, and new block ids for the "
        "blocks no other window has (its copy does not find its own KV cached).",
    )


# How a report's workload line says a closed replay (open says nothing: the default).
SESSION_REPLAY_TEXT = {
    "closed": " with closed sessions (a turn is sent once its session's earlier turns finish)",
    "closed_think": " with closed sessions and think times (a turn is sent its trace gap after "
    "its session's earlier turns finish)",
}


class WorkloadSpec(StrictModel):
    trace: TraceSpec | None = Field(None, description="Replay a trace file.")
    generator: GeneratorSpec | None = Field(None, description="Generate requests.")
    requests: int | None = Field(
        None,
        ge=1,
        description="Use the first N requests in replay order: windows (trace_ids) in the "
        "order they first appear, each window's requests by arrival.",
    )
    offset: int = Field(0, ge=0, description="Skip this many requests first (replay order).")
    time_scale: float = Field(
        1.0,
        gt=0,
        description="Multiplies every inter-arrival gap: >1 calmer, <1 denser (the seed "
        "simulator's ARRIVAL_SCALE; time_scale=10 is a heavier load than 20). Arrivals are "
        "re-based so each window (trace_id) starts at 0 before scaling.",
    )
    window_gap_s: float = Field(
        0.0,
        ge=0,
        description="Idle seconds between consecutive windows (trace_ids): windows replay "
        "one after another on one timeline, never overlapping.",
    )
    block_tokens: int = Field(
        512, ge=1, le=MAX_BLOCK_TOKENS, description="Tokens per prefix-hash block."
    )
    session_replay: Literal["open", "closed", "closed_think"] = Field(
        "open",
        description="open: every request is sent at its arrival time, as the trace recorded "
        "it (a turn may go before the answer it continues, under a heavier load than the "
        "trace's). closed: a request of turn k of a session waits until every request of "
        "the session's earlier turns has finished, then goes at its arrival time or that "
        "finish, whichever is later. closed_think: it goes at that finish plus the trace's "
        "gap before it (the agent's think time; for generated agentic sessions, whose gaps "
        "are exactly that). TTFT counts from the send. Both backends.",
    )
    variation: RepeatVariation | None = Field(
        None,
        description="How repeats of a replay differ: arrival jitter and / or window "
        "resampling, drawn from each repeat's seed.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> WorkloadSpec:
        if (self.trace is None) == (self.generator is None):
            raise ValueError("give exactly one of 'trace' or 'generator'")
        return self
