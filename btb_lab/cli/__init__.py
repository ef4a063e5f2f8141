"""The thin typer CLI: each command parses, loads, calls one library function, prints.

Heavy imports (pandas, matplotlib, httpx) happen inside commands so `--help` is instant.
Command groups live in sibling modules, one per pipeline area.
"""

from __future__ import annotations

import sys

import typer

from btb_lab.cli import calibrate, cluster, core, sim, sweep, trace
from btb_lab.errors import UserError

__all__ = ["app", "main"]

app = typer.Typer(
    name="btb-lab",
    help="Experiment harness and hypothesis-log runner for LLM-inference research.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
core.register(app)
app.add_typer(trace.app, name="trace")
app.add_typer(sim.app, name="sim")
app.add_typer(cluster.router_app, name="router")
app.add_typer(cluster.model_app, name="model")
sweep.register(app)
calibrate.register(app)


def main() -> None:
    """Entry point: a user mistake prints one message and exits 2, never a traceback."""
    try:
        # Without standalone mode click returns a command's exit code instead of exiting.
        rc = app(standalone_mode=False)
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # click's usage errors arrive here in non-standalone mode
        from pydantic import ValidationError

        if isinstance(exc, typer.Abort):
            sys.exit(130)
        # typer vendors click; its usage errors derive from the public TyperException
        if isinstance(exc, typer.TyperException) and hasattr(exc, "show"):
            exc.show()
            sys.exit(getattr(exc, "exit_code", 2))  # usage errors: 2
        if isinstance(exc, ValidationError):  # settings built from user input outside a file
            for err in exc.errors():
                where = ".".join(str(p) for p in err["loc"]) or "(input)"
                typer.echo(f"error: {where}: {err['msg']}", err=True)
            sys.exit(2)
        raise
    if isinstance(rc, int) and rc:
        sys.exit(rc)
