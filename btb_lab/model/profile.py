"""Engine cost profiles: an engine's costs fitted to measurements (`btb-lab calibrate`),
the alternative to the roofline (`costs.model: {profile: PATH}`).

A profile is a YAML file holding the fitted coefficients, their fit quality (residuals and
the error on points held out of the fit), and what they were measured on (engine and
version, model, hardware, block size, settings). Its cost functions:

- prefill of n uncached tokens on top of c cached ones:
  fixed_s + per_token_s · n + per_token_context_s · n · (c + n / 2) + per_cached_token_s · c
  (a fixed per-request cost, linear compute, attention over the context so far, and the
  cost of bringing a cached prefix into use);
- one decode step of a batch of b sequences holding K context tokens in all:
  fixed_s + per_seq_s · b + per_context_token_s · K;
- a KV transfer of n tokens between instances (when measured): fixed_s + per_token_s · n.

The simulator advances its clock by these; cost-based policies price work with them.

A profile fitted to published figures rather than to measured points (a seed's prefill
rate and one TPOT percentile of its baseline, `btb_lab.calibrate.figures`) says so in
`fitted_to`, the whole profile's and each part's. The cost model turns that into the
lines a manifest, a report and a log entry carry (`costs.calibrated`,
`costs.not_calibrated`): which costs are calibrated, and to what, and which still come
from the presets.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from btb_lab.config.base import numbers_only
from btb_lab.errors import UserError
from btb_lab.model.costmodel import InstanceCosts, RooflineCostModel

if TYPE_CHECKING:
    from btb_lab.config.costs import CostSettings
    from btb_lab.model.hardware import InstanceSpec

__all__ = [
    "DecodeFit",
    "EngineProfile",
    "FitQuality",
    "PrefillFit",
    "ProfileCostModel",
    "TransferFit",
    "load_profile",
]

_FITTED_TO = (
    "What this part's coefficients were fitted to when not to the profile's measured "
    "`points` (published figures, another simulator's constants); shown in reports and "
    "log entries."
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        """`per_seq_s: true` is a slip, not 1 s a sequence (as in hypotheses)."""
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and numbers_only(field.annotation):
                raise ValueError("Input should be a number, not true or false")
        return value


# every coefficient is at most an hour: beyond any engine, and a value like 1e300 (or
# milliseconds typed as seconds a million-fold) overflowed the simulated clock mid-run
MAX_COST_S = 3600.0


class FitQuality(_Strict):
    """How well a fit reproduces its measurements."""

    points: int = Field(ge=0, description="Measured points the fit used.")
    holdout_points: int = Field(0, ge=0, description="Points held out of the fit.")
    mape: float = Field(ge=0, description="Mean absolute percentage error on the fitted points.")
    holdout_mape: float | None = Field(None, ge=0, description="The same on held-out points.")
    max_abs_error_s: float = Field(ge=0, description="Largest absolute residual, seconds.")


class PrefillFit(_Strict):
    fixed_s: float = Field(
        ge=0, le=MAX_COST_S, description="Fixed cost of one prefill (scheduling, HTTP)."
    )
    per_token_s: float = Field(ge=0, le=MAX_COST_S, description="Per uncached prompt token.")
    per_token_context_s: float = Field(
        0.0, ge=0, le=MAX_COST_S, description="Attention term: per (new token × context token)."
    )
    per_cached_token_s: float = Field(
        0.0, ge=0, le=MAX_COST_S, description="Per cached prompt token brought into use."
    )
    fitted_to: str | None = Field(None, description=_FITTED_TO)
    quality: FitQuality | None = None


class DecodeFit(_Strict):
    fixed_s: float = Field(ge=0, le=MAX_COST_S, description="Fixed cost of one decode step.")
    per_seq_s: float = Field(
        0.0, ge=0, le=MAX_COST_S, description="Per running sequence in the step."
    )
    per_context_token_s: float = Field(
        0.0, ge=0, le=MAX_COST_S, description="Per context token (all sequences) read in the step."
    )
    fitted_to: str | None = Field(None, description=_FITTED_TO)
    quality: FitQuality | None = None


class TransferFit(_Strict):
    fixed_s: float = Field(ge=0, le=MAX_COST_S, description="Fixed cost of one KV transfer.")
    per_token_s: float = Field(ge=0, le=MAX_COST_S, description="Per transferred token of KV.")
    fitted_to: str | None = Field(None, description=_FITTED_TO)
    quality: FitQuality | None = None


class EngineProfile(_Strict):
    """A profile file."""

    name: str = Field(description="Short name, e.g. tiny-llama-vllm-cpu.")
    description: str | None = None
    measured_on: dict[str, Any] = Field(
        default_factory=dict,
        description="Engine and version, model, hardware, block size, engine settings, date.",
    )
    fitted_to: str | None = Field(
        None,
        description="What the profile was fitted to when not to measurements of an engine "
        "(e.g. a seed's published figures); recorded in manifests, reports and log entries.",
    )
    prefill: PrefillFit
    decode: DecodeFit
    transfer: TransferFit | None = None
    points: list[dict[str, Any]] = Field(
        default_factory=list, description="The measured points (raw, for re-fitting)."
    )

    @field_validator("points")
    @classmethod
    def _points_are_measurements(cls, points: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Counts and seconds of a measurement: finite and not negative (a point's values
        are read back by a re-fit and counted in manifests)."""
        for i, point in enumerate(points):
            for key, value in point.items():
                number = isinstance(value, int | float) and not isinstance(value, bool)
                if number and not (math.isfinite(value) and value >= 0):
                    raise ValueError(f"point {i}: {key} {value!r} is not a finite count or time")
        return points

    def prefill_s(self, tokens: float, cached_tokens: float = 0.0) -> float:
        p = self.prefill
        return (
            p.fixed_s
            + p.per_token_s * tokens
            + p.per_token_context_s * tokens * (cached_tokens + tokens / 2)
            + p.per_cached_token_s * cached_tokens
        )

    def decode_step_s(self, batch: int, context_tokens: float) -> float:
        d = self.decode
        return d.fixed_s + d.per_seq_s * batch + d.per_context_token_s * context_tokens

    def save(self, path: Path) -> None:
        text = yaml.safe_dump(
            self.model_dump(mode="json", exclude_none=True), sort_keys=False, allow_unicode=True
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        try:
            tmp.replace(path)
        except OSError:
            tmp.unlink(missing_ok=True)  # no finished-looking copy left beside a failure
            raise


def load_profile(path: Path) -> tuple[EngineProfile, str]:
    """A profile and the sha256 of its file (a UserError naming the file and field)."""
    from btb_lab.yamlio import compose_yaml

    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such profile file (make one with `btb-lab calibrate`)") \
            from None  # fmt: skip
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, not a profile file") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: unreadable profile: not a text (UTF-8) file") from None
    except OSError as exc:
        raise UserError(f"{path}: unreadable profile: {exc.strerror or exc}") from None
    # the hypothesis loader's checks: no tags, duplicate keys, control characters or
    # alias bombs; every problem names its line
    data, lines = compose_yaml(text, path)
    try:
        profile = EngineProfile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = tuple(first["loc"])
        where = ".".join(str(p) for p in loc) or "(top level)"
        while loc and loc not in lines:
            loc = loc[:-1]
        line = lines.get(loc, 1)
        raise UserError(f"{path}:{line}: {where}: {first['msg']}") from None
    return profile, hashlib.sha256(raw).hexdigest()


class ProfileCostModel(RooflineCostModel):
    """Costs from a fitted engine profile. Hardware facts the profile does not measure (KV
    bytes, tier bandwidths for host RAM and disk, the KV budget) still come from the
    presets, so memory behaves as on the roofline; compute and decode come from the fit,
    and KV transfers too when the profile measured them."""

    name = "profile"

    def __init__(
        self,
        instances: list[InstanceSpec],
        settings: CostSettings,
        profile: EngineProfile,
        *,
        path: str,
        sha256: str,
    ) -> None:
        self.profile = profile
        self.path = path
        self.sha256 = sha256
        super().__init__(instances, settings)
        if profile.transfer is not None:
            self.transfer_setup_s = profile.transfer.fixed_s

    def _instance_costs(self, spec: InstanceSpec) -> InstanceCosts:
        base = super()._instance_costs(spec)
        p, d = self.profile.prefill, self.profile.decode
        return InstanceCosts(
            prefill_token_s=p.per_token_s,
            decode_step_s=d.fixed_s,
            decode_context_token_s=d.per_context_token_s,
            ram_token_s=base.ram_token_s,
            disk_token_s=base.disk_token_s,
            prefill_fixed_s=p.fixed_s,
            prefill_context_token_s=p.per_token_context_s,
            prefill_cached_token_s=p.per_cached_token_s,
            decode_seq_s=d.per_seq_s,
        )

    def kv_move_s(self, tokens: int, source: int, target: int) -> float:
        """The fitted per-token transfer cost when the profile measured transfers (its
        fixed cost is `transfer_setup_s`), else the link bandwidth."""
        t = self.profile.transfer
        if t is None:
            return super().kv_move_s(tokens, source, target)
        return t.per_token_s * tokens

    def calibrated(self) -> list[str]:
        prof = self.profile
        parts: list[tuple[str, PrefillFit | DecodeFit | TransferFit | None]] = [
            ("prefill", prof.prefill), ("decode step", prof.decode),
            ("KV transfer between instances", prof.transfer),
        ]  # fmt: skip
        return [
            f"{label}: profile `{prof.name}`, fitted to {_source(part, prof)}"
            for label, part in parts
            if part is not None
        ]

    def not_calibrated(self) -> list[str]:
        preset = self._preset_costs()
        if self.profile.transfer is not None:  # the profile measured KV transfers
            preset = preset[1:]
        return preset

    def facts(self) -> dict[str, Any]:
        facts = super().facts()
        facts.update(
            {
                "costs.model": "profile",
                "costs.profile.path": self.path,
                "costs.profile.sha256": self.sha256,
                "costs.profile.name": self.profile.name,
                "costs.profile.fitted_to": self.profile.fitted_to
                or f"{len(self.profile.points)} measured points",
                "costs.profile.prefill": self.profile.prefill.model_dump(exclude={"quality"}),
                "costs.profile.decode": self.profile.decode.model_dump(exclude={"quality"}),
                "costs.profile.measured_on": self.profile.measured_on,
            }
        )
        if self.profile.transfer is not None:
            facts["costs.profile.transfer"] = self.profile.transfer.model_dump(exclude={"quality"})
        return facts


def _source(part: PrefillFit | DecodeFit | TransferFit, profile: EngineProfile) -> str:
    """What one part of a profile was fitted to: its own `fitted_to`, else the measured
    points of its kind (a profile written by `btb-lab calibrate`)."""
    if part.fitted_to:
        return part.fitted_to
    kind = {PrefillFit: "prefill", DecodeFit: "decode", TransferFit: "transfer"}[type(part)]
    n = sum(1 for p in profile.points if p.get("kind") == kind)
    if n:
        return f"{n} measured {kind} points"
    if part.quality is not None:
        return f"{part.quality.points + part.quality.holdout_points} measured {kind} points"
    return profile.fitted_to or "unstated measurements"
