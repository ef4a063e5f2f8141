"""The BTB seed's synthetic Bursted-ART windows (`seed_bursty`), exactly as the seed's
dataset generator shapes them (SEED-SIMULATOR.md, "The synthetic (bursty) windows"):

- per window, `bursts` jobs of `burst_size` requests; job j starts at `first_burst_s` +
  j × `burst_spacing_s` (± a uniform `start_jitter_s`, never before 0) and its arrivals are
  evenly spaced over `burst_window_s` (start + window × i / (size − 1)), so neighbouring
  bursts overlap;
- every burst request is the job's shared prefix (`prefix_tokens`, whole blocks) plus its
  own suffix blocks (`suffix_tokens`), prompt length = blocks × block_tokens, and
  `output_tokens` of output (1 in the seed);
- `decoys` single-request jobs with their own prefix, each at a uniform time between
  `first_burst_s` − `decoy_lead_s` and the end of the last burst's slot
  (`first_burst_s` + `bursts` × `burst_spacing_s`): 14–340 s with the defaults, so a
  detector that fires on any repeat is punished;
- rows ordered by (arrival, request id) within the window; a job's requests share its
  `group_id` and have no session (they are not one conversation's turns).

The defaults are the seed's: 8 × 500 + 120 decoys = 4,120 rows per window, a 65,536-token
prefix + one 256-token block, block_tokens 256 (set `workload.block_tokens: 256`).
Randomness (jitters, decoy times) comes from `numpy.random.default_rng(seed)`; block ids
from a namespaced counter (no hash per block), so equal seeds give equal windows.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import Field, model_validator

from btb_lab.config.base import ParamsModel
from btb_lab.config.limits import MAX_REQUESTS, MAX_TOKENS
from btb_lab.errors import UserError
from btb_lab.records import Request
from btb_lab.workload.generators import (
    GENERATORS,
    GenContext,
    GeneratorEntry,
    check_request_count,
)
from btb_lab.workload.hashing import BlockIdAllocator

if TYPE_CHECKING:  # numpy loads with the first workload drawn, not at validate time
    import numpy as np

__all__ = ["SeedBurstyParams", "generate_seed_bursty"]


class SeedBurstyParams(ParamsModel):
    """The seed's synthetic window shape; every default is the seed's."""

    windows: int = Field(
        15,
        ge=1,
        le=10_000,
        description="Synthetic windows (the seed's test split: 15; windows × (bursts × "
        f"burst_size + decoys) at most {MAX_REQUESTS:,} requests).",
    )
    bursts: int = Field(8, ge=0, le=1_000, description="Burst jobs per window.")
    burst_size: int = Field(500, ge=1, le=100_000, description="Requests per burst job.")
    first_burst_s: float = Field(20.0, ge=0, description="Start of the first burst, seconds.")
    burst_spacing_s: float = Field(40.0, ge=0, description="Seconds between burst starts.")
    start_jitter_s: float = Field(
        2.0, ge=0, description="Each burst start moves by a uniform ± this many seconds."
    )
    burst_window_s: float = Field(
        60.0, ge=0, description="A burst's arrivals are evenly spaced over this many seconds."
    )
    prefix_tokens: int = Field(
        65_536, ge=1, le=MAX_TOKENS, description="Shared prefix of a job, tokens (whole blocks)."
    )
    suffix_tokens: int = Field(
        256, ge=0, le=MAX_TOKENS, description="Each request's own tokens after the prefix."
    )
    output_tokens: int = Field(1, ge=1, le=1_000_000, description="Output tokens per request.")
    decoys: int = Field(120, ge=0, le=100_000, description="Single-request decoy jobs per window.")
    decoy_lead_s: float = Field(
        6.0, ge=0, description="Decoys may start this long before the first burst."
    )

    @model_validator(mode="after")
    def _bounded(self) -> SeedBurstyParams:
        per_window = self.bursts * self.burst_size + self.decoys
        check_request_count(self.windows * per_window, "windows × requests per window")
        if self.prefix_tokens + self.suffix_tokens > MAX_TOKENS:
            raise ValueError(
                f"prefix_tokens + suffix_tokens is {self.prefix_tokens + self.suffix_tokens:,} "
                f"tokens; a prompt is at most {MAX_TOKENS:,}"
            )
        return self


def generate_seed_bursty(p: SeedBurstyParams, ctx: GenContext) -> list[Request]:
    import numpy as np

    rng = np.random.default_rng(ctx.seed)
    out: list[Request] = []
    for w in range(p.windows):
        out.extend(_window(p, ctx, f"synthetic_{w:05d}", rng))
    return out


def _window(
    p: SeedBurstyParams, ctx: GenContext, trace_id: str, rng: np.random.Generator
) -> list[Request]:
    bt = ctx.block_tokens
    prefix_blocks = math.ceil(p.prefix_tokens / bt)
    suffix_blocks = math.ceil(p.suffix_tokens / bt)
    input_tokens = (prefix_blocks + suffix_blocks) * bt
    if input_tokens > MAX_TOKENS:  # whole blocks can round a prompt past the limit
        raise UserError(
            f"generator 'seed_bursty': prefix_tokens and suffix_tokens in whole blocks of {bt} "
            f"tokens make {input_tokens:,}-token prompts, more than the limit of {MAX_TOKENS:,}"
        )
    ids = BlockIdAllocator(f"seed_bursty:{ctx.seed}:{trace_id}")
    jobs: list[tuple[str, list[float]]] = []
    jitters = rng.uniform(-p.start_jitter_s, p.start_jitter_s, p.bursts)
    for j in range(p.bursts):
        start = max(0.0, p.first_burst_s + j * p.burst_spacing_s + float(jitters[j]))
        n = p.burst_size
        step = p.burst_window_s / (n - 1) if n > 1 else 0.0
        jobs.append((f"{trace_id}:burst:{j}", [start + step * i for i in range(n)]))
    end_s = p.first_burst_s + max(1, p.bursts) * p.burst_spacing_s
    low_s = max(0.0, p.first_burst_s - p.decoy_lead_s)
    for j, start in enumerate(rng.uniform(low_s, end_s, p.decoys)):
        jobs.append((f"{trace_id}:decoy:{j}", [float(start)]))
    rows: list[Request] = []
    for group_id, arrivals in jobs:
        prefix = ids.take(prefix_blocks)
        for i, arrival_s in enumerate(arrivals):
            rows.append(
                Request(
                    request_id=f"{group_id}:r{i}",
                    arrival_s=arrival_s,
                    input_tokens=input_tokens,
                    output_tokens=p.output_tokens,
                    block_hashes=prefix + ids.take(suffix_blocks),
                    block_tokens=bt,
                    # a job of independent requests, not one session (as `bursted`): a
                    # session would make the audit see one requester, and a closed
                    # replay or a session-aware policy treat 500 requests as turns
                    group_id=group_id,
                    trace_id=trace_id,
                    source="synthetic",
                )
            )
    rows.sort(key=lambda r: (r.arrival_s, r.request_id))
    return rows


GENERATORS.add(
    "seed_bursty",
    GeneratorEntry(
        SeedBurstyParams, generate_seed_bursty, "the BTB seed's synthetic Bursted-ART windows"
    ),
)
