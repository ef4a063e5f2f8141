"""Seeded workload generators: `bursted`, `agentic`, `poisson`, `gamma`.

Each generator has a strict pydantic Params model (unknown params are errors) and a pure
function `(params, ctx) -> list[Request]` that draws only from `numpy.random.default_rng
(ctx.seed)`; same seed, same requests. Arrival times are seconds within the window; the
loader applies `time_scale` and lays windows end to end.

Counts and token lengths are bounded (`config.limits`): a generator whose parameters
would make more than MAX_REQUESTS requests, or prompts longer than MAX_TOKENS, is refused
while validating instead of exhausting memory while generating.

This module is long because each generator's parameter model sits beside the generator
it validates, with the shared bounds, so a parameter and its use are read together.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from btb_lab.config.base import ParamsModel, StrictModel
from btb_lab.config.limits import MAX_REQUESTS, MAX_TOKENS
from btb_lab.errors import UserError
from btb_lab.records import BURST_JOB_KINDS, Request
from btb_lab.registry import Registry
from btb_lab.workload.hashing import BlockIdAllocator
from btb_lab.workload.trace_checks import check_block_tokens

if TYPE_CHECKING:  # numpy loads with the first workload drawn, not at validate time
    import numpy as np

__all__ = [
    "GENERATORS",
    "AgenticParams",
    "BurstedParams",
    "GammaParams",
    "GenContext",
    "GeneratorEntry",
    "PoissonParams",
    "check_request_count",
    "generate",
    "parse_params",
]


@dataclass(frozen=True)
class GenContext:
    """What every generator gets besides its params (a block size below 1 token is
    refused here: every generator divides prompts into blocks)."""

    seed: int
    block_tokens: int = 512
    base_dir: Path = Path(".")

    def __post_init__(self) -> None:
        check_block_tokens(self.block_tokens)


@dataclass(frozen=True)
class GeneratorEntry:
    """A registered generator: its Params model and its function."""

    params_model: type[StrictModel]
    generate: Callable[[Any, GenContext], list[Request]]
    summary: str


GENERATORS: Registry[GeneratorEntry] = Registry("workload generator")


def parse_params(kind: str, params: dict[str, Any]) -> StrictModel:
    """Validate generator params; a bad or unknown param is a `UserError` naming it."""
    entry = GENERATORS.get(kind)
    try:
        return entry.params_model.model_validate(params)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(part) for part in err["loc"]) or "params"
            problems.append(f"generator {kind!r} param {loc!r}: {err['msg']}")
        if any(err["type"] == "extra_forbidden" for err in exc.errors()):
            fields = ", ".join(sorted(entry.params_model.model_fields))
            problems.append(f"valid params for {kind!r}: {fields}")
        raise UserError("\n".join(problems)) from None


def generate(kind: str, params: dict[str, Any], ctx: GenContext) -> list[Request]:
    """Run a generator by name with unvalidated params. Arrivals that are not finite (a
    rate so small that the gaps overflow) are refused here, before anything is written."""
    import numpy as np

    entry = GENERATORS.get(kind)
    parsed = parse_params(kind, params)
    with np.errstate(all="ignore"):  # overflow is checked below, once
        requests = entry.generate(parsed, ctx)
    if not all(math.isfinite(r.arrival_s) for r in requests):
        raise UserError(
            f"workload.generator.params: {kind} arrival times are not finite numbers with "
            f"these parameters (a rate so small, or gaps so long, that they overflow): "
            f"{_shown(params)}; use other values"
        )
    return requests


def _shown(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(params.items())) or "the defaults"


# ---------------------------------------------------------------- shared helpers


def _lognormal_ints(
    rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int, size: int
) -> np.ndarray:
    import numpy as np

    values = rng.lognormal(mean=math.log(median), sigma=sigma, size=size)
    return np.clip(np.rint(values), lo, hi).astype(np.int64)


# Longest suffix a generator draws after a shared prefix (the clip of its log-normal draw).
SUFFIX_CAP_TOKENS = 1 << 20


def _suffix_cap(prefix_tokens: int) -> int:
    """The longest suffix after `prefix_tokens` that keeps a prompt within MAX_TOKENS (the
    loaders refuse longer rows); the prefix fields stop at MAX_TOKENS - 1, so it is ≥ 1."""
    return max(1, min(SUFFIX_CAP_TOKENS, MAX_TOKENS - prefix_tokens))


def _prompt_blocks(
    shared: tuple[int, ...], input_tokens: int, block_tokens: int, ids: BlockIdAllocator
) -> tuple[int, ...]:
    """Block ids of a prompt that starts with the `shared` full blocks, then its own blocks."""
    total = math.ceil(input_tokens / block_tokens)
    n_shared = min(len(shared), input_tokens // block_tokens, total)
    return shared[:n_shared] + ids.take(total - n_shared)


# ---------------------------------------------------------------- bursted


class BurstedParams(ParamsModel):
    """Bursted-ART-shaped windows: synchronized same-prefix bursts, decoys, background."""

    windows: int = Field(
        40, ge=1, le=MAX_REQUESTS, description="Synthetic windows (the seed: 10 train + 30 test)."
    )
    train_fraction: float = Field(
        0.25, ge=0, le=1, description="Share of whole windows in the train split (per source)."
    )
    split: Literal["all", "train", "test"] = Field(
        "all", description="Which whole windows to emit."
    )
    window_s: float = Field(60.0, gt=0, description="Length of one window in seconds.")
    bursts_per_window: int = Field(
        1, ge=0, le=MAX_REQUESTS, description="Burst jobs in each synthetic window."
    )
    burst_size: int = Field(500, ge=1, le=MAX_REQUESTS, description="Requests in one burst (N).")
    burst_sizes: list[Annotated[int, Field(ge=1, le=MAX_REQUESTS)]] | None = Field(
        None,
        min_length=1,
        max_length=10_000,
        description="Burst sizes to cycle through instead of one burst_size: the k-th burst "
        "of the run (window by window) has burst_sizes[k mod len] requests.",
    )
    prefix_tokens: int = Field(
        65536,
        ge=1,
        le=MAX_TOKENS - 1,
        description="Prefix shared by a burst (P), tokens (a prompt is at most "
        f"{MAX_TOKENS:,} tokens with its suffix).",
    )
    burst_spread_s: float = Field(
        8.0,
        ge=0,
        description="A burst's arrivals fall uniformly within this many seconds (W of the "
        "burst; ≤ 10 keeps the whole burst inside the audit's deep window).",
    )
    suffix_tokens_median: float = Field(
        1024,
        gt=0,
        le=MAX_TOKENS,
        description="Median per-request suffix after the shared prefix, tokens.",
    )
    suffix_sigma: float = Field(0.5, ge=0, le=10, description="Log-normal sigma of suffix lengths.")
    output_tokens_median: float = Field(
        256, gt=0, le=MAX_TOKENS, description="Median output length, tokens."
    )
    output_sigma: float = Field(0.7, ge=0, le=10, description="Log-normal sigma of output lengths.")
    max_output_tokens: int = Field(
        4096, ge=1, le=MAX_TOKENS, description="Output length cap, tokens."
    )
    decoys_per_window: int = Field(
        4,
        ge=0,
        le=MAX_REQUESTS,
        description="Decoy jobs per window: same prefix length, too few repeats.",
    )
    decoy_repeats: int = Field(
        3, ge=1, le=MAX_REQUESTS, description="Requests per decoy job, spread over the window."
    )
    background_rate_per_s: float = Field(
        2.0, ge=0, description="Poisson rate of unrelated background requests (0 = none)."
    )
    background_tokens_median: float = Field(
        3000, gt=0, le=MAX_TOKENS, description="Median background prompt length, tokens."
    )
    background_prefixes: int = Field(
        8,
        ge=1,
        le=MAX_REQUESTS,
        description="Distinct short system prompts shared by background requests.",
    )
    background_prefix_tokens: int = Field(
        2048,
        ge=0,
        le=MAX_TOKENS - 1,
        description="Length of each background system prompt, tokens.",
    )
    real_windows: int = Field(
        0, ge=0, le=MAX_REQUESTS, description="Plain windows cut from `real_trace` (source 'art')."
    )
    real_trace: str | None = Field(
        None, description="Trace file for plain windows, relative to the hypothesis folder."
    )
    real_trace_format: str = Field("mooncake", description="Format of `real_trace`.")
    hinted_bursts: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of burst jobs whose requests carry a job kind in their metadata "
        "(labeling, batch_extraction or subagent_fanout); the others carry none.",
    )
    hinted_decoys: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of decoy jobs whose requests carry such a job kind too: hints "
        "that announce a burst that never comes.",
    )

    @model_validator(mode="after")
    def _check(self) -> BurstedParams:
        if self.burst_spread_s > self.window_s:
            raise ValueError("burst_spread_s must not exceed window_s")
        if self.burst_sizes is not None and min(self.burst_sizes) < 1:
            raise ValueError("burst_sizes must all be at least 1")
        if self.bursts_per_window and self.decoy_repeats >= self.smallest_burst:
            raise ValueError("decoy_repeats must be smaller than burst_size (else it is a burst)")
        if self.real_windows and not self.real_trace:
            raise ValueError("real_windows needs real_trace")
        size = max(self.burst_sizes) if self.burst_sizes else self.burst_size
        per_window = (
            self.bursts_per_window * size
            + self.decoys_per_window * self.decoy_repeats
            + self.background_rate_per_s * self.window_s
        )
        check_request_count(self.windows * per_window, "windows × requests per window")
        return self

    @property
    def smallest_burst(self) -> int:
        """The fewest requests any burst has."""
        return min(self.burst_sizes) if self.burst_sizes is not None else self.burst_size

    def size_of_burst(self, k: int) -> int:
        """Requests in the k-th burst of the run (0-based, window by window)."""
        if self.burst_sizes is None:
            return self.burst_size
        return self.burst_sizes[k % len(self.burst_sizes)]


def check_request_count(expected: float, what: str) -> None:
    """Refuse generator parameters that make more than MAX_REQUESTS requests."""
    if expected > MAX_REQUESTS:
        raise ValueError(
            f"these parameters make about {expected:,.0f} requests ({what}); the limit is "
            f"{MAX_REQUESTS:,} per run"
        )


def _split_windows(
    rng: np.random.Generator, count: int, train_fraction: float
) -> list[Literal["train", "test"]]:
    """Whole-window split: a seeded permutation, the first share of it is train."""
    n_train = round(count * train_fraction)
    order = rng.permutation(count)
    labels: list[Literal["train", "test"]] = ["test"] * count
    for index in order[:n_train]:
        labels[int(index)] = "train"
    return labels


def _real_windows(
    p: BurstedParams, ctx: GenContext, rng: np.random.Generator
) -> list[list[Request]]:
    """Plain windows of `window_s` cut from a real trace, chosen by the seeded rng."""
    from btb_lab.workload.formats import load_trace

    assert p.real_trace is not None
    path = Path(p.real_trace)
    if not path.is_absolute():
        path = ctx.base_dir / path
    trace = load_trace(path, p.real_trace_format, block_tokens=ctx.block_tokens)
    if not trace.requests:
        raise UserError(f"{path}: trace has no requests")
    start_s = min(r.arrival_s for r in trace.requests)
    chunks: dict[int, list[Request]] = {}
    for request in trace.requests:
        chunks.setdefault(int((request.arrival_s - start_s) // p.window_s), []).append(request)
    keys = sorted(chunks)
    if p.real_windows > len(keys):
        raise UserError(
            f"{path}: asked for {p.real_windows} windows of {p.window_s:g} s, trace has {len(keys)}"
        )
    chosen = sorted(int(k) for k in rng.choice(keys, size=p.real_windows, replace=False))
    return [chunks[k] for k in chosen]


def _add(
    rows: list[Request],
    ids: BlockIdAllocator,
    trace_id: str,
    kind: str,
    arrival_s: float,
    shared: tuple[int, ...],
    input_tokens: int,
    output_tokens: int,
    group_id: str | None,
    block_tokens: int,
    job_kind: str | None = None,
) -> None:
    """Append one synthetic request of a bursted window."""
    rows.append(
        Request(
            request_id=f"{trace_id}-{kind}-{len(rows):05d}",
            arrival_s=float(arrival_s),
            input_tokens=int(input_tokens),
            output_tokens=int(output_tokens),
            block_hashes=_prompt_blocks(shared, int(input_tokens), block_tokens, ids),
            block_tokens=block_tokens,
            group_id=group_id,
            trace_id=trace_id,
            source="synthetic",
            job_kind=job_kind,
        )
    )


def _job_kind(hints: np.random.Generator, share: float) -> str | None:
    """The job kind one job's requests carry: with probability `share` one of the burst
    kinds, else none. Drawn from the hint stream only, so the requests themselves do not
    depend on the hint settings."""
    hinted = hints.random() < share
    kind = BURST_JOB_KINDS[int(hints.integers(0, len(BURST_JOB_KINDS)))]
    return kind if hinted else None


def generate_bursted(p: BurstedParams, ctx: GenContext) -> list[Request]:
    """Windows of the seed's Bursted-ART shape (see `BurstedParams`)."""
    import numpy as np

    rng = np.random.default_rng(ctx.seed)
    hints = np.random.default_rng([ctx.seed, 0x6A6F62])  # job kinds: a stream of their own
    ids = BlockIdAllocator(f"bursted:{ctx.seed}")
    bt = ctx.block_tokens
    splits = _split_windows(rng, p.windows, p.train_fraction)
    background_prefixes = [
        ids.take(p.background_prefix_tokens // bt) for _ in range(p.background_prefixes)
    ]
    out: list[Request] = []
    for w in range(p.windows):
        trace_id = f"{splits[w]}-w{w:03d}"
        rows: list[Request] = []

        for b in range(p.bursts_per_window):
            kind = _job_kind(hints, p.hinted_bursts)
            size = p.size_of_burst(w * p.bursts_per_window + b)
            prefix = ids.take(p.prefix_tokens // bt)
            start_s = rng.uniform(0, p.window_s - p.burst_spread_s)
            arrivals = np.sort(start_s + rng.uniform(0, p.burst_spread_s, size))
            suffixes = _lognormal_ints(
                rng, p.suffix_tokens_median, p.suffix_sigma, 1, _suffix_cap(p.prefix_tokens), size
            )
            outputs = _lognormal_ints(
                rng, p.output_tokens_median, p.output_sigma, 1, p.max_output_tokens, size
            )
            for t, s, o in zip(arrivals, suffixes, outputs, strict=True):
                _add(
                    rows,
                    ids,
                    trace_id,
                    "burst",
                    t,
                    prefix,
                    p.prefix_tokens + s,
                    o,
                    f"{trace_id}-burst{b}",
                    bt,
                    kind,
                )
        for d in range(p.decoys_per_window):
            kind = _job_kind(hints, p.hinted_decoys)
            prefix = ids.take(p.prefix_tokens // bt)
            arrivals = np.sort(rng.uniform(0, p.window_s, p.decoy_repeats))
            suffixes = _lognormal_ints(
                rng,
                p.suffix_tokens_median,
                p.suffix_sigma,
                1,
                _suffix_cap(p.prefix_tokens),
                p.decoy_repeats,
            )
            outputs = _lognormal_ints(
                rng,
                p.output_tokens_median,
                p.output_sigma,
                1,
                p.max_output_tokens,
                p.decoy_repeats,
            )
            for t, s, o in zip(arrivals, suffixes, outputs, strict=True):
                _add(
                    rows,
                    ids,
                    trace_id,
                    "decoy",
                    t,
                    prefix,
                    p.prefix_tokens + s,
                    o,
                    f"{trace_id}-decoy{d}",
                    bt,
                    kind,
                )
        n_background = int(rng.poisson(p.background_rate_per_s * p.window_s))
        arrivals = np.sort(rng.uniform(0, p.window_s, n_background))
        lengths = _lognormal_ints(
            rng,
            p.background_tokens_median,
            0.8,
            1,
            _suffix_cap(p.background_prefix_tokens),
            n_background,
        )
        outputs = _lognormal_ints(
            rng, p.output_tokens_median, p.output_sigma, 1, p.max_output_tokens, n_background
        )
        which = rng.integers(0, p.background_prefixes, n_background)
        for t, n, o, k in zip(arrivals, lengths, outputs, which, strict=True):
            shared = background_prefixes[int(k)]
            _add(
                rows,
                ids,
                trace_id,
                "bg",
                t,
                shared,
                p.background_prefix_tokens + n,
                o,
                f"system{int(k)}",
                bt,
            )
        rows.sort(key=lambda r: (r.arrival_s, r.request_id))
        if p.split in ("all", splits[w]):
            out.extend(rows)
    if p.real_windows:
        real_splits = _split_windows(rng, p.real_windows, p.train_fraction)
        for index, window in enumerate(_real_windows(p, ctx, rng)):
            trace_id = f"{real_splits[index]}-art{index:03d}"
            if p.split not in ("all", real_splits[index]):
                continue
            for row_no, request in enumerate(window):
                out.append(
                    Request(
                        request_id=f"{trace_id}-{row_no:05d}",
                        arrival_s=request.arrival_s,
                        input_tokens=request.input_tokens,
                        output_tokens=request.output_tokens,
                        block_hashes=request.block_hashes,
                        block_tokens=bt,
                        session_id=request.session_id,
                        group_id=request.group_id,
                        trace_id=trace_id,
                        source="art",
                        turn=request.turn,
                        job_kind=request.job_kind,
                    )
                )
    return out


# ---------------------------------------------------------------- agentic


class AgenticParams(ParamsModel):
    """Multi-turn agent sessions: each turn re-sends the whole context plus new tokens."""

    sessions: int = Field(
        80,
        ge=1,
        le=MAX_REQUESTS,
        description="Number of sessions (sessions × mean turns at most 10,000,000 requests).",
    )
    session_rate_per_s: float = Field(0.2, gt=0, description="Poisson rate of session starts.")
    turns_mean: float = Field(2.5, ge=1, description="Mean turns per session (geometric).")
    max_turns: int = Field(12, ge=1, le=MAX_REQUESTS, description="Most turns in one session.")
    think_time_s_mean: float = Field(
        15.0, ge=0, description="Mean gap between a turn's arrival and the next (exponential)."
    )
    system_prompts: int = Field(
        4, ge=1, le=MAX_REQUESTS, description="Distinct agent system prompts."
    )
    system_prompt_tokens: int = Field(
        2048, ge=0, le=MAX_TOKENS, description="System prompt length, tokens."
    )
    first_turn_tokens_median: float = Field(
        17000,
        gt=0,
        le=MAX_TOKENS,
        description="Median first-turn task context after the system prompt.",
    )
    first_turn_sigma: float = Field(
        0.8, ge=0, le=10, description="Log-normal sigma of first turns."
    )
    growth_tokens_median: float = Field(
        1200,
        gt=0,
        le=MAX_TOKENS,
        description="Median new tokens a later turn adds (tool output, user text).",
    )
    growth_sigma: float = Field(1.0, ge=0, le=10, description="Log-normal sigma of context growth.")
    large_addition_prob: float = Field(
        0.05, ge=0, le=1, description="Chance a later turn adds a large document instead."
    )
    large_addition_tokens_median: float = Field(
        24000, gt=0, le=MAX_TOKENS, description="Median size of such a large addition, tokens."
    )
    output_tokens_median: float = Field(
        200, gt=0, le=MAX_TOKENS, description="Median output length, tokens."
    )
    output_sigma: float = Field(1.0, ge=0, le=10, description="Log-normal sigma of output lengths.")
    max_output_tokens: int = Field(
        4096, ge=1, le=MAX_TOKENS, description="Output length cap, tokens."
    )
    max_context_tokens: int = Field(
        131072,
        ge=1,
        le=MAX_TOKENS,
        description="A session ends before its context would exceed this.",
    )

    @model_validator(mode="after")
    def _bounded(self) -> AgenticParams:
        turns = min(float(self.max_turns), self.turns_mean)
        check_request_count(self.sessions * turns, "sessions × mean turns")
        return self


def generate_agentic(p: AgenticParams, ctx: GenContext) -> list[Request]:
    """Agentic sessions whose HEAVY requests are mostly cold first turns (elastic-prefill log).

    A later turn's prompt is the previous prompt, the previous output and the new tokens,
    so it reuses every full block of the previous prompt; only an occasional large
    addition makes a later turn both long and mostly uncached.
    """
    import numpy as np

    rng = np.random.default_rng(ctx.seed)
    ids = BlockIdAllocator(f"agentic:{ctx.seed}")
    bt = ctx.block_tokens
    system_blocks = [ids.take(p.system_prompt_tokens // bt) for _ in range(p.system_prompts)]
    starts_s = np.cumsum(rng.exponential(1.0 / p.session_rate_per_s, p.sessions))
    starts_s -= starts_s[0]
    out: list[Request] = []
    for s in range(p.sessions):
        agent = int(rng.integers(0, p.system_prompts))
        turns = min(p.max_turns, int(rng.geometric(1.0 / p.turns_mean)))
        first = int(
            _lognormal_ints(rng, p.first_turn_tokens_median, p.first_turn_sigma, 1, 1 << 20, 1)[0]
        )
        input_tokens = min(p.system_prompt_tokens + first, p.max_context_tokens)
        blocks = _prompt_blocks(system_blocks[agent], input_tokens, bt, ids)
        arrival_s = float(starts_s[s])
        for turn in range(1, turns + 1):
            output_tokens = int(
                _lognormal_ints(
                    rng, p.output_tokens_median, p.output_sigma, 1, p.max_output_tokens, 1
                )[0]
            )
            out.append(
                Request(
                    request_id=f"s{s:04d}-t{turn:02d}",
                    arrival_s=arrival_s,
                    input_tokens=input_tokens,
                    output_tokens=output_tokens,
                    block_hashes=blocks,
                    block_tokens=bt,
                    session_id=f"s{s:04d}",
                    group_id=f"agent{agent}",
                    trace_id="agentic",
                    source="synthetic",
                    turn=turn,
                )
            )
            if rng.random() < p.large_addition_prob:
                median, sigma = p.large_addition_tokens_median, p.growth_sigma
            else:
                median, sigma = p.growth_tokens_median, p.growth_sigma
            added = int(_lognormal_ints(rng, median, sigma, 1, 1 << 20, 1)[0])
            next_tokens = input_tokens + output_tokens + added
            if next_tokens > p.max_context_tokens:
                break
            # Full blocks of this prompt stay identical; the partial tail block changes.
            blocks = _prompt_blocks(blocks[: input_tokens // bt], next_tokens, bt, ids)
            input_tokens = next_tokens
            arrival_s += float(rng.exponential(p.think_time_s_mean)) if p.think_time_s_mean else 0
    # ties (no think time) by session, then turn as a number: by the id, turn 100 (`t100`)
    # sorted before turn 11, and the loader refused the file as out of order
    out.sort(key=lambda r: (r.arrival_s, r.session_id or "", r.turn))
    return out


# ---------------------------------------------------------------- poisson / gamma


class PoissonParams(ParamsModel):
    """Poisson arrivals over synthetic prompts that share a few popular prefixes."""

    requests: int = Field(
        1000,
        ge=1,
        le=MAX_REQUESTS,
        description="Number of requests (at most MAX_REQUESTS = 10,000,000 per run, ten times "
        "the one-million-request simulator benchmark).",
    )
    rate_per_s: float = Field(5.0, gt=0, description="Mean arrival rate, requests per second.")
    prefixes: int = Field(16, ge=1, le=MAX_REQUESTS, description="Distinct shared prefixes.")
    prefix_tokens: int = Field(
        4096,
        ge=0,
        le=MAX_TOKENS - 1,
        description="Length of each shared prefix, tokens (a prompt is at most "
        f"{MAX_TOKENS:,} tokens with its suffix).",
    )
    prefix_zipf: float = Field(
        1.1, ge=0, description="Zipf exponent of prefix popularity (0 = uniform)."
    )
    shared_fraction: float = Field(
        0.8, ge=0, le=1, description="Share of requests that start with a shared prefix."
    )
    suffix_tokens_median: float = Field(
        512, gt=0, le=MAX_TOKENS, description="Median own suffix, tokens."
    )
    suffix_sigma: float = Field(0.8, ge=0, le=10, description="Log-normal sigma of suffix lengths.")
    output_tokens_median: float = Field(
        256, gt=0, le=MAX_TOKENS, description="Median output length, tokens."
    )
    output_sigma: float = Field(0.7, ge=0, le=10, description="Log-normal sigma of output lengths.")
    max_output_tokens: int = Field(
        4096, ge=1, le=MAX_TOKENS, description="Output length cap, tokens."
    )


class GammaParams(PoissonParams):
    """Gamma-renewal arrivals: shape < 1 is burstier than Poisson (CV = 1/sqrt(shape))."""

    shape: float = Field(0.25, gt=0, description="Gamma shape of inter-arrival gaps (1 = Poisson).")


def _shared_prefix_requests(
    p: PoissonParams, ctx: GenContext, gaps_s: np.ndarray, rng: np.random.Generator, kind: str
) -> list[Request]:
    import numpy as np

    ids = BlockIdAllocator(f"{kind}:{ctx.seed}")
    bt = ctx.block_tokens
    prefixes = [ids.take(p.prefix_tokens // bt) for _ in range(p.prefixes)]
    weights = 1.0 / np.arange(1, p.prefixes + 1, dtype=float) ** p.prefix_zipf
    weights /= weights.sum()
    arrivals = np.concatenate([[0.0], np.cumsum(gaps_s[1:])])
    which = rng.choice(p.prefixes, size=p.requests, p=weights)
    shared = rng.random(p.requests) < p.shared_fraction
    suffixes = _lognormal_ints(
        rng, p.suffix_tokens_median, p.suffix_sigma, 1, _suffix_cap(p.prefix_tokens), p.requests
    )
    outputs = _lognormal_ints(
        rng, p.output_tokens_median, p.output_sigma, 1, p.max_output_tokens, p.requests
    )
    out = []
    for i in range(p.requests):
        prefix = prefixes[int(which[i])] if shared[i] else ()
        input_tokens = (p.prefix_tokens if shared[i] else 0) + int(suffixes[i])
        out.append(
            Request(
                request_id=f"{kind}-{i:06d}",
                arrival_s=float(arrivals[i]),
                input_tokens=input_tokens,
                output_tokens=int(outputs[i]),
                block_hashes=_prompt_blocks(prefix, input_tokens, bt, ids),
                block_tokens=bt,
                group_id=f"prefix{int(which[i])}" if shared[i] else None,
                trace_id=kind,
                source="synthetic",
            )
        )
    return out


def generate_poisson(p: PoissonParams, ctx: GenContext) -> list[Request]:
    """Exponential inter-arrival gaps at `rate_per_s`."""
    import numpy as np

    rng = np.random.default_rng(ctx.seed)
    gaps_s = rng.exponential(1.0 / p.rate_per_s, p.requests)
    return _shared_prefix_requests(p, ctx, gaps_s, rng, "poisson")


def generate_gamma(p: GammaParams, ctx: GenContext) -> list[Request]:
    """Gamma inter-arrival gaps with mean 1/rate_per_s and the given shape."""
    import numpy as np

    rng = np.random.default_rng(ctx.seed)
    gaps_s = rng.gamma(p.shape, 1.0 / (p.rate_per_s * p.shape), p.requests)
    return _shared_prefix_requests(p, ctx, gaps_s, rng, "gamma")


GENERATORS.add(
    "bursted",
    GeneratorEntry(BurstedParams, generate_bursted, "windows with same-prefix bursts + decoys"),
)
GENERATORS.add(
    "agentic",
    GeneratorEntry(AgenticParams, generate_agentic, "multi-turn agent sessions"),
)
GENERATORS.add(
    "poisson",
    GeneratorEntry(PoissonParams, generate_poisson, "Poisson arrivals, shared prefixes"),
)
GENERATORS.add(
    "gamma",
    GeneratorEntry(GammaParams, generate_gamma, "gamma (bursty) arrivals, shared prefixes"),
)
