"""`summary.json` and the verdict as typed models: what the analysis of a stored run
produces and every reader (report, log, listing, sweep tables, the CLI) loads, with
save/load. Latency fields follow `config.metrics` (a test keeps the two in step).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from btb_lab.config.metrics import METRICS
from btb_lab.errors import UserError
from btb_lab.results.store import write_json

__all__ = [
    "SUMMARY",
    "CacheStats",
    "Comparison",
    "Exclusion",
    "GpuStats",
    "GuardResult",
    "PrimarySpec",
    "RequestMetrics",
    "Summary",
    "VariantSummary",
    "VariantVerdict",
    "Verdict",
    "VerdictWord",
    "WarmSpend",
]

SUMMARY = "summary.json"
VerdictWord = Literal["VALIDATED", "PARTIALLY VALIDATED", "REJECTED", "INCONCLUSIVE"]


class _Stored(BaseModel):
    """Stored analysis output: strict on read; non-finite floats are stored as null."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _finite(cls, value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return value


class RequestMetrics(_Stored):
    """Metrics of a set of request records (a variant, or one class of it)."""

    n: int
    ok: int
    ok_rate: float | None = None
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    ttft_p95: float | None = None
    ttft_p99: float | None = None
    ttft_mean: float | None = None
    tpot_p50: float | None = None
    tpot_p90: float | None = None
    tpot_p95: float | None = None
    tpot_p99: float | None = None
    tpot_mean: float | None = None
    e2e_p50: float | None = None
    e2e_p90: float | None = None
    e2e_p95: float | None = None
    e2e_p99: float | None = None
    e2e_mean: float | None = None
    # cached prompt tokens / prompt tokens of these requests, as the verdict pools them
    cache_hit_rate: float | None = None

    def value(self, metric: str) -> float | None:
        """A request-level metric by name (`ttft_p90`, `ok_rate`)."""
        if metric not in METRICS or METRICS[metric].level != "request":
            raise KeyError(metric)
        return getattr(self, metric, None)


class CacheStats(_Stored):
    """Prefix-cache hits: token hit rate, per-request hit fractions, where hits came from."""

    hit_rate: float | None = None
    mean_fraction: float | None = None
    median_fraction: float | None = None
    requests_with_hit: int = 0
    cached_tokens: int = 0
    input_tokens: int = 0
    tiers: dict[str, int] = Field(default_factory=dict)


class GpuStats(_Stored):
    """Balance of per-GPU (sim: per-instance) mean utilization."""

    imbalance: float | None = None
    std: float | None = None
    max: float | None = None
    per_instance: dict[str, float] = Field(default_factory=dict)
    # repeats in which an instance sat idle (mean 0): max / min is unbounded there, so
    # the imbalance over the repeats is undefined, not the mean of the other repeats
    idle_repeats: int = 0
    repeats: int = 0


class WarmSpend(_Stored):
    """What a variant's warming cost, from its `warm_copy` events over all repeats: RDMA
    copies, and speculative prefills with the share spent on jobs that never became a
    burst (decoys). A speculative prefill counts once per repeat, target and job, at its
    deepest (chunks extend one prefill); its seconds are the instance time its event
    spans (on the simulator, the cost model's prefill time)."""

    copies: int = 0
    copy_tokens: int = 0
    prefills: int = 0  # speculative prefill actions, every chunk counted
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decoy_prefill_tokens: int = 0
    decoy_prefill_s: float = 0.0
    decoy_max_requests: int = 0  # a job of at most this many requests counts as a decoy


class VariantSummary(_Stored):
    all: RequestMetrics
    classes: dict[str, RequestMetrics] = Field(default_factory=dict)
    # by the requests' `source` (synthetic, art, …) and by window (trace_id)
    pools: dict[str, RequestMetrics] = Field(default_factory=dict)
    windows: dict[str, RequestMetrics] = Field(default_factory=dict)
    routes: dict[str, int] = Field(default_factory=dict)
    cache: CacheStats = Field(default_factory=CacheStats)
    gpu: GpuStats = Field(default_factory=GpuStats)
    repeats: list[int] = Field(default_factory=list)
    warm: WarmSpend = Field(default_factory=WarmSpend)
    failures: dict[str, int] = Field(
        default_factory=dict, description="The 3 most frequent errors of failed requests → count."
    )

    def failure_line(self) -> str:
        """Why requests failed, for the report's Result block."""
        more = self.all.n - self.all.ok - sum(self.failures.values())
        shown = ", ".join(f'{n} × "{error}"' for error, n in self.failures.items())
        return f"Failed: {shown}" + (f", {more} with other errors" if more > 0 else "")

    def value(self, metric: str, scope: str = "all") -> float | None:
        """One metric of this variant: request metrics overall, for a class or for a pool
        (`pool:synthetic`), GPU ones over the whole variant. None when undefined (e.g. a
        class with no requests)."""
        definition = METRICS[metric]
        if definition.level == "gpu":
            value: float | None = getattr(self.gpu, definition.statistic)
            return value
        if scope == "all":
            block: RequestMetrics | None = self.all
        elif scope.startswith("pool:"):
            block = self.pools.get(scope[5:])
        else:
            block = self.classes.get(scope)
        return None if block is None else block.value(metric)


class GuardResult(_Stored):
    metric: str
    klass: str | None = None
    pool: str | None = None
    baseline: float | None = None
    value: float | None = None
    worse_by: float | None = None  # absolute for ok_rate, relative otherwise; positive = worse
    max_worse: float
    holds: bool


Outcome = Literal["holds", "straddles", "small", "noise", "reversed", "undefined"]


class Comparison(_Stored):
    """One metric, one variant against the baseline. The outcome is read off the interval
    (signs taken so that positive is the claimed direction, m the minimum effect):
    `holds` the whole interval is beyond m; `straddles` it holds both effects beyond m and
    short of it (needs more repeats); `small` it lies between 0 and m; `noise` it holds 0
    and nothing beyond m; `reversed` it lies entirely against the claim."""

    scope: str  # "all" or a class name
    pool: str | None = None  # restricted to the requests of this source
    baseline: float | None = None
    value: float | None = None
    change: float | None = None  # relative
    ci_low: float | None = None
    ci_high: float | None = None
    level: float | None = None  # confidence level of [ci_low, ci_high] (after adjustment)
    outcome: Outcome
    # the requests the metric is over: successful ones (sent ones for OK rate)
    ok_baseline: int = 0
    ok_variant: int = 0
    paired: bool = False  # the bootstrap resampled the same request ids for both variants
    method: str | None = None  # how the draws were made (analysis.bootstrap.DrawMethod)
    # one-sided bootstrap p of "not beyond the minimum effect", and Holm's adjustment of it
    p_value: float | None = None
    p_adjusted: float | None = None
    adjustment: Literal["none", "holm"] = "none"
    comparisons: int = 1  # size of the family the adjustment is over
    # per repeat: the change on that repeat's requests alone, and how many point the
    # claimed way (agree) or the other way (contradict)
    repeat_changes: list[float | None] = Field(default_factory=list)
    repeats_agree: int = 0
    repeats_contradict: int = 0

    @property
    def half_width(self) -> float | None:
        if self.ci_low is None or self.ci_high is None:
            return None
        return (self.ci_high - self.ci_low) / 2


class VariantVerdict(_Stored):
    variant: str
    word: VerdictWord
    reason: str
    primary: Comparison | None = None
    guards: list[GuardResult] = Field(default_factory=list)
    per_class: list[Comparison] = Field(default_factory=list)


class Verdict(_Stored):
    word: VerdictWord
    reason: str
    variants: dict[str, VariantVerdict] = Field(default_factory=dict)


class PrimarySpec(_Stored):
    metric: str
    klass: str | None = Field(None, alias="class")
    pool: str | None = None
    direction: Literal["decrease", "increase"]
    min_effect: float
    multiplicity: Literal["holm", "none"] = "none"
    require_all_repeats: bool = False

    model_config = ConfigDict(populate_by_name=True)


class Exclusion(_Stored):
    """Warmup / cooldown left out of metrics and verdicts (`verdict.exclude`)."""

    first_s: float = 0.0
    last_s: float = 0.0
    first_requests: int = 0
    last_requests: int = 0
    # per variant: requests left out and requests kept, over all repeats
    excluded: dict[str, int] = Field(default_factory=dict)
    kept: dict[str, int] = Field(default_factory=dict)


class Summary(_Stored):
    """`summary.json`: the analysis of one stored run."""

    hypothesis: str
    title: str
    run_id: str
    backend: str
    complete: bool
    fidelity: dict[str, Any] = Field(default_factory=dict)
    baseline: str
    primary: PrimarySpec
    verdict: Verdict
    variants: dict[str, VariantSummary] = Field(default_factory=dict)
    exclusion: Exclusion | None = None
    repeats: int | None = None  # repeats run (with `repeats: auto`, where it stopped)
    # an incomplete run: what its tables were cut to, so the variants share requests
    tables_cover: str | None = None

    def save(self, run_dir: Path) -> None:
        """Write `summary.json` atomically."""
        write_json(run_dir / SUMMARY, self.model_dump(mode="json", by_alias=True))

    @classmethod
    def load(cls, run_dir: Path) -> Summary:
        """Read a stored summary (a UserError naming the file when unreadable)."""
        path = Path(run_dir) / SUMMARY
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls.model_validate(data)
        except FileNotFoundError:
            raise UserError(f"{run_dir}: no {SUMMARY} (run `btb-lab report {run_dir}`)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"{path}: unreadable summary: {exc}") from None
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(top level)"
            raise UserError(f"{path}: not a btb-lab summary: {where}: {first['msg']}") from None
