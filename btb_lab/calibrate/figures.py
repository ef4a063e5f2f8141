"""Fitting an engine profile to published figures where no engine can be measured: a
seed's prefill rate and one TPOT percentile of its baseline run.

Two figures fix two numbers. The prefill rate is the profile's cost per uncached prompt
token, exactly (cached tokens free, no fixed or attention term: the seed's own cost
model). The TPOT percentile fixes one scale of the decode step: the roofline's step
(active weights plus every context token's KV read at HBM bandwidth × MBU) times a factor,
solved by bisection against simulator runs of the baseline variant until their pooled TPOT
percentile reproduces the figure. The shape of the decode step (its split between the
fixed, per-sequence and per-context terms) is the roofline's, not fitted: one figure cannot
tell them apart. Workloads held out of the fit give the figure's residual on draws the fit
did not see.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from btb_lab.config.metrics import METRICS
from btb_lab.config.variants import resolve_variant
from btb_lab.errors import UserError
from btb_lab.hypothesis.loader import load_hypothesis
from btb_lab.model.costmodel import build_cost_model
from btb_lab.model.profile import (
    DecodeFit,
    EngineProfile,
    FitQuality,
    PrefillFit,
    ProfileCostModel,
)
from btb_lab.policies.base import build_policy
from btb_lab.records import Request, RequestRecord, derive_timings
from btb_lab.runner import derive_seed
from btb_lab.sim.backend import run_replay
from btb_lab.workload.loader import load_requests

__all__ = [
    "FigureFit",
    "PublishedFigures",
    "figures_profile",
    "fit_to_figures",
    "latency_percentile",
    "solve_scale",
    "tpot_percentile",
]


@dataclass(frozen=True)
class PublishedFigures:
    """The figures a profile is fitted to, and where they come from."""

    prefill_tokens_per_s: float  # uncached prompt tokens per second; cached tokens free
    tpot_s: float  # the baseline run's TPOT at `tpot_percentile`
    tpot_percentile: float = 90.0
    source: str = "published figures"  # e.g. "the elastic-prefill seed log"
    baseline: str = "the baseline run"  # which run the TPOT figure is of, in words
    # other figures of the same baseline run, not fitted: shown beside the fitted
    # simulator's values as a check (metric name → seconds), e.g. {"ttft_p50": 1.075}
    checks: dict[str, float] = field(default_factory=dict)


@dataclass
class FigureFit:
    """A fitted profile and how it was found."""

    profile: EngineProfile
    decode_scale: float  # the decode step is this × the roofline's
    tpot_fit_s: float  # the pooled TPOT percentile on the fitted workloads
    tpot_holdout_s: float | None  # the same on the held-out workloads
    evaluations: list[tuple[float, float]]  # (scale, TPOT percentile) of every try


_TIMING_FIELDS = ("sent_s", "first_token_s", "finish_s", "ok", "output_tokens")


def latency_percentile(records: Sequence[RequestRecord], column: str, percentile: float) -> float:
    """A latency percentile of records as the analysis computes it: the latencies of
    `derive_timings` (TPOT only for ok requests with more than one output token), NaNs
    dropped, numpy's linear percentile."""
    import pandas as pd

    frame = pd.DataFrame({f: [getattr(r, f) for r in records] for f in _TIMING_FIELDS})
    values = derive_timings(frame)[column].to_numpy(dtype=float)
    values = values[~np.isnan(values)]
    if values.size == 0:
        raise UserError(f"no request has a {column}: nothing to fit to")
    return float(np.percentile(values, percentile))


def tpot_percentile(records: Sequence[RequestRecord], percentile: float) -> float:
    """A TPOT percentile of records as the analysis computes it."""
    return latency_percentile(records, "tpot_s", percentile)


def solve_scale(
    value_of: Callable[[float], float],
    target: float,
    *,
    lo: float = 1.0,
    rel_tol: float = 1e-4,
    max_evals: int = 60,
) -> tuple[float, float, list[tuple[float, float]]]:
    """The scale `s ≥ lo` at which `value_of(s)` (increasing in s) meets `target`: a
    bracket grown by doubling, then bisection in log space until the value is within
    `rel_tol` of the target or the bracket is below float resolution. Returns (scale,
    value there, every (scale, value) tried). A target below `value_of(lo)` is an error:
    no scale ≥ lo reaches it."""
    tried: list[tuple[float, float]] = []

    def at(s: float) -> float:
        v = value_of(s)
        tried.append((s, v))
        return v

    def done(v: float) -> bool:
        return abs(v - target) <= rel_tol * target

    v_lo = at(lo)
    if done(v_lo):
        return lo, v_lo, tried
    if v_lo > target:
        raise UserError(
            f"the target {target:g} is below the value at scale {lo:g} ({v_lo:g}): no scale "
            f"≥ {lo:g} reaches it"
        )
    hi = lo
    v_hi = v_lo
    while v_hi < target:
        if len(tried) >= max_evals:
            raise UserError(f"no scale up to {hi:g} reaches the target {target:g}")
        lo, v_lo = hi, v_hi
        hi *= 2.0
        v_hi = at(hi)
    best = min(((lo, v_lo), (hi, v_hi)), key=lambda sv: abs(sv[1] - target))
    while not done(best[1]) and len(tried) < max_evals and hi / lo > 1 + 1e-12:
        mid = math.sqrt(lo * hi)
        v_mid = at(mid)
        if abs(v_mid - target) <= abs(best[1] - target):  # ties: the tighter bracket
            best = (mid, v_mid)
        if v_mid < target:
            lo = mid
        else:
            hi = mid
    return best[0], best[1], tried


def figures_profile(
    name: str,
    figures: PublishedFigures,
    *,
    decode_step_s: float,
    decode_context_token_s: float,
    scale: float,
) -> EngineProfile:
    """The profile for one decode scale: prefill at the figure's rate exactly, and the
    roofline's decode step (`decode_step_s` + `decode_context_token_s` per context token)
    times `scale`."""
    return EngineProfile(
        name=name,
        fitted_to=f"{figures.source}: prefill {figures.prefill_tokens_per_s:,.0f} uncached "
        f"tokens/s; TPOT{figures.tpot_percentile:g} {figures.tpot_s:g} s of {figures.baseline}",
        prefill=PrefillFit(
            fixed_s=0.0,
            per_token_s=1.0 / figures.prefill_tokens_per_s,
            fitted_to=f"{figures.source}: uncached input tokens / "
            f"{figures.prefill_tokens_per_s:,.0f} per second, cached tokens free",
        ),
        decode=DecodeFit(
            fixed_s=decode_step_s * scale,
            per_context_token_s=decode_context_token_s * scale,
            fitted_to=f"{figures.source}: TPOT{figures.tpot_percentile:g} "
            f"{figures.tpot_s:g} s of {figures.baseline} (the roofline's decode step × "
            f"{scale:.4g})",
        ),
    )


class _Baseline:
    """The run a figure is of: a variant of a hypothesis, its roofline cost model and the
    workloads of its repeats as `btb-lab run` draws them (the same seeds), replayable
    under any profile."""

    def __init__(self, hypothesis_path: Path, variant: str, repeats: int) -> None:
        loaded = load_hypothesis(hypothesis_path)
        hyp = loaded.hypothesis
        if variant not in hyp.variants:
            raise UserError(
                f"{hypothesis_path}: unknown variant {variant!r}; variants: "
                + ", ".join(hyp.variants)
            )
        resolved = resolve_variant(hyp, variant)
        roofline_costs = resolved.costs.model_copy(update={"model": "roofline"})
        self.hypothesis = hyp
        self.variant = variant
        self.resolved = resolved
        self.roofline = build_cost_model(
            resolved.model_copy(update={"costs": roofline_costs}), loaded.base_dir
        )
        self.router = hyp.variants[variant].router
        self.workloads: list[tuple[int, Sequence[Request]]] = [
            (r, load_requests(resolved.workload, base_dir=loaded.base_dir,
                              seed=derive_seed(hyp.seed, "workload", r)))
            for r in range(repeats)
        ]  # fmt: skip

    def records(
        self, profile: EngineProfile, runs: Sequence[tuple[int, Sequence[Request]]]
    ) -> list[RequestRecord]:
        """The records of `runs` (repeat, requests) under `profile`, pooled."""
        costs = ProfileCostModel(self.roofline.instances, self.resolved.costs, profile,
                                 path="(fitting)", sha256="")  # fmt: skip
        records: list[RequestRecord] = []
        router = self.router
        for repeat, requests in runs:
            seed = derive_seed(self.hypothesis.seed, "variant", repeat, self.variant)
            make_policy = functools.partial(build_policy, router.policy, router.params, seed=seed)
            run_replay(costs, self.resolved.sim, make_policy, requests, records.append,
                       variant=self.variant, repeat=repeat)  # fmt: skip
        return records


def fit_to_figures(
    hypothesis_path: Path,
    variant: str,
    figures: PublishedFigures,
    *,
    name: str,
    fit_repeats: int = 20,
    holdout_repeats: int = 20,
    rel_tol: float = 1e-4,
) -> FigureFit:
    """Fit a profile to `figures` on `variant` of a hypothesis (the run the TPOT figure is
    of): workloads 0 … fit_repeats − 1 (those `btb-lab run` draws) pooled for the fit, the
    next `holdout_repeats` held out. The variant's own `costs` block gives the roofline
    whose decode step is scaled (its MBU and the model and GPU presets)."""
    if fit_repeats < 1 or holdout_repeats < 0:
        raise UserError("fit_repeats must be ≥ 1 and holdout_repeats ≥ 0")
    baseline = _Baseline(hypothesis_path, variant, fit_repeats + holdout_repeats)
    resolved = baseline.resolved
    shapes = {(c.decode_step_s, c.decode_context_token_s) for c in baseline.roofline.per_instance}
    if len(shapes) != 1:
        raise UserError(f"variant {variant!r} mixes instance shapes; one profile fits one")
    step_s, context_s = shapes.pop()

    def profile_at(scale: float) -> EngineProfile:
        return figures_profile(
            name, figures, decode_step_s=step_s, decode_context_token_s=context_s, scale=scale
        )

    def tpot(scale: float, runs: Sequence[tuple[int, Sequence[Request]]]) -> float:
        return tpot_percentile(baseline.records(profile_at(scale), runs), figures.tpot_percentile)

    fit_runs, held_runs = baseline.workloads[:fit_repeats], baseline.workloads[fit_repeats:]
    scale, tpot_fit, tried = solve_scale(
        lambda s: tpot(s, fit_runs), figures.tpot_s, rel_tol=rel_tol
    )
    tpot_held = tpot(scale, held_runs) if held_runs else None
    profile = profile_at(scale)
    pct = f"TPOT{figures.tpot_percentile:g}"
    profile.prefill.quality = FitQuality(points=1, mape=0.0, max_abs_error_s=0.0)
    profile.decode.quality = FitQuality(
        points=1,
        holdout_points=1 if tpot_held is not None else 0,
        mape=abs(tpot_fit - figures.tpot_s) / figures.tpot_s,
        holdout_mape=None
        if tpot_held is None
        else abs(tpot_held - figures.tpot_s) / figures.tpot_s,
        max_abs_error_s=abs(tpot_fit - figures.tpot_s),
    )
    profile.description = (
        f"Fitted to {figures.source} where no engine could be measured: prefill at "
        f"{figures.prefill_tokens_per_s:,.0f} uncached tokens/s exactly; the roofline's "
        f"decode step × {scale:.4g}, bisected until the simulator's pooled {pct} of "
        f"`{variant}` in {hypothesis_path.name} over workloads 0–{fit_repeats - 1} met "
        f"the figure's {figures.tpot_s:g} s: {tpot_fit:.5f} s "
        f"({(tpot_fit - figures.tpot_s) / figures.tpot_s:+.2%}"
        + (
            f", within {rel_tol:.0e} relative)."
            if abs(tpot_fit - figures.tpot_s) <= rel_tol * figures.tpot_s
            else "; the pooled percentile steps over the figure there, so the bisection "
            "stops at the scale nearest to it)."
        )
    )
    profile.measured_on = {
        "engine": "none: published figures, fitted against the simulator",
        "method": "btb_lab.calibrate.figures.fit_to_figures (scripts/fit_seed_profile.py)",
        "hypothesis": hypothesis_path.name,
        "variant": variant,
        "model": baseline.roofline.instances[0].model.name,
        "hardware": sorted({f"{g.gpus}×{g.gpu}" for g in resolved.cluster.instances}),
        "roofline": {
            "decode_step_s": step_s,
            "decode_context_token_s": context_s,
            "mbu": resolved.costs.mbu,
        },
        "decode_scale": scale,
        "fit": {
            "workloads": f"0–{fit_repeats - 1}",
            "requests": sum(len(r) for _, r in fit_runs),
            f"{pct.lower()}_target_s": figures.tpot_s,
            f"{pct.lower()}_fitted_s": tpot_fit,
            "residual_s": tpot_fit - figures.tpot_s,
            "evaluations": len(tried),
        },
    }
    if held_runs:
        profile.measured_on["holdout"] = {
            "workloads": f"{fit_repeats}–{fit_repeats + holdout_repeats - 1}",
            "requests": sum(len(r) for _, r in held_runs),
            f"{pct.lower()}_s": tpot_held,
            "residual_s": None if tpot_held is None else tpot_held - figures.tpot_s,
        }
    if figures.checks:
        profile.measured_on["not_fitted"] = _checks(baseline.records(profile, fit_runs), figures)
    return FigureFit(profile, scale, tpot_fit, tpot_held, tried)


def _checks(
    records: Sequence[RequestRecord], figures: PublishedFigures
) -> dict[str, dict[str, float]]:
    """The figures' other numbers beside the fitted simulator's (pooled over the fitted
    workloads): what the fit did not target, to show how far the rest is."""
    out = {}
    for name, value in figures.checks.items():
        metric = METRICS[name]
        if metric.column is None or metric.percentile is None:
            raise UserError(f"check {name!r}: only latency percentiles can be checked")
        got = latency_percentile(records, metric.column, metric.percentile)
        out[name] = {"figure_s": value, "simulator_s": got}
    return out
