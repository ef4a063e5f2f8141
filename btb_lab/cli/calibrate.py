"""`btb-lab calibrate`: fit an engine cost profile to a real server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer

from btb_lab.cli.core import user_errors
from btb_lab.errors import UserError

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    @app.command()
    @user_errors
    def calibrate(
        hypothesis: Path | None = typer.Argument(
            None, help="Hypothesis whose cluster block's first instance is launched and measured."
        ),
        endpoint: str | None = typer.Option(
            None, "--endpoint", help="Measure this running server instead (http://host:port)."
        ),
        model: str | None = typer.Option(None, "--model", help="Served model (with --endpoint)."),
        max_context: int = typer.Option(2048, "--max-context", min=128, help="With --endpoint."),
        max_batch: int = typer.Option(16, "--max-batch", min=1, help="With --endpoint."),
        block_tokens: int = typer.Option(16, "--block-tokens", min=1, help="With --endpoint."),
        vocab_size: int = typer.Option(32000, "--vocab-size", min=2, help="With --endpoint."),
        out: Path = typer.Option(..., "--out", "-o", help="Profile file to write (YAML)."),
        name: str | None = typer.Option(None, "--name", help="Profile name (default: file stem)."),
        repeats: int = typer.Option(3, "--repeats", min=1, help="Measurements per point."),
        seed: int | None = typer.Option(
            None,
            "--seed",
            min=0,
            help="Seed of the random prompts (default: a fresh one, recorded in the profile; "
            "a server's prefix cache holds the prompts of a seed it was sent before).",
        ),
        request_timeout_s: float = typer.Option(
            600.0,
            "--request-timeout",
            min=1.0,
            help="Seconds one request may take before the calibration fails.",
        ),
    ) -> None:
        """Measure prefill and decode curves and write a fitted cost profile.

        Prints the fit's quality, including points held out of the fit."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        from btb_lab.calibrate.run import CalibrationTarget, calibrate, target_from_hypothesis

        launcher = None
        specs = None
        _check_out(out)  # before the measuring, not after it
        if (hypothesis is None) == (endpoint is None):
            raise UserError("give a hypothesis file or --endpoint URL (one of them)")
        if endpoint is not None:
            if model is None:
                raise UserError("--endpoint needs --model (the served model name or path)")
            target = CalibrationTarget(
                base_url=endpoint, model=model, max_context=max_context, max_batch=max_batch,
                block_tokens=block_tokens, vocab_size=vocab_size,
                settings={"endpoint": endpoint},
            )  # fmt: skip
        else:
            assert hypothesis is not None
            target, (launcher, specs) = target_from_hypothesis(hypothesis)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()) as bar:

            def progress(label: str, total: int) -> Callable[[], None]:
                task = bar.add_task(label, total=total)
                return lambda: bar.advance(task)

            if launcher is not None:
                from btb_lab.cluster.launcher import sigterm_raises

                with sigterm_raises(), launcher:
                    launcher.start(specs, label="calibrate")
                    profile = calibrate(target, name=name or out.stem, repeats=repeats,
                                        seed=seed, request_timeout_s=request_timeout_s,
                                        progress=progress)  # fmt: skip
            else:
                profile = calibrate(target, name=name or out.stem, repeats=repeats, seed=seed,
                                    request_timeout_s=request_timeout_s,
                                    progress=progress)  # fmt: skip
        profile.save(out)
        for part in (profile.prefill, profile.decode):
            q = part.quality
            assert q is not None
            kind = "prefill" if part is profile.prefill else "decode"
            held = "n/a" if q.holdout_mape is None else f"{q.holdout_mape * 100:.1f}%"
            typer.echo(
                f"{kind}: {q.points} points fitted, MAPE {q.mape * 100:.1f}%, max residual "
                f"{q.max_abs_error_s * 1e3:.2f} ms; {q.holdout_points} held out, MAPE {held}"
            )
        p, d = profile.prefill, profile.decode
        typer.echo(
            f"prefill = {p.fixed_s * 1e3:.3f} ms + {p.per_token_s * 1e6:.3f} µs/token + "
            f"{p.per_token_context_s * 1e9:.4f} ns/(token·context) + "
            f"{p.per_cached_token_s * 1e6:.3f} µs/cached token"
        )
        typer.echo(
            f"decode step = {d.fixed_s * 1e3:.3f} ms + {d.per_seq_s * 1e6:.2f} µs/seq + "
            f"{d.per_context_token_s * 1e9:.3f} ns/context token"
        )
        if "Not measured:" in (profile.description or ""):
            typer.echo("note: " + (profile.description or "").split("Not measured: ", 1)[1])
        typer.echo(f"profile: {out} (prompts of seed {profile.measured_on.get('seed')})")


def _check_out(out: Path) -> None:
    """Refuse an --out the profile cannot be written to, before minutes of measuring."""
    if out.is_dir():
        raise UserError(f"--out {out}: a folder; name the profile file to write (e.g. "
                        f"{out / 'profile.yaml'})")  # fmt: skip
    folder = next((p for p in out.parents if p.exists()), None)
    if folder is not None and not folder.is_dir():
        raise UserError(f"--out {out}: {folder} is a file, not a folder")
