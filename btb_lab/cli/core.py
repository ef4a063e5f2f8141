"""Core commands: validate, run, report, log, list.

Each command parses, calls one library function, prints. User mistakes (`UserError`)
print one message per problem and exit 2, also under typer's CliRunner.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from btb_lab.errors import OutputError, UserError, describe_os_error

if TYPE_CHECKING:
    from btb_lab.analysis.models import Summary

__all__ = ["log_app", "register"]

F = TypeVar("F", bound=Callable[..., Any])

log_app = typer.Typer(help="The hypothesis log (hypotheses/LOG.md).", no_args_is_help=True)

# `Comparison.same_ranking` in words (None: fewer than two variants to rank)
_RANKING = {True: "same", False: "different", None: "n/a"}

TIME_SCALE_HELP = (
    "Multiply every inter-arrival gap of the workload by this factor: >1 calmer (requests "
    "further apart), <1 denser (a heavier load). Overrides workload.time_scale."
)


def user_errors(func: F) -> F:
    """Turn a UserError into its message on stderr and exit code 2."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except UserError as exc:
            typer.echo(f"error: {exc}" if "\n" not in str(exc) else str(exc), err=True)
            raise typer.Exit(exc.exit_code) from None

    return wrapper  # type: ignore[return-value]


def _explain(model: Any, prefix: str = "") -> list[str]:
    """Every schema field with its description (validate --explain)."""
    from pydantic import BaseModel

    lines: list[str] = []
    for name, info in model.model_fields.items():
        key = info.alias or name
        lines.append(f"{prefix}{key}: {info.description or ''}")
        ann = info.annotation
        for sub in getattr(ann, "__args__", ()) or (ann,):
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                lines += _explain(sub, prefix + key + ".")
            for inner in getattr(sub, "__args__", ()) or ():
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    lines += _explain(inner, prefix + key + ".<item>.")
    return lines


def register(app: typer.Typer) -> None:
    """Add the core commands to the main app."""

    @app.command()
    def version() -> None:
        """Print the btb-lab version."""
        from btb_lab import __version__

        typer.echo(__version__)

    @app.command()
    @user_errors
    def validate(
        files: list[Path] = typer.Argument(None, help="Hypothesis YAML files."),
        explain: bool = typer.Option(False, "--explain", help="List every field and its meaning."),
    ) -> None:
        """Check hypothesis files; exit 2 with one FILE:LINE: field: message per problem."""
        if explain:
            from btb_lab.config.hypothesis import Hypothesis

            typer.echo("\n".join(_explain(Hypothesis)))
            if not files:
                return
        if not files:
            raise UserError("give at least one hypothesis file")
        from btb_lab.errors import ValidationFailed
        from btb_lab.hypothesis import load_hypothesis

        problems: list[str] = []
        for path in files:
            try:
                loaded = load_hypothesis(path)
            except ValidationFailed as exc:
                problems += exc.problems
            except UserError as exc:
                problems.append(str(exc))
            else:
                typer.echo(f"{path}: ok ({loaded.hypothesis.id}, "
                           f"{len(loaded.hypothesis.variants)} variants)")  # fmt: skip
        if problems:
            raise UserError("\n".join(problems))

    @app.command()
    @user_errors
    def run(
        file: Path = typer.Argument(..., help="Hypothesis YAML file."),
        backend: str | None = typer.Option(
            None,
            "--backend",
            help="sim or cluster; several, comma-separated (sim,cluster), run the hypothesis "
            "on each and compare the runs in one directory.",
        ),
        calibrate: bool = typer.Option(
            False,
            "--calibrate",
            help="With --backend sim,cluster: first fit an engine profile to the cluster's "
            "first instance and run the simulator on it.",
        ),
        out: Path | None = typer.Option(
            None, "--out", help="Results directory (default results/<id>/<UTC time>-<short id>/)."
        ),
        repeats: int | None = typer.Option(None, "--repeats", help="Repeats of every variant."),
        requests: int | None = typer.Option(None, "--requests", help="Requests per run."),
        time_scale: float | None = typer.Option(None, "--time-scale", help=TIME_SCALE_HELP),
        variants: str | None = typer.Option(
            None, "--variants", help="Comma-separated variants to run (the baseline is added)."
        ),
        seed: int | None = typer.Option(None, "--seed", help="Master seed."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and exit."),
        set_: list[str] = typer.Option(
            [], "--set", help="Override any field: dotted.path=value (YAML value)."
        ),
        no_progress: bool = typer.Option(False, "--no-progress", help="No progress display."),
        jobs: int = typer.Option(
            0,
            "--jobs",
            envvar="BTB_LAB_JOBS",
            help="Simulator: how many of a repeat's variants run at once, each in a worker "
            "process (the same records); 0: one per core, 1: one after another.",
        ),
    ) -> None:
        """Run every variant × repeat, store the results, print the summary and verdict."""
        from btb_lab.interrupts import exit_code
        from btb_lab.runner import RunInterrupted, RunOptions, run_hypothesis
        from btb_lab.yamlio import parse_assignments

        if jobs < 0:
            raise UserError(f"--jobs must be 0 (one per core) or more (got {jobs})")
        overrides, origins = parse_assignments("--set", set_)
        backends = [b.strip() for b in (backend or "").split(",") if b.strip()]
        chosen = None if variants is None else [v.strip() for v in variants.split(",")]
        options = RunOptions(
            backend=backends[0] if len(backends) == 1 else None, out=out, repeats=repeats,
            requests=requests,
            time_scale=time_scale, seed=seed, dry_run=dry_run,
            variants=None if chosen is None else [v for v in chosen if v],
            progress=not no_progress, overrides=overrides, origins=origins, jobs=jobs,
        )  # fmt: skip
        if len(backends) > 1:
            from btb_lab.crosscheck import run_crosscheck

            try:
                both = run_crosscheck(file, options, backends, calibrate=calibrate)
            except RunInterrupted as exc:
                typer.echo(f"interrupted: finished records kept in {exc.run_dir}", err=True)
                raise typer.Exit(exit_code(exc)) from None
            for name, outcome in both.runs.items():
                assert outcome.summary is not None
                typer.echo(f"[{name}]")
                _print_summary(outcome.summary)
            typer.echo(f"comparison: {both.root / 'compare' / 'compare.md'}")
            return
        if calibrate:
            raise UserError("--calibrate needs --backend sim,cluster")
        try:
            outcome = run_hypothesis(file, options)
        except RunInterrupted as exc:
            where = (f"report: {exc.run_dir / 'report.md'}" if exc.reported else
                     f"no report yet: `btb-lab report {exc.run_dir}` writes it")  # fmt: skip
            typer.echo(f"interrupted: finished records kept in {exc.run_dir} ({where})",
                       err=True)  # fmt: skip
            raise typer.Exit(exit_code(exc)) from None
        if dry_run:
            assert outcome.plan is not None
            typer.echo("\n".join(outcome.plan.describe()))
            return
        assert outcome.summary is not None
        for note in outcome.plan.notes if outcome.plan is not None else []:
            typer.echo(f"note: {note}", err=True)
        _print_summary(outcome.summary)
        typer.echo(f"report: {outcome.run_dir / 'report.md'}")
        from btb_lab.results import Manifest

        failed = Manifest.load(outcome.run_dir).failed_variants
        if failed:  # a crash is recorded, not hidden: scripts see it in the exit status
            typer.echo(f"failed runs of {', '.join(failed)}: their tracebacks are in "
                       f"{outcome.run_dir}", err=True)  # fmt: skip
            raise typer.Exit(1)

    @app.command()
    @user_errors
    def report(
        target: str | None = typer.Argument(
            None, help="Run directory or hypothesis id (its newest full run)."
        ),
        all_: bool = typer.Option(False, "--all", help="Re-render every stored run."),
        results: Path = typer.Option(Path("results"), "--results", help="Results root."),
    ) -> None:
        """Re-render summary.json, report.md and plots from stored results (no backend)."""
        from btb_lab.crosscheck import load_crosscheck
        from btb_lab.report.render import build_report
        from btb_lab.results import resolve_run_dir

        if all_ and target is not None:
            raise UserError(f"--all re-renders every run under {results}/; drop {target}")
        if all_:
            runs = sorted(p.parent for p in results.glob("*/*/manifest.json"))
            if not runs:
                raise UserError(f"no runs under {results}/")
        elif target is None:
            raise UserError("give a run directory or hypothesis id, or --all")
        elif load_crosscheck(Path(target)) is not None:
            runs = [Path(target)]
        else:
            runs = [resolve_run_dir(target, results)]
        unreadable = 0
        for run_dir in runs:
            try:
                _rerender(run_dir, build_report)
            except OutputError:  # a full or read-only disk: every later run fails too
                raise
            except UserError as exc:
                if not all_:
                    raise
                unreadable += 1  # one damaged run does not stop the others
                typer.echo(f"error: {exc}", err=True)
        if unreadable:
            raise UserError(f"{unreadable} of {len(runs)} runs under {results}/ could not be "
                            "re-rendered (each said above); the others were")  # fmt: skip

    def _rerender(run_dir: Path, build_report: Callable[..., Any]) -> None:
        from btb_lab.crosscheck import load_crosscheck

        both = load_crosscheck(run_dir)
        if both is not None:
            from btb_lab.report.compare import write_comparison

            dirs = [run_dir / both.runs[both.reference]]
            dirs += [run_dir / p for b, p in both.runs.items() if b != both.reference]
            for sub in dirs:
                try:
                    run = build_report(sub)
                except OSError as exc:  # a full or read-only disk
                    raise OutputError(describe_os_error(exc, sub)) from None
                typer.echo(f"{sub / 'report.md'}: {run.verdict.word}")
            try:
                write_comparison(dirs, run_dir / both.compare)
            except OSError as exc:
                raise OutputError(describe_os_error(exc, run_dir / both.compare)) from None
            typer.echo(f"{run_dir / both.compare / 'compare.md'}")
            return
        try:
            run = build_report(run_dir)
        except OSError as exc:  # a full or read-only disk: nothing half-written stays
            raise OutputError(describe_os_error(exc, run_dir)) from None
        typer.echo(f"{run_dir / 'report.md'}: {run.verdict.word}")

    @app.command()
    @user_errors
    def compare(
        runs: list[str] = typer.Argument(
            ..., help="Run directories (or hypothesis ids: their newest full run), two or more."
        ),
        out: Path | None = typer.Option(
            None, "--out", help="Output folder (default results/compare/<id>/<UTC time>-<id>/)."
        ),
        force: bool = typer.Option(
            False, "--force", help="Compare runs of different hypotheses or workloads anyway."
        ),
        results: Path = typer.Option(Path("results"), "--results", help="Results root."),
    ) -> None:
        """How far one world's answer is from another's (sim vs real, or any two runs).

        Per variant and class: TTFT / TPOT / E2E errors beside the reference's spread.
        Then whether the verdicts and the variants' ranking agree."""
        from btb_lab.report.compare import write_comparison
        from btb_lab.results import Manifest, new_run_id, resolve_run_dir

        dirs = [resolve_run_dir(r, results) for r in runs]
        if out is None:
            hid = Manifest.load(dirs[0]).hypothesis_id
            out = results / "compare" / hid / new_run_id()
        try:
            comparison = write_comparison(dirs, out, force=force)
        except OSError as exc:
            raise OutputError(describe_os_error(exc, out)) from None
        for warning in comparison.warnings:
            typer.echo(f"warning: {warning}", err=True)
        agree = sum(v.agrees for v in comparison.verdicts)
        typer.echo(
            f"{comparison.model_backend} vs {comparison.reference_backend}: verdicts agree "
            f"{agree}/{len(comparison.verdicts)}, ranking "
            f"{_RANKING[comparison.same_ranking]}"
        )
        typer.echo(f"comparison: {out / 'compare.md'}")

    @log_app.command("append")
    @user_errors
    def log_append(
        run_dir: str = typer.Argument(..., help="Run directory or hypothesis id."),
        log: Path = typer.Option(Path("hypotheses/LOG.md"), "--log", help="Log file."),
        results: Path = typer.Option(Path("results"), "--results", help="Results root."),
        replace: bool = typer.Option(
            False,
            "--replace",
            help="Put the entry in place of the hypothesis's entry from an earlier run "
            "(same position; any later entries of it removed) instead of appending.",
        ),
    ) -> None:
        """Append (or update) the run's verdict entry in the log."""
        from btb_lab.crosscheck import load_crosscheck
        from btb_lab.report.log import append_entry
        from btb_lab.results import resolve_run_dir

        both = load_crosscheck(Path(run_dir))
        compare_dir: Path | None = None
        if both is not None:  # the real run's entry, with the comparison's agreement
            path = Path(run_dir) / both.runs[both.reference]
            compare_dir = Path(run_dir) / both.compare
        else:
            path = resolve_run_dir(run_dir, results)
        try:
            append_entry(path, log, compare_dir=compare_dir, replace=replace)
        except OSError as exc:
            raise OutputError(describe_os_error(exc, log.parent)) from None
        typer.echo(f"{log}: entry for {path}")
        _say_if_edited(path)

    @log_app.command("show")
    @user_errors
    def log_show(
        log: Path = typer.Option(Path("hypotheses/LOG.md"), "--log", help="Log file."),
    ) -> None:
        """List the log's entries and verdicts as a table."""
        from rich.console import Console
        from rich.table import Table

        from btb_lab.report.log import parse_log, read_log

        if log.is_dir():
            raise UserError(f"{log}: a folder, not a log file (--log names the file, e.g. "
                            "hypotheses/LOG.md)")  # fmt: skip
        if not log.is_file():
            raise UserError(f"{log}: no such log file")
        table = Table("id", "title", "verdict", "run")
        for entry in parse_log(read_log(log)):
            table.add_row(entry.hypothesis, entry.title, entry.verdict or "-",
                          entry.run or "(hand-written)")  # fmt: skip
        Console(width=160).print(table)

    app.add_typer(log_app, name="log")

    @app.command("list")
    @user_errors
    def list_(
        hypotheses: Path = typer.Option(Path("hypotheses"), "--hypotheses", help="Folder."),
        results: Path = typer.Option(Path("results"), "--results", help="Results root."),
        policies: bool = typer.Option(False, "--policies", help="List routing policies."),
    ) -> None:
        """List hypotheses with their latest verdict (or the registered policies)."""
        from rich.console import Console
        from rich.table import Table

        if policies:
            from btb_lab.policies import POLICIES

            table = Table("policy", "parameters")
            for name in POLICIES:
                params = POLICIES.get(name).Params.model_fields
                table.add_row(name, ", ".join(params) or "-")
            Console(width=160).print(table)
            return
        from btb_lab.hypothesis.changes import changed_since
        from btb_lab.report.listing import edited_notes, list_hypotheses, shared_ids

        rows = list_hypotheses(hypotheses, results, changed_since)
        table = Table("id", "title", "file", "latest verdict", "run")
        for row in rows:
            verdict = (row.verdict or "-") + ("*" if row.edited else "")
            table.add_row(row.id, row.title, str(row.path), verdict, row.run or "-")
        Console(width=160).print(table)
        for line in [*shared_ids(rows), *edited_notes(rows)]:
            typer.echo(line, err=True)


def _say_if_edited(run_dir: Path) -> None:
    """A warning when the run's hypothesis file (where it ran from) changed since: its
    log entry is of the settings the run had, which the file no longer says."""
    from btb_lab.hypothesis.changes import changed_since
    from btb_lab.results import Manifest

    manifest = Manifest.load(run_dir)
    source = Path(manifest.hypothesis_file)
    if not source.is_file():
        return
    edited = changed_since(source, manifest.hypothesis)
    if edited is not None:
        typer.echo(f"warning: {source} changed since this run ({edited}): the entry is of "
                   "the settings the run had", err=True)  # fmt: skip


def _print_summary(summary: Summary) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(x: float | None, digits: int = 3) -> str:
        return "n/a" if x is None else f"{x:.{digits}f}"

    table = Table("variant", "OK/N", "TTFT50 (s)", "TTFT90 (s)", "TPOT90 (s)", "E2E50 (s)",
                  "GPU imb.")  # fmt: skip
    for name, v in summary.variants.items():
        m = v.all
        imb = v.gpu.imbalance
        table.add_row(
            name + (" (baseline)" if name == summary.baseline else ""),
            f"{m.ok}/{m.n}", fmt(m.ttft_p50), fmt(m.ttft_p90), fmt(m.tpot_p90, 4),
            fmt(m.e2e_p50), "n/a" if imb is None else f"{imb:.2f}x",
        )  # fmt: skip
    console = Console(width=120)
    console.print(table)
    console.print(f"[bold]Verdict: {summary.verdict.word}[/bold]. {summary.verdict.reason}.")
