"""`btb-lab sweep`: run a sweep file's points (locally or on Ray) into one table and plot."""

from __future__ import annotations

from pathlib import Path

import typer

from btb_lab.errors import UserError

__all__ = ["register"]

JOBS_HELP = (
    "Points run in parallel processes (local executor). 0: one per core, as many as memory "
    "allows (the first point runs alone; its process's peak memory sets how many run at "
    "once after it); 1: one after another."
)


def register(app: typer.Typer) -> None:
    """Add the sweep command to the main app."""

    @app.command()
    def sweep(
        file: Path = typer.Argument(..., help="Sweep file (see experiments/)."),
        jobs: int = typer.Option(0, "--jobs", "-j", min=0, help=JOBS_HELP),
        executor: str | None = typer.Option(
            None,
            "--executor",
            help="local (this machine) or ray (tasks on RAY_ADDRESS, or a local Ray "
            "instance when unset). Default: the sweep file's `executor`.",
        ),
        out: Path | None = typer.Option(
            None, "--out", help="Sweep directory (default results/sweeps/<name>/)."
        ),
        seed: int | None = typer.Option(
            None,
            "--seed",
            min=0,
            help="Master seed for every point (refused when the points set `seed` "
            "themselves). Points run with another seed are run again in place; give --out "
            "to keep both.",
        ),
        dry_run: bool = typer.Option(False, "--dry-run", help="List the points and exit."),
    ) -> None:
        """Run every point of a sweep, then write its table and plot.

        Each point is its own run directory; finished points are skipped (resume).
        table.csv, table.md and plot.png go into the sweep directory."""
        from btb_lab.sweep import default_sweep_dir, expand_points, load_sweep, run_sweep
        from btb_lab.sweep.engine import check_points, plan_tasks

        if executor not in (None, "local", "ray"):
            raise UserError(f"--executor: {executor!r} is not one of: local, ray")
        if dry_run:
            loaded = load_sweep(file)
            points = expand_points(loaded.spec)
            target = out or default_sweep_dir(loaded)
            check_points(loaded, plan_tasks(loaded, target, seed=seed, points=points))
            typer.echo(f"sweep {loaded.spec.name}: base {loaded.base_path}, {len(points)} points")
            for p in points:
                ov = ", ".join(f"{k}={v}" for k, v in p.overrides.items())
                typer.echo(f"  {p.point_id}: {ov}")
            typer.echo(f"output: {target}")
            return
        outcome = run_sweep(
            file,
            jobs=jobs,
            executor="ray" if executor == "ray" else ("local" if executor else None),
            out=out,
            seed=seed,
            echo=typer.echo,
        )
        md = outcome.outputs.get("markdown")
        if md is not None:
            typer.echo(md.read_text(encoding="utf-8"))
        for name, path in outcome.outputs.items():
            typer.echo(f"{name}: {path}")
        if outcome.failed:
            typer.echo(f"{len(outcome.failed)} point(s) failed:", err=True)
            for pid, err in outcome.failed.items():
                typer.echo(f"  {pid}: {err}", err=True)
            raise typer.Exit(1)

    @app.command()
    def ablate(
        file: Path = typer.Argument(..., help="Sweep file whose one axis lists the setups."),
        profile: str = typer.Option(
            "infer-sim", "--from", help="Fidelity profile to start from (sim.profile)."
        ),
        jobs: int = typer.Option(0, "--jobs", "-j", min=0, help=JOBS_HELP),
        executor: str | None = typer.Option(None, "--executor", help="local or ray."),
        out: Path | None = typer.Option(
            None, "--out", help="Output directory (default results/ablations/<name>/)."
        ),
        set_: list[str] = typer.Option(
            [], "--set", help="KEY=VALUE override for every point (YAML value), repeatable."
        ),
    ) -> None:
        """Assumption waterfall: a profile's rules switched to btb-lab's one at a time.

        Each step switches one more rule to btb-lab's causal default (cumulative).
        Writes every step's sweep, then waterfall.csv / .md / .png: headline per step."""
        from btb_lab.sweep.ablate import run_ablation
        from btb_lab.yamlio import parse_assignments

        if executor not in (None, "local", "ray"):
            raise UserError(f"--executor: {executor!r} is not one of: local, ray")
        extra, origins = parse_assignments("--set", set_)
        outputs = run_ablation(
            file, profile, out=out, jobs=jobs, executor=executor, extra=extra, origins=origins,
            echo=typer.echo,
        )  # fmt: skip
        typer.echo(outputs["waterfall_md"].read_text(encoding="utf-8"))
        for name, path in outputs.items():
            typer.echo(f"{name}: {path}")
